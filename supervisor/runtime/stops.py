"""Requests to stop that reach a training segment from outside its loop: signals, notices, the supervisor gone.

SIGTERM (a preemption) and a cloud preemption notice ask for a stop with an emergency checkpoint; SIGUSR2
(the supervisor's "stop now") asks for a stop without one. The first request wins; an anomaly the segment
cannot handle itself overrides any (it stops at once, exit 76).

Thread-safety: requests come from a signal handler (the main thread, between two bytecodes), the notice
watcher's thread and the training thread. `StopRequests` changes its one immutable value under a reentrant
lock, so a notice cannot overwrite an anomaly's stop between its check and its set; reentrant, because a
handler may interrupt its own thread while that thread holds the lock (a plain lock would deadlock there).
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

import psutil

from supervisor import exitcodes
from supervisor.monitor import NoticeWatcher
from supervisor.monitor.notices import Notice
from supervisor.runtime.actions import Stop

if TYPE_CHECKING:
    from policies.monitor_schema import PreemptionNotice

log = logging.getLogger("rollback_supervisor.session")

#: Builds the notice watcher around the callback it calls on a notice.
WatcherFactory = Callable[[Callable[[Notice], None]], NoticeWatcher]


class StopMode(enum.IntEnum):
    """How to stop; ordered, so that ranks agreeing on the maximum pick the more urgent."""

    CHECKPOINT = 1  # SIGTERM, a preemption notice, the supervisor gone: emergency checkpoint first
    NOW = 2  # SIGUSR2, an anomaly left to the supervisor: no checkpoint


#: The signals the supervisor sends, and what each asks for.
SIGNAL_MODES = {signal.SIGTERM: StopMode.CHECKPOINT, signal.SIGUSR2: StopMode.NOW}


@dataclass(frozen=True)
class StopRequest:
    """One request to stop: how, why, and the exit code it ends the segment with."""

    mode: StopMode
    reason: str
    exit_code: int

    def action(self) -> Stop:
        return Stop(self.reason, self.exit_code, checkpoint=self.mode is StopMode.CHECKPOINT)


def request_for(mode: StopMode, reason: str) -> StopRequest:
    """A request with the exit code its mode implies (stopped: 3; preempted, checkpoint first: 75)."""
    code = exitcodes.EXIT_STOPPED if mode is StopMode.NOW else exitcodes.EXIT_PREEMPTED
    return StopRequest(mode, reason, code)


class StopRequests:
    """The segment's pending stop, if any; every source of a stop goes through here."""

    def __init__(self) -> None:
        self.current: StopRequest | None = None
        self._lock = threading.RLock()

    def request(self, mode: StopMode, reason: str) -> None:
        """Ask to stop; ignored when a stop is already pending (the first reason is the one reported)."""
        with self._lock:
            if self.current is None:
                self.current = request_for(mode, reason)

    def force(self, request: StopRequest) -> None:
        """Stop for this reason, whatever was pending (an anomaly the supervisor must handle)."""
        with self._lock:
            self.current = request

    def adopt(self, mode: StopMode, reason: str) -> None:
        """The ranks agreed on `mode`: take it unless a gentler one of ours was not overruled; keep our reason."""
        with self._lock:
            mine = self.current
            if mine is None or mode is StopMode.NOW:
                self.current = request_for(mode, mine.reason if mine and mine.reason else reason)

    def on_signal(self, signum: int, frame: FrameType | None = None) -> None:
        """The handler for SIGNAL_MODES."""
        self.request(SIGNAL_MODES[signal.Signals(signum)], signal.Signals(signum).name)

    def on_notice(self, notice: Notice) -> None:
        """The notice watcher's callback: the machine is about to go, save first."""
        self.request(StopMode.CHECKPOINT, f"preemption notice: {notice}")


class SignalHandlers:
    """Routes SIGTERM and SIGUSR2 to a StopRequests between `install()` and `restore()` (main thread only)."""

    def __init__(self, requests: StopRequests):
        self._requests = requests
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in SIGNAL_MODES:
            self._previous[sig] = signal.signal(sig, self._requests.on_signal)

    def restore(self) -> None:
        """Put back the handlers `install()` replaced."""
        while self._previous:
            sig, handler = self._previous.popitem()
            signal.signal(sig, handler)


class SupervisorWatch:
    """Whether the supervisor that launched this segment is gone (nobody would act on what it does next)."""

    def __init__(self, pid: int | None, *, pid_exists: Callable[[int], bool] = psutil.pid_exists):
        self._pid, self._pid_exists = pid, pid_exists

    def gone(self) -> bool:
        return bool(self._pid) and not self._pid_exists(self._pid)

    def check(self, requests: StopRequests) -> None:
        """Save and stop if the supervisor vanished: the next supervisor resumes from that checkpoint."""
        if requests.current is None and self.gone():
            requests.request(StopMode.CHECKPOINT, "the supervisor process vanished")


class StopSources:
    """Every source of a stop request for one segment: signals, the notice watcher, the supervisor's pid.

    Nothing starts in the constructor: `start()` starts the notice watcher (rank 0 only polls), `install()`
    routes the signals (from the main thread), `close()` and `restore()` undo them.
    """

    def __init__(
        self,
        notices: WatcherFactory | None = None,
        supervisor_pid: int | None = None,
        *,
        pid_exists: Callable[[int], bool] = psutil.pid_exists,
        requests: StopRequests | None = None,
    ):
        self.requests = requests if requests is not None else StopRequests()
        self._signals = SignalHandlers(self.requests)
        self._watch = SupervisorWatch(supervisor_pid, pid_exists=pid_exists)
        self._make_watcher = notices
        self._watcher: NoticeWatcher | None = None

    def start(self) -> None:
        """Start watching for preemption notices (idempotent)."""
        if self._make_watcher is not None and self._watcher is None:
            self._watcher = self._make_watcher(self.requests.on_notice).start()

    def install(self) -> None:
        self._signals.install()

    def restore(self) -> None:
        self._signals.restore()

    def poll(self) -> None:
        """Check the sources nobody pushes from (the supervisor's pid)."""
        self._watch.check(self.requests)

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()


def notice_watcher(spec: PreemptionNotice) -> WatcherFactory | None:
    """What builds the watcher for a policy's `monitor.preemption_notice`, or None when it names no provider."""
    if spec.provider == "none":
        return None

    def build(on_notice: Callable[[Notice], None]) -> NoticeWatcher:
        return NoticeWatcher(spec.provider, on_notice, endpoint=spec.endpoint, interval=spec.poll_seconds)

    return build
