"""The fault drill's external faults on a script that never loads our fault injector: kill, term and hang.

`ROLLBACK_SUPERVISOR_FAULTS=kill@120,term@200,hang@260` reaches the training side of a `Session`, which fires
each fault itself. An unmodified script ignores it, so in script mode the supervisor fires the faults that
come from outside a process anyway, when the script's output reaches the fault's step: `kill` SIGKILLs its
process group (a node vanishing), `term` SIGTERMs it (a preemption), `hang` SIGSTOPs it (alive, silent, no
progress; it is continued when the supervisor stops it, so that its stop signal lands). The signal reaches
the process group of every process of the segment: torchrun starts each rank in a session of its own, and a
machine that vanishes or is preempted takes all of them. Each fires once per
lineage, recorded in the same fired file the training side uses before it fires. The faults that must come
from inside the process (`nan`, `spike`, `hw`, `oom`, `exc`) cannot be fired on a script; they are named in a
warning and never fire, so the drill reports them as not seen. The step comes from the output patterns: with
none (metrics only from the script's MLflow logging) no external fault fires either.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from supervisor.launcher import Launcher, LaunchSpec, OnLine, SegmentHandle

if TYPE_CHECKING:  # the drill's parser lives with the in-process injector, which imports torch
    from supervisor.runtime.faults import Fault

log = logging.getLogger("rollback_supervisor.script")

#: What each external fault sends to the script's process group.
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "hang": signal.SIGSTOP}


class ExternalFaults:
    """Fires the external faults of a drill at the steps the script prints. Thread-safe."""

    def __init__(self, faults: list[Fault], fired_path: Path):
        inside = [f.key for f in faults if f.kind not in SIGNALS]
        if inside:
            log.warning(
                "fault drill: %s cannot be injected into a script that does not use the training-side API "
                "(only %s can); they will not fire",
                ", ".join(inside),
                ", ".join(SIGNALS),
            )
        self.faults = sorted((f for f in faults if f.kind in SIGNALS), key=lambda f: f.step)
        self.fired_path = Path(fired_path)
        self.frozen = False
        self._lock = threading.Lock()
        self._pgid: int | None = None
        self._stopped: set[int] = set()  # the process groups a `hang` stopped
        self._ready = threading.Event()
        self._fired: set[str] | None = None

    def attach(self, handle: SegmentHandle) -> None:
        """The segment is running: its process group (and its descendants') is the target."""
        pid = handle.details().get("pid")
        if pid is None:
            log.warning("fault drill: launcher gives no process id; external faults cannot fire")
        self._pgid = pid
        self._ready.set()

    def _groups(self) -> set[int]:
        """The segment's process group and those of its descendants (torchrun's ranks have their own)."""
        assert self._pgid is not None
        groups = {self._pgid}
        try:
            children = psutil.Process(self._pgid).children(recursive=True)
        except psutil.Error:
            return groups
        for child in children:
            try:
                groups.add(os.getpgid(child.pid))
            except ProcessLookupError:
                pass
        return groups

    def on_step(self, step: int) -> None:
        """The script printed `step`: fire the first due fault that has not fired in this lineage."""
        with self._lock:
            fired = self._read_fired()
            due = next((f for f in self.faults if f.step <= step and f.key not in fired), None)
            if due is None or not self._ready.wait(10) or self._pgid is None:
                return
            fired.add(due.key)
            tmp = self.fired_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(fired)))
            os.replace(tmp, self.fired_path)
            log.warning(
                "fault drill: injecting %s at step %d: %s to the script",
                due.key,
                step,
                SIGNALS[due.kind].name,
            )
            self.frozen = self.frozen or due.kind == "hang"
            groups = self._groups()
            if due.kind == "hang":
                self._stopped |= groups
            for group in sorted(groups):
                try:
                    os.killpg(group, SIGNALS[due.kind])
                except (ProcessLookupError, PermissionError) as exc:
                    log.warning("fault drill: %s did not reach process group %d: %s", due.key, group, exc)

    def _read_fired(self) -> set[str]:
        if self._fired is None:
            try:
                self._fired = set(json.loads(self.fired_path.read_text()))
            except FileNotFoundError:
                self._fired = set()
        return self._fired

    def thaw(self) -> None:
        """Continue a process group a `hang` stopped, so that a signal sent to stop it is delivered."""
        if self.frozen and self._pgid is not None:
            self.frozen = False
            for group in sorted(self._stopped or {self._pgid}):
                try:
                    os.killpg(group, signal.SIGCONT)
                except (ProcessLookupError, PermissionError):
                    pass
            self._stopped = set()


class FaultLauncher:
    """A launcher whose segments get the drill's external faults (see module docstring)."""

    def __init__(self, inner: Launcher, faults: ExternalFaults):
        self.inner = inner
        self.faults = faults

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> SegmentHandle:
        handle = self.inner.start(spec, on_line)
        self.faults.attach(handle)
        return _ThawingHandle(handle, self.faults)

    def reclaim(self, details: Any) -> None:
        self.inner.reclaim(details)


class _ThawingHandle:
    """A segment handle that continues a hung (SIGSTOPped) script before stopping it."""

    def __init__(self, inner: SegmentHandle, faults: ExternalFaults):
        self._inner = inner
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        self._faults.thaw()
        self._inner.stop(grace_seconds, sig)

    def kill(self) -> None:
        self._faults.thaw()
        self._inner.kill()
