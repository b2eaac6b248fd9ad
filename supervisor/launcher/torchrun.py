"""The torchrun launcher: the user's script under `torchrun`, run as one local process group.

torchrun's own restarts are off (`--max-restarts 0`): the supervisor decides what a failure means and where
the next segment restores from. Its elastic agent sits at the top of the group, so stopping the segment
signals torchrun and every rank at once (the local launcher's process-group machinery). The agent dies of
SIGUSR2 at once (it handles only SIGTERM, SIGINT, SIGHUP and SIGQUIT); the local launcher then waits out the
grace for the ranks. On SIGTERM the agent itself kills the ranks after its own fixed 30 s, whatever the stop
grace: an emergency save longer than that is cut short under torchrun.

When a rank fails, the agent exits 1 and names the first failed rank's exit code in the "Root Cause" block of
its stderr; the handle reports that code, so that the training's exit codes (stopped, preempted, anomaly)
mean what they mean under the local launcher.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from supervisor.errors import UserError
from supervisor.launcher.base import ExitInfo, Launcher, LaunchSpec, OnLine, SegmentHandle
from supervisor.launcher.local import LocalLauncher

#: Interpreter options that take no argument and may stand before `-m torch.distributed.run`.
_FLAGS = frozenset({"-u", "-B", "-E", "-s", "-S", "-I", "-O", "-OO", "-b", "-bb", "-q", "-v", "-P"})
#: Interpreter options whose value follows (`-W error` or `-Werror`).
_VALUED = ("-W", "-X")
_ROOT_CAUSE = re.compile(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


@dataclass(frozen=True)
class TorchrunOptions:
    """How torchrun starts the ranks of one node."""

    nproc_per_node: int = 1
    """Processes (ranks) on this node; checked to be >= 1."""
    rdzv_backend: str = "c10d"
    """The rendezvous backend; c10d needs no external store."""
    rdzv_endpoint: str = "localhost:0"
    """host:port of the rendezvous; port 0 lets torchrun pick a free one (single node only)."""
    nnodes: str = "1"
    """Nodes, or a range `MIN:MAX` for an elastic job; more than one needs an explicit rendezvous endpoint."""
    extra_args: tuple[str, ...] = ()
    """Further torchrun options, placed before the script."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise UserError(f"nproc_per_node: expected an integer >= 1, got {self.nproc_per_node!r}")
        if self.rdzv_endpoint.endswith(":0") and self.nnodes != "1":
            raise UserError(
                f"nnodes {self.nnodes!r} with rendezvous endpoint {self.rdzv_endpoint!r}: port 0 works on a "
                "single node only; a multi-node job needs an explicit endpoint (host:port reachable from "
                "every node), or set nnodes to '1'"
            )


@dataclass(frozen=True)
class Split:
    """A user's command taken apart: the interpreter and its options, and what torchrun runs."""

    interpreter: str
    flags: tuple[str, ...]
    script: tuple[str, ...]


def split_command(command: tuple[str, ...]) -> Split:
    """Take the Python interpreter and its options off `command`; without one, the supervisor's Python runs."""
    if not command or not _is_python(command[0]):
        return Split(sys.executable, (), command)
    flags: list[str] = []
    rest = list(command[1:])
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        arg = rest.pop(0)
        if arg in _FLAGS:
            flags.append(arg)
        elif arg in _VALUED and rest:
            flags += [arg, rest.pop(0)]
        elif arg.startswith(_VALUED) and len(arg) > 2:
            flags.append(arg)
        else:
            raise UserError(
                f"torchrun launcher: the interpreter option {arg!r} in {' '.join(command)!r} cannot be "
                "passed through torchrun; run a script or `-m module`, with options among "
                f"{', '.join(sorted(_FLAGS | set(_VALUED)))}"
            )
    return Split(command[0], tuple(flags), tuple(rest))


def script_args(command: tuple[str, ...]) -> tuple[str, ...]:
    """The user's command without its Python interpreter and options: what torchrun runs in each rank."""
    return split_command(command).script


def _is_python(arg: str) -> bool:
    name = os.path.basename(arg)
    return arg == sys.executable or name.startswith("python")


def root_cause_exitcode(stderr: str) -> int | None:
    """The exit code of the first failed rank, from torchrun's "Root Cause" failure summary."""
    found = _ROOT_CAUSE.findall(stderr)
    return int(found[-1]) if found else None


class TorchrunSegment:
    """A torchrun segment: the local handle, reporting the failed rank's exit code instead of the agent's."""

    def __init__(self, inner: SegmentHandle):
        self.inner = inner

    @property
    def handle_id(self) -> str:
        return self.inner.handle_id

    def details(self) -> dict[str, Any]:
        return self.inner.details()

    def started(self) -> bool:
        return self.inner.started()

    def poll(self) -> int | None:
        return self.inner.poll()

    def wait_exit(self, timeout: float) -> int | None:
        return self.inner.wait_exit(timeout)

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        self.inner.stop(grace_seconds, sig)

    def kill(self) -> None:
        self.inner.kill()

    def wait(self, timeout: float | None = None) -> ExitInfo:
        info = self.inner.wait(timeout)
        if info.returncode != 1:  # the agent exits 1 (ChildFailedError) when a rank failed
            return info
        code = root_cause_exitcode(info.stderr_tail)
        return info if code is None else dataclasses.replace(info, returncode=code)


class TorchrunLauncher:
    """Runs `<python> -m torch.distributed.run --nproc-per-node N ... <script> <args>` through another launcher.

    The user's interpreter (and its options, e.g. `-u`) runs the agent, and torchrun runs the ranks with it.
    """

    def __init__(self, options: TorchrunOptions, inner: Launcher | None = None):
        self.options = options
        self.inner: Launcher = inner if inner is not None else LocalLauncher()

    def command(self, user_command: tuple[str, ...], rdzv_id: str | None = None) -> tuple[str, ...]:
        """The torchrun command line around `user_command` (`python train.py ...` or `train.py ...`)."""
        o = self.options
        split = split_command(user_command)
        return (
            split.interpreter,
            *split.flags,
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
            *split.script,
        )

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> TorchrunSegment:
        return TorchrunSegment(self.inner.start(replace(spec, command=self.command(spec.command)), on_line))

    def reclaim(self, details: Mapping[str, Any]) -> None:
        """The agent leads the process group: the inner launcher's reclaim ends it and its ranks."""
        self.inner.reclaim(details)
