"""How a segment ends: its pending stop, whether it restored, and its exit code (the only writer of each)."""

from __future__ import annotations

import logging

from supervisor import exitcodes
from supervisor.runtime.actions import Stop
from supervisor.runtime.stops import StopMode, StopRequest, StopRequests

log = logging.getLogger("rollback_supervisor.session")


class SegmentOutcome:
    """The segment's stop requests, `restored` and `exit_code`; the training thread decides, sources request.

    Thread-safety: `requests` takes requests from any thread or a signal handler (see `StopRequests`);
    everything else is the training thread's.
    """

    def __init__(self, requests: StopRequests | None = None):
        self.requests = requests if requests is not None else StopRequests()
        self.restored = False
        self.exit_code = exitcodes.EXIT_OK

    @property
    def pending(self) -> StopRequest | None:
        return self.requests.current

    def request(self, reason: str, *, checkpoint: bool) -> None:
        """Ask to stop after this step (with an emergency checkpoint first if `checkpoint`)."""
        self.requests.request(StopMode.CHECKPOINT if checkpoint else StopMode.NOW, reason)

    def stop_for_anomaly(self, reason: str) -> Stop:
        """An anomaly this process leaves to the supervisor: stop now, whatever was pending (exit 76)."""
        request = StopRequest(StopMode.NOW, reason, exitcodes.EXIT_ANOMALY)
        self.requests.force(request)
        self.exit_code = exitcodes.EXIT_ANOMALY
        return request.action()

    def stopped(self, stop: Stop, step: int, *, saved: bool = False, seconds: float = 0.0) -> int:
        """The driver left the loop at `step` for `stop` (and wrote its checkpoint if asked): the exit code."""
        if not stop.checkpoint:
            if self.exit_code == exitcodes.EXIT_OK:
                self.exit_code = stop.exit_code
            log.warning("stopping at step %d (%s), no checkpoint", step, stop.reason)
            return self.exit_code
        if saved:
            log.warning(
                "preempted (%s): emergency checkpoint at step %d in %.2fs", stop.reason, step, seconds
            )
        else:  # reported; the supervisor resumes from the newest valid checkpoint, as after a kill
            log.error("preempted (%s): emergency checkpoint at step %d failed", stop.reason, step)
        self.exit_code = stop.exit_code
        return self.exit_code

    def fail(self, reason: str | None = None, exit_code: int = exitcodes.EXIT_FAILED) -> None:
        """The segment failed (an exception, or its final checkpoint did not land): `exit_code` (1; 2 for a
        user's mistake) unless already set."""
        if reason:
            log.error("%s", reason)
        if self.exit_code == exitcodes.EXIT_OK:
            self.exit_code = exit_code
