"""Stop requests: who wins, what real signals ask for, the supervisor's pid, and the notice watcher's start."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from supervisor import exitcodes
from supervisor.runtime.actions import Stop
from supervisor.runtime.stops import (
    SignalHandlers,
    StopMode,
    StopRequest,
    StopRequests,
    StopSources,
    SupervisorWatch,
    notice_watcher,
)


def test_the_first_request_wins_and_an_anomaly_overrides_it():
    requests = StopRequests()
    requests.request(StopMode.CHECKPOINT, "SIGTERM")
    requests.request(StopMode.NOW, "SIGUSR2")
    assert requests.current is not None
    assert requests.current.action() == Stop("SIGTERM", exitcodes.EXIT_PREEMPTED, checkpoint=True)
    requests.force(StopRequest(StopMode.NOW, "anomaly: spike", exitcodes.EXIT_ANOMALY))
    assert requests.current.action() == Stop("anomaly: spike", exitcodes.EXIT_ANOMALY, checkpoint=False)


@pytest.mark.parametrize(
    ("mine", "agreed", "expected"),
    [
        (None, StopMode.CHECKPOINT, (StopMode.CHECKPOINT, "another rank was asked to stop")),
        (None, StopMode.NOW, (StopMode.NOW, "another rank was asked to stop")),
        ((StopMode.CHECKPOINT, "SIGTERM"), StopMode.CHECKPOINT, (StopMode.CHECKPOINT, "SIGTERM")),
        # Another rank must stop now: so does this one, for the reason it had.
        ((StopMode.CHECKPOINT, "SIGTERM"), StopMode.NOW, (StopMode.NOW, "SIGTERM")),
        ((StopMode.NOW, "SIGUSR2"), StopMode.NOW, (StopMode.NOW, "SIGUSR2")),
    ],
)
def test_adopting_what_the_ranks_agreed(mine, agreed, expected):
    requests = StopRequests()
    if mine:
        requests.request(*mine)
    requests.adopt(agreed, "another rank was asked to stop")
    assert requests.current is not None
    assert (requests.current.mode, requests.current.reason) == expected


@pytest.mark.parametrize(
    ("sig", "mode"), [(signal.SIGTERM, StopMode.CHECKPOINT), (signal.SIGUSR2, StopMode.NOW)]
)
def test_real_signals_become_requests_until_the_old_handlers_are_back(sig, mode):
    requests = StopRequests()
    handlers = SignalHandlers(requests)
    before = signal.getsignal(sig)
    handlers.install()
    try:
        os.kill(os.getpid(), sig)
        assert requests.current == StopRequest(
            mode,
            sig.name,
            exitcodes.EXIT_PREEMPTED if mode is StopMode.CHECKPOINT else exitcodes.EXIT_STOPPED,
        )
    finally:
        handlers.restore()
    assert signal.getsignal(sig) == before


def test_a_vanished_supervisor_asks_for_a_checkpoint_then_a_stop():
    alive = {4242: True}
    watch = SupervisorWatch(4242, pid_exists=lambda pid: alive[pid])
    requests = StopRequests()
    watch.check(requests)
    assert requests.current is None
    alive[4242] = False
    watch.check(requests)
    assert requests.current is not None
    assert (requests.current.mode, requests.current.reason) == (
        StopMode.CHECKPOINT,
        "the supervisor process vanished",
    )
    assert not SupervisorWatch(None, pid_exists=lambda pid: False).gone()  # stand-alone: nobody to lose


class FakeWatcher:
    def __init__(self, on_notice: Any):
        self.on_notice, self.started, self.stopped = on_notice, 0, False

    def start(self) -> FakeWatcher:
        self.started += 1
        return self

    def stop(self) -> None:
        self.stopped = True


def test_the_notice_watcher_starts_on_start_not_when_built_and_stops_on_close():
    built: list[FakeWatcher] = []

    def make(on_notice: Any) -> FakeWatcher:
        built.append(FakeWatcher(on_notice))
        return built[-1]

    sources = StopSources(make, None)  # type: ignore[arg-type]
    assert built == []
    sources.start()
    sources.start()
    assert len(built) == 1 and built[0].started == 1
    built[0].on_notice("gcp: preempted")
    assert sources.requests.current is not None
    assert sources.requests.current.reason == "preemption notice: gcp: preempted"
    assert sources.requests.current.mode is StopMode.CHECKPOINT
    sources.close()
    assert built[0].stopped


def test_no_provider_no_watcher():
    class Spec:
        provider, endpoint, poll_seconds = "none", None, 5.0

    assert notice_watcher(Spec()) is None
    Spec.provider = "gcp"
    assert callable(notice_watcher(Spec()))
