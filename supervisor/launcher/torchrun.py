"""The torchrun launcher: the user's script under `torchrun`, run as one local process group.

torchrun's own restarts are off (`--max-restarts 0`): the supervisor decides what a failure means and where
the next segment restores from. Its elastic agent sits at the top of the group, so stopping the segment
signals torchrun and every rank at once (the local launcher's process-group machinery).
"""

from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass, replace

from supervisor.launcher.base import Launcher, LaunchSpec, OnLine, SegmentHandle
from supervisor.launcher.local import LocalLauncher


@dataclass(frozen=True)
class TorchrunOptions:
    """How torchrun starts the ranks of one node."""

    nproc_per_node: int = 1
    """Processes (ranks) on this node; checked to be >= 1."""
    rdzv_backend: str = "c10d"
    """The rendezvous backend; c10d needs no external store."""
    rdzv_endpoint: str = "localhost:0"
    """host:port of the rendezvous; port 0 lets torchrun pick a free one (single node)."""
    nnodes: str = "1"
    """Nodes, or a range `MIN:MAX` for an elastic job."""
    extra_args: tuple[str, ...] = ()
    """Further torchrun options, placed before the script."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node: expected an integer >= 1, got {self.nproc_per_node!r}")


def script_args(command: tuple[str, ...]) -> tuple[str, ...]:
    """The user's command without its Python interpreter: torchrun runs the script with its own."""
    if command and _is_python(command[0]):
        return command[1:]
    return command


def _is_python(arg: str) -> bool:
    name = os.path.basename(arg)
    return arg == sys.executable or name.startswith("python")


class TorchrunLauncher:
    """Runs `torchrun --nproc-per-node N --rdzv-backend c10d ... <script> <args>` through another launcher."""

    def __init__(self, options: TorchrunOptions, inner: Launcher | None = None):
        self.options = options
        self.inner: Launcher = inner if inner is not None else LocalLauncher()

    def command(self, user_command: tuple[str, ...], rdzv_id: str | None = None) -> tuple[str, ...]:
        """The torchrun command line around `user_command` (`python train.py ...` or `train.py ...`)."""
        o = self.options
        return (
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            o.nnodes,
            "--nproc-per-node",
            str(o.nproc_per_node),
            "--rdzv-backend",
            o.rdzv_backend,
            "--rdzv-endpoint",
            o.rdzv_endpoint,
            "--rdzv-id",
            rdzv_id or uuid.uuid4().hex[:12],
            "--max-restarts",
            "0",
            *o.extra_args,
            *script_args(user_command),
        )

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> SegmentHandle:
        return self.inner.start(replace(spec, command=self.command(spec.command)), on_line)
