"""The warm standby under torchrun, on one node: a whole torchrun agent parked with its ranks.

While a segment runs, `TorchrunStandbyLauncher` starts the next segment's torchrun agent
(`python -m torch.distributed.run --nproc-per-node N ... standby_child.py <config>`). The agent does its
rendezvous (on a free port: `localhost:0`) and starts its N ranks as a cold start would, except that each rank
runs `standby_child.py`: it imports what the script imports (or, with `park: plan`, runs the script up to its
first `load_plan`, process group and model included) and parks. Each rank reports through a file
(`ready-<LOCAL_RANK>.json` in the standby's channel directory; torchrun passes no file descriptors to its
ranks) and polls for its `plan-<LOCAL_RANK>.json`; it gives up when a `discard` file appears or the
supervisor that started it is gone.

On a relaunch the supervisor checks the standby as `Standby.unusable` does (the agent alive, every rank
reported, the command, arguments, working directory, base environment and code files unchanged), writes every
rank's plan, and the parked agent becomes the segment: its PID, process group and output. A rank keeps the
environment torchrun gave it (RANK, MASTER_PORT, ...) and takes only the per-segment `ROLLBACK_SUPERVISOR_*`
variables from its plan. Anything unusable is killed (agent and ranks: torchrun starts each rank in a session
of its own) and the segment starts cold.

Several nodes would need every node's agent parked at once with one rendezvous for the standby set, and the
owner's plan carried to every follower's parked ranks; see docs/design/multinode.md.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from supervisor.errors import UserError
from supervisor.launcher.base import ExitInfo, SegmentHandle
from supervisor.launcher.standby import (
    CHILD,
    PER_SEGMENT_PREFIX,
    Standby,
    StandbyLauncher,
    StandbyOptions,
    Target,
)
from supervisor.launcher.torchrun import TorchrunLauncher, TorchrunSegment

log = logging.getLogger("rollback_supervisor.launcher")

#: How often the supervisor looks for the ranks' ready files.
READY_POLL_S = 0.02


class TorchrunStandby(Standby):
    """A parked torchrun agent whose ranks wait in `standby_child.py` (see the module docstring)."""

    def __init__(self, *args: Any, torchrun: TorchrunLauncher, **kwargs: Any):
        self.torchrun = torchrun
        self.nproc = torchrun.options.nproc_per_node
        self.channel = Path(tempfile.mkdtemp(prefix="rbs-standby-"))  # private (0700), removed when done
        try:
            super().__init__(*args, **kwargs)
        except BaseException:
            shutil.rmtree(self.channel, ignore_errors=True)
            raise

    def _spawn(self, config: dict[str, Any], env: dict[str, str], cwd: str) -> subprocess.Popen:
        config = {**config, "channel_dir": str(self.channel), "supervisor_pid": os.getpid()}
        user = (self.target.interpreter, *self.target.flags, CHILD, json.dumps(config))
        return subprocess.Popen(
            list(self.torchrun.command(user)),
            # At `imports`, the previous segment's environment, as the local standby has it: its plan
            # variable names the lineage's directory, so a supervisor that restarts recognises (and reclaims)
            # the agent; each rank takes its own segment's per-segment variables from its plan file.
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the agent leads a process group, as LocalLauncher gives it
            text=True,
            errors="replace",
            bufsize=1,
        )

    def _receive_report(self) -> dict[str, Any] | None:
        """Every rank's report, merged; None if the agent exited (or the standby was discarded) first."""
        paths = [self.channel / f"ready-{rank}.json" for rank in range(self.nproc)]
        try:
            while not all(p.exists() for p in paths):
                if self.proc.poll() is not None or self.discarded:
                    return None
                time.sleep(READY_POLL_S)
            reports = [json.loads(p.read_text()) for p in paths]
        except (OSError, ValueError):  # discarded meanwhile (the channel removed), or a torn file: unusable
            return None
        files = {f[0]: f for r in reports for f in r["files"]}  # [path, mtime_ns, size], once each
        return {
            "pid": self.proc.pid,
            "ranks": [r["pid"] for r in reports],
            "park": reports[0].get("park"),
            "imports_s": max(r["imports_s"] for r in reports),
            "imported": max(r["imported"] for r in reports),
            "failed": sorted({name for r in reports for name in r["failed"]}),
            "early_reads": sorted({name for r in reports for name in r.get("early_reads", [])}),
            "files": list(files.values()),
        }

    def unusable(self, *args: Any, **kwargs: Any) -> str | None:
        why = super().unusable(*args, **kwargs)
        if why is None and self.report is not None:  # the agent notices a dead rank only at its next poll
            dead = [pid for pid in self.report["ranks"] if not _running(pid)]
            if dead:
                return f"its rank process {dead[0]} is gone"
        return why

    def _send_plan(self, message: dict[str, Any]) -> None:
        """Every rank's plan, all written before any is visible. Only the per-segment variables travel (a rank
        keeps the rest of its environment), so no secret of the segment's environment lands in a file."""
        env = {k: v for k, v in message["env"].items() if k.startswith(PER_SEGMENT_PREFIX)}
        text = json.dumps({**message, "env": env})
        paths = [self.channel / f"plan-{rank}.json" for rank in range(self.nproc)]
        for path in paths:
            path.with_suffix(".tmp").write_text(text)
        for path in paths:
            os.replace(path.with_suffix(".tmp"), path)

    def _close_channel(self) -> None:
        try:
            (self.channel / "discard").touch()
        except OSError:
            pass

    def _kill(self) -> None:
        """The agent's process group and every rank (each in a session of its own). The agent is stopped
        first, so that it cannot start a rank between the listing and the kill."""
        try:
            os.killpg(self.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            ranks = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            ranks = []
        for proc in ranks:
            try:
                proc.kill()
            except psutil.Error:
                pass
        super()._kill()

    def discard(self, why: str) -> None:
        super().discard(why)
        shutil.rmtree(self.channel, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class StandbySegment(TorchrunSegment):
    """A segment started in a parked agent: its channel directory is removed once the segment has ended."""

    def __init__(self, inner: SegmentHandle, channel: Path):
        super().__init__(inner)
        self.channel = channel

    def wait(self, timeout: float | None = None) -> ExitInfo:
        info = super().wait(timeout)
        shutil.rmtree(self.channel, ignore_errors=True)
        return info


class TorchrunStandbyLauncher(StandbyLauncher):
    """A single-node TorchrunLauncher whose relaunches start in a parked torchrun agent (module docstring)."""

    def __init__(self, options: StandbyOptions, torchrun: TorchrunLauncher):
        o = torchrun.options
        if o.nnodes != "1" or not o.rdzv_endpoint.endswith(":0"):
            raise UserError(
                f"relaunch.standby under torchrun: one node with a rendezvous on a free port only (nnodes "
                f"{o.nnodes!r}, rdzv_endpoint {o.rdzv_endpoint!r}); a parked agent beside the running one "
                "needs a port of its own"
            )
        super().__init__(options, inner=torchrun)  # type: ignore[arg-type]
        self.torchrun = torchrun

    def _new_standby(
        self, target: Target, env: dict[str, str], cwd: str, options: StandbyOptions, argv: tuple[str, ...]
    ) -> Standby:
        tail = getattr(self.torchrun.inner, "tail_lines", 200)  # as long a tail as a cold start's
        return TorchrunStandby(
            target, env, cwd, options, tail, argv, on_unparked=self._unparked, torchrun=self.torchrun
        )

    def _activated(self, segment: SegmentHandle, standby: Standby) -> SegmentHandle:
        assert isinstance(standby, TorchrunStandby)
        return StandbySegment(segment, standby.channel)
