"""What the supervisor needs from whatever runs a training segment: start it, stream it, stop it, wait for it.

A `Launcher` turns a `LaunchSpec` into a `SegmentHandle`. The protocol speaks of handle ids, not PIDs, so that
a scheduler (SLURM's job id, a Kubernetes pod name) can implement it; what identifies a running segment on its
own terms (a local PID and its start time) is returned by `details()` and kept in the segment's record, and
`Launcher.reclaim()` uses it to end a segment that a vanished supervisor left running. Signals are POSIX
numbers and best effort: a scheduler forwards them (`scancel -s`) or maps them to what it can do (delete a pod
with a grace period).
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: Receives each output line as (stream, line), stream being "stdout" or "stderr"; called from reader threads.
OnLine = Callable[[str, str], None]


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: the command, its environment and working directory, and a name for the job.

    The environment is `env_overrides` on top of the launcher's base environment: the supervisor's own
    (`os.environ` for the local launcher) when `inherit_env`, else nothing. A scheduler decides what
    inheriting means for its jobs (SLURM: `--export`).
    """

    command: tuple[str, ...]
    env_overrides: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    inherit_env: bool = True
    name: str = ""  #: the job's name (lineage and segment), for a scheduler's `--job-name`
    #: Hosts the segment must not run on (the lineage's `excluded_hosts`): SLURM `--exclude`, a Kubernetes node
    #: anti-affinity, a multi-node follower that refuses; the local launchers run on this machine regardless.
    exclude_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExitInfo:
    """How a segment ended."""

    returncode: int
    stderr_tail: str
    stdout_tail: str
    signal_sent: int | None  #: the signal *we* sent to stop it, if any
    handle_id: str  #: the launcher's id of the segment (local: the PID)
    duration_s: float
    cause: str | None = None
    """The launcher's own verdict, as an event type (e.g. "preemption" for SLURM's PREEMPTED, "hardware_fault"
    for NODE_FAIL), or "stop" for a segment stopped from outside (`scancel`: the lineage ends stopped); None
    when it has none (the local launchers). When set, the decision step takes it over the exit code and stderr."""
    cause_evidence: Mapping[str, Any] = field(default_factory=dict)
    """What the launcher's verdict rests on (e.g. the SLURM job and its state), kept with the event."""
    hosts: tuple[str, ...] = ()
    """The hosts it ran on, where the launcher knows them (SLURM's nodelist, the pods' nodes, each node's
    follower); empty: this machine (the local launchers)."""


class SegmentHandle(Protocol):
    """One started segment. `stop()` may be called from any thread; everything else from the owner thread."""

    @property
    def handle_id(self) -> str:
        """The launcher's id of this segment (local: the PID; a scheduler: the job id)."""
        ...

    def details(self) -> dict[str, Any]:
        """What the lineage record keeps to find this segment again after a supervisor crash (see reclaim)."""
        ...

    def started(self) -> bool:
        """Whether it is running yet (local: at once; a scheduler: once the job left the queue)."""
        ...

    def poll(self) -> int | None:
        """The exit code if it has exited, else None."""
        ...

    def wait_exit(self, timeout: float) -> int | None:
        """Block up to `timeout` seconds for it to exit; its exit code, or None if still running."""
        ...

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to all of it, wait up to `grace_seconds`, then kill whatever is left."""
        ...

    def kill(self) -> None:
        """Kill all of it now (no grace), recorded as sent by us."""
        ...

    def wait(self, timeout: float | None = None) -> ExitInfo:
        """Wait for the exit, reap what it left behind, and say how it ended; TimeoutError after `timeout`."""
        ...


class Launcher(Protocol):
    """Starts training segments (local processes, torchrun, a scheduler's jobs)."""

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> SegmentHandle:
        """Start `spec`, streaming its output lines to `on_line`."""
        ...

    def reclaim(self, details: Mapping[str, Any]) -> None:
        """End a segment that a vanished supervisor left running, if it still runs.

        `details` is what the segment's record keeps: what `SegmentHandle.details()` returned, plus `host` and
        `index`, plus `env_in_dir` ({variable: directory}: the segment was started with that variable set to
        a path in that directory), by which a launcher that can read a process's environment recognises its
        own. Anything that may no longer be that segment (a reused PID) must be left alone.
        """
        ...
