"""SegmentRun: one segment's life against a fake launcher and monitor (no processes, no sleeping)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from supervisor.errors import LeaseHeldError
from supervisor.events import Event
from supervisor.launcher import ExitInfo, LaunchSpec
from supervisor.lineage import LineageRecord, MlflowRef, SegmentRecord
from supervisor.monitor import HeartbeatWriter
from supervisor.orchestrator.events_log import EventsLog
from supervisor.orchestrator.segment_run import SegmentRun, SegmentSettings, start_step
from supervisor.runtime.plan import RestoreSpec


class Handle:
    """A segment that runs for `polls` polls, or until stopped; records every signal."""

    def __init__(self, polls: int, sink, queued: int = 0) -> None:
        self.left = polls
        self.queued = queued  #: started() answers False this many times (a scheduler's queue)
        self.sink = sink
        self.signals: list[tuple[int, float]] = []
        self.waits: list[float] = []
        self.code: int | None = None

    @property
    def handle_id(self) -> str:
        return "job-1"

    def details(self) -> dict:
        return {"pid": 99, "pid_started": 1.5}

    def started(self) -> bool:
        self.queued -= 1
        return self.queued < 0

    def poll(self) -> int | None:
        if self.code is None and self.left <= 0:
            self.code = 0
        return self.code

    def wait_exit(self, timeout: float) -> int | None:
        self.waits.append(timeout)
        self.left -= 1
        self.sink("stdout", f"tick {self.left}")
        return self.poll()

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        if self.code is None:
            self.signals.append((sig, grace_seconds))
            self.code = -sig

    def kill(self) -> None:
        self.stop(0, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> ExitInfo:
        self.poll()
        sent = self.signals[0][0] if self.signals else None
        return ExitInfo(self.code if self.code is not None else 0, "", "", sent, self.handle_id, 1.0)


class Launcher:
    def __init__(self, polls: int, queued: int = 0) -> None:
        self.polls = polls
        self.queued = queued
        self.handles: list[Handle] = []
        self.specs: list[LaunchSpec] = []

    def start(self, spec: LaunchSpec, on_line=None) -> Handle:
        self.specs.append(spec)
        self.handles.append(Handle(self.polls, on_line, self.queued))
        return self.handles[-1]

    def reclaim(self, details) -> None:
        raise AssertionError("a running segment is never reclaimed")


class Watcher:
    """Reports `events[n]` at the n-th poll."""

    def __init__(self, events: dict[int, list[Event]]) -> None:
        self.events = events
        self.polls = 0
        self.begun: list[float] = []
        self.closed = False

    def begin(self, now: float) -> None:
        self.begun.append(now)

    def poll(self, now: float) -> list[Event]:
        self.polls += 1
        return self.events.get(self.polls, [])

    def close(self) -> None:
        self.closed = True


class Lease:
    def __init__(self, lose_at: int | None = None) -> None:
        self.checks = 0
        self.lose_at = lose_at

    def check(self) -> None:
        self.checks += 1
        if self.checks == self.lose_at:
            raise LeaseHeldError("lost the lease")


class Shipper:
    drained = 0

    def drain(self) -> None:
        Shipper.drained += 1


class Rig:
    """A SegmentRun over the fakes, and everything it touched."""

    def __init__(
        self, tmp_path: Path, *, polls: int, events=None, lease=None, open_watcher=None, queued: int = 0
    ):
        self.tmp_path = tmp_path
        self.launcher = Launcher(polls, queued)
        self.record = LineageRecord(lineage="t", status="running", mlflow=MlflowRef("u", "e", "r"))
        self.seg = SegmentRecord(index=0, started=0.0, restore={"checkpoint_id": "c40", "skip_batches": 0})
        self.record.segments.append(self.seg)
        self.saves: list[dict] = []
        self.watcher = Watcher(events or {})
        self.open_watcher = open_watcher or (lambda: self.watcher)
        self.lines: list[str] = []
        self.run = SegmentRun(
            self.launcher,
            SegmentSettings(stop_grace_seconds=7.0, poll_seconds=0.5),
            record=self.record,
            events=EventsLog(tmp_path / "events.jsonl", clock=self._monotonic, sleep=self._sleep),
            lease=lease or Lease(),
            save=lambda: self.saves.append(self.record.to_dict()),
            clock=lambda: 123.0,
        )
        Shipper.drained = 0

    _now = 0.0

    def _monotonic(self) -> float:
        return self._now

    def _sleep(self, seconds: float) -> None:  # the wait for a report the training side may still write
        self._now += seconds

    def __call__(self):
        return self.run.run(
            self.seg,
            LaunchSpec(("train",), {"A": "1"}),
            heartbeat_path=self.tmp_path / "heartbeat",
            log_path=self.tmp_path / "0.log",
            open_watcher=self.open_watcher,
            open_shipper=Shipper,
            on_line=lambda stream, line: self.lines.append(line),
        )

    @property
    def handle(self) -> Handle:
        return self.launcher.handles[0]


def test_a_segment_that_exits_by_itself(tmp_path: Path):
    rig = Rig(tmp_path, polls=3)
    result = rig()
    assert result.stopped_for is None and result.exit.returncode == 0 and rig.handle.signals == []
    assert rig.launcher.specs == [LaunchSpec(("train",), {"A": "1"})]
    assert rig.handle.waits == [0.5, 0.5, 0.5] and rig.watcher.polls == 3 and rig.watcher.begun == [123.0]
    assert rig.watcher.closed and Shipper.drained == 1
    assert rig.saves[0]["segments"][0]["pid"] == 99 and rig.saves[0]["segments"][0]["pid_started"] == 1.5
    assert rig.lines == ["tick 2", "tick 1", "tick 0"]
    logged = (tmp_path / "0.log").read_text().splitlines()
    assert logged == ["stdout: tick 2", "stdout: tick 1", "stdout: tick 0"]


def test_a_queued_segment_is_not_watched_until_it_started(tmp_path: Path):
    # The hang detector's grace must not run while a scheduler's job waits in its queue.
    hang = Event(type="hang", reason="no heartbeat")
    rig = Rig(tmp_path, polls=5, events={1: [hang]}, queued=3)
    checks_before = rig.run.lease.checks
    result = rig()
    assert rig.watcher.begun == [123.0] and rig.watcher.polls == 1  # begun once, after the queue
    assert result.stopped_for == hang and rig.handle.signals == [(signal.SIGUSR2, 7.0)]
    # Queued for three answers: at launch, then two polls of the watch that waited on the handle.
    assert rig.handle.waits == [0.5, 0.5] and rig.handle.queued == -1
    assert rig.run.lease.checks - checks_before == 2  # the lease was checked while queued


def test_an_anomaly_stops_the_segment_with_sigusr2(tmp_path: Path):
    spike = Event(type="spike", reason="loss spiked", metric="loss", onset_step=50, step=50)
    rig = Rig(tmp_path, polls=100, events={2: [spike]})
    result = rig()
    assert result.stopped_for == spike
    assert rig.handle.signals == [(signal.SIGUSR2, 7.0)] and rig.watcher.polls == 2


def test_an_anomaly_the_training_process_reported_is_not_stopped_for(tmp_path: Path):
    import json

    nan = Event(type="non_finite", reason="nan", metric="loss", onset_step=50, step=50)
    on_grad = Event(type="non_finite", reason="nan", metric="grad_norm", onset_step=50, step=50)
    report = {"seq": 1, "time": 1.0, "handled_in_process": True, "event": nan.to_dict()}
    (tmp_path / "events.jsonl").write_text(json.dumps(report) + "\n")
    rig = Rig(tmp_path, polls=3, events={1: [on_grad]})
    assert rig().stopped_for is None and rig.handle.signals == []


class Interrupting(Lease):
    """Ctrl-C (or SIGTERM turned into an exception) reaches the supervisor at the n-th lease check."""

    def check(self) -> None:
        self.checks += 1
        if self.checks == self.lose_at:
            raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("lease", "error", "saved"), [(Interrupting, KeyboardInterrupt, True), (Lease, LeaseHeldError, False)]
)
def test_the_supervisor_going_away_interrupts_the_segment(tmp_path: Path, lease, error, saved):
    rig = Rig(tmp_path, polls=100, lease=lease(lose_at=2))
    with pytest.raises(error):
        rig()
    assert rig.handle.signals == [(signal.SIGTERM, 7.0)]
    assert rig.watcher.closed and Shipper.drained == 1
    seg = rig.seg
    assert seg.outcome == "interrupted" and seg.ended == 123.0 and seg.signal_sent == signal.SIGTERM
    assert seg.event["type"] == "preemption" and seg.event["source"] == "supervisor"
    assert rig.record.next_restore == {
        "checkpoint_id": None,
        "skip_batches": 0,
        "lr_scale": 1.0,
        "from_scratch": False,
        "rollback": False,
    }
    # A stale holder (lost lease) writes nothing; an interrupted one records it for the next supervisor.
    assert (rig.saves[-1]["segments"][0]["outcome"] == "interrupted") is saved


def test_a_watcher_that_cannot_be_built_still_stops_the_segment(tmp_path: Path):
    def broken() -> Watcher:
        raise RuntimeError("no such tracking store")

    rig = Rig(tmp_path, polls=100, open_watcher=broken)
    with pytest.raises(RuntimeError, match="no such tracking store"):
        rig()
    assert rig.handle.signals == [(signal.SIGTERM, 7.0)] and rig.handle.code == -signal.SIGTERM
    assert Shipper.drained == 1


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (RestoreSpec(checkpoint_id="0000000040-000006"), 40),  # not the killed segment's last beat (42)
        (RestoreSpec(from_scratch=True), 0),
        (RestoreSpec(), 42),  # the newest valid checkpoint: only the training knows; the beat bounds it
        (RestoreSpec(checkpoint_id="v-ckpt.pt-3"), 42),  # a script-mode version id names no step
    ],
)
def test_a_segment_starts_at_its_checkpoints_step_not_the_last_heartbeat(tmp_path, spec, expected):
    beat = tmp_path / "heartbeat.json"
    HeartbeatWriter(beat).beat(42)
    assert start_step(spec, beat) == expected
