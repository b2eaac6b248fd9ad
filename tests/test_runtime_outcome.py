"""How a segment ends, without a store: the exit code of each kind of stop, a failure that does not mask an
earlier code, an anomaly that overrides a pending stop, and a request that cannot slip in beside one."""

from __future__ import annotations

import threading

import pytest

from supervisor import exitcodes
from supervisor.runtime.actions import Stop
from supervisor.runtime.outcome import SegmentOutcome
from supervisor.runtime.stops import StopMode, StopRequests


@pytest.mark.parametrize(
    ("checkpoint", "saved", "code"),
    [
        (False, False, exitcodes.EXIT_STOPPED),
        (True, True, exitcodes.EXIT_PREEMPTED),
        (True, False, exitcodes.EXIT_PREEMPTED),  # reported; the supervisor resumes from the newest valid one
    ],
)
def test_a_requested_stop_ends_with_its_exit_code(checkpoint, saved, code):
    outcome = SegmentOutcome()
    outcome.request("asked", checkpoint=checkpoint)
    stop = outcome.pending.action()  # type: ignore[union-attr]
    assert stop == Stop("asked", code, checkpoint=checkpoint)
    assert outcome.stopped(stop, 7, saved=saved) == code == outcome.exit_code


def test_an_anomaly_overrides_a_pending_stop_and_keeps_exit_76():
    outcome = SegmentOutcome()
    outcome.request("SIGTERM", checkpoint=True)
    stop = outcome.stop_for_anomaly("anomaly: nan")
    assert stop == Stop("anomaly: nan", exitcodes.EXIT_ANOMALY, checkpoint=False)
    assert outcome.pending.mode is StopMode.NOW  # type: ignore[union-attr]
    outcome.request("a late notice", checkpoint=True)  # first wins: the anomaly's
    outcome.fail("and then something failed")
    assert outcome.stopped(outcome.pending.action(), 3) == exitcodes.EXIT_ANOMALY  # type: ignore[union-attr]


def test_a_failure_is_exit_1_only_when_nothing_else_was_set():
    fresh, stopped = SegmentOutcome(), SegmentOutcome()
    fresh.fail()
    stopped.request("user", checkpoint=False)
    stopped.stopped(stopped.pending.action(), 1)  # type: ignore[union-attr]
    stopped.fail()
    assert (fresh.exit_code, stopped.exit_code) == (exitcodes.EXIT_FAILED, exitcodes.EXIT_STOPPED)
    assert not fresh.restored


def test_a_request_from_another_thread_waits_for_the_anomaly_being_set():
    requests = StopRequests()
    outcome = SegmentOutcome(requests)
    with requests._lock:  # the training thread is inside a change of the pending stop
        notice = threading.Thread(
            target=outcome.request, args=("preemption notice",), kwargs={"checkpoint": True}
        )
        notice.start()
        notice.join(0.2)
        assert notice.is_alive() and requests.current is None  # the notice waits for the lock
        outcome.stop_for_anomaly("anomaly: nan")
    notice.join(5)
    assert requests.current is not None and requests.current.exit_code == exitcodes.EXIT_ANOMALY
