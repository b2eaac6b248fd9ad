"""DecisionStep: classify, decide with re-verification, apply to the record, tag the run; pure, no processes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from policies import Decision, History, load_policy
from supervisor import exitcodes
from supervisor.events import Event
from supervisor.launcher import ExitInfo
from supervisor.lineage import LineageRecord, MlflowRef, SegmentRecord
from supervisor.orchestrator import SegmentResult
from supervisor.orchestrator.decision_step import DecisionStep
from supervisor.orchestrator.events_log import EventsLog
from tests.flowkit import FAST_POLICY

POLICY = load_policy(FAST_POLICY)


@dataclass
class Info:
    id: str
    step: int
    metrics: dict = field(default_factory=dict)
    wall_time: float = 0.0
    abandoned: bool = False
    healthy: bool = True


class Catalog:
    """Checkpoints with ids `c<step>`; `corrupt` ones fail full verification (fast passes)."""

    def __init__(self, infos: list[Info], corrupt: set[str] = frozenset()):
        self.infos = infos
        self.corrupt = set(corrupt)
        self.verified: list[tuple[str, str]] = []

    def list(self) -> list[Info]:
        return list(self.infos)

    def verify(self, cid: str, level: str) -> str | None:
        self.verified.append((cid, level))
        return "checksum mismatch" if level != "fast" and cid in self.corrupt else None

    def latest(self) -> Info | None:
        return self.infos[-1] if self.infos else None

    def best(self, metric: str, mode: str) -> Info | None:
        scored = [i for i in self.infos if metric in i.metrics]
        return min(scored, key=lambda i: i.metrics[metric]) if scored else None


class Run:
    """RunTracking that remembers what it was told."""

    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.terminated: list[str] = []

    def tag(self, key: str, text: str) -> None:
        self.tags[key] = text

    def terminate(self, status: str) -> None:
        self.terminated.append(status)


CHECKPOINTS = [Info(f"c{s}", s, {"val_loss": v}) for s, v in ((20, 2.0), (40, 1.5), (60, 1.8))]


def _step(tmp_path: Path, catalog: Catalog | None, saves: list | None = None) -> tuple[DecisionStep, Run]:
    run = Run()
    step = DecisionStep(
        POLICY,
        history=History(),
        events=EventsLog(tmp_path / "events.jsonl"),
        catalog=lambda: catalog,
        run=run,
        save=(lambda: saves.append(1)) if saves is not None else (lambda: None),
        clock=lambda: 1000.0,
    )
    return step, run


def _record(*segments: SegmentRecord) -> LineageRecord:
    return LineageRecord(
        lineage="t", status="running", mlflow=MlflowRef("u", "e", "r"), segments=list(segments)
    )


def _result(index: int, code: int, stderr: str = "", stopped_for: Event | None = None) -> SegmentResult:
    info = ExitInfo(code, stderr, "", None, "1", 1.0)
    return SegmentResult(index, info, stopped_for, 0.0, 10.0, 33)


def test_a_target_that_fails_full_verification_is_replaced_by_the_next_choice(tmp_path: Path):
    catalog = Catalog(CHECKPOINTS, corrupt={"c60"})
    step, _ = _step(tmp_path, catalog)
    decision = step.decide(Event(type="preemption", reason="spot", source="notice"))
    assert (decision.action, decision.target_id) == ("resume", "c40")
    assert ("c60", "full") in catalog.verified and ("c40", "full") in catalog.verified


def test_apply_records_the_decision_and_sets_the_next_restore(tmp_path: Path):
    saves: list = []
    step, run = _step(tmp_path, Catalog(CHECKPOINTS), saves)
    seg = SegmentRecord(index=0, started=0.0)
    record = _record(seg)
    spike = Event(type="spike", reason="loss spiked", metric="loss", onset_step=70, step=70)
    decision = step.apply(record, seg, spike)
    assert decision.action == "rollback" and decision.target_id == "c40"  # best val_loss before step 50
    assert seg.decision == decision.to_dict() and seg.outcome == "rollback"
    assert record.next_restore == {
        "checkpoint_id": "c40",
        "skip_batches": 7,
        "lr_scale": 0.5,
        "from_scratch": False,
        "rollback": True,
    }
    assert len(step.history) == 1 and saves == [1]
    assert run.tags == {"rollback.decision.000": f"rollback: {decision.reason}"}


def test_an_interrupted_segment_keeps_its_outcome_and_its_decision_becomes_pending(tmp_path: Path):
    step, _ = _step(tmp_path, Catalog(CHECKPOINTS))
    lost = Event(type="preemption", reason="machine lost", source="lineage")
    seg = SegmentRecord(index=0, started=0.0, ended=5.0, outcome="interrupted", event=lost.to_dict())
    done = SegmentRecord(index=1, started=6.0, ended=9.0, outcome="finished")
    pending = step.decide_interrupted(_record(seg, done))
    assert pending is not None and pending.action == "resume" and pending.target_id == "c60"
    assert seg.outcome == "interrupted" and seg.decision == pending.to_dict() and done.decision is None
    assert step.decide_interrupted(_record(seg, done)) is None  # decided once


@pytest.mark.parametrize(
    ("code", "stderr", "outcome", "action"),
    [
        (exitcodes.EXIT_OK, "", "finished", None),
        (exitcodes.EXIT_PREEMPTED, "", "resume", "resume"),
        (1, 'Traceback (most recent call last):\n  File "t.py"\nValueError: bad shape', "fail", "fail"),
    ],
)
def test_conclude_classifies_the_exit(tmp_path: Path, code, stderr, outcome, action):
    step, _ = _step(tmp_path, Catalog(CHECKPOINTS))
    record = _record(SegmentRecord(index=0, started=0.0))
    decision = step.conclude(record, _result(0, code, stderr))
    seg = record.segments[0]
    assert (seg.returncode, seg.ended, seg.last_step, seg.outcome) == (code, 10.0, 33, outcome)
    assert (decision.action if decision else None) == action
    assert (seg.event is None) == (action is None)


def test_the_event_we_stopped_for_wins_over_the_exit_code(tmp_path: Path):
    step, _ = _step(tmp_path, Catalog(CHECKPOINTS))
    record = _record(SegmentRecord(index=0, started=0.0))
    hang = Event(type="hang", reason="no heartbeat for 20 s", source="monitor")
    decision = step.conclude(record, _result(0, -12, stopped_for=hang))
    assert decision is not None and decision.action == "resume"
    assert record.segments[0].event["type"] == "hang"


@pytest.mark.parametrize(("cause", "event_type"), [("preemption", "preemption"), (None, "software_error")])
def test_a_launchers_own_verdict_wins_over_the_exit_code_and_stderr(tmp_path: Path, cause, event_type):
    # A scheduler says PREEMPTED; the exit code and the traceback alone would read as a software error.
    step, _ = _step(tmp_path, Catalog(CHECKPOINTS))
    record = _record(SegmentRecord(index=0, started=0.0))
    stderr = 'Traceback (most recent call last):\n  File "t.py"\nValueError: bad shape'
    info = ExitInfo(1, stderr, "", None, "job-7", 1.0, cause=cause)
    decision = step.conclude(record, SegmentResult(0, info, None, 0.0, 10.0, 33))
    assert record.segments[0].event["type"] == event_type
    assert decision is not None and decision.action == ("resume" if cause else "fail")
    if cause:
        assert record.segments[0].event["source"] == "launcher"


def _report(event: Event, **extra) -> dict:
    return {"seq": 1, "time": 5.0, "event": event.to_dict(), **extra}


def test_fold_sorts_the_training_sides_reports(tmp_path: Path):
    step, run = _step(tmp_path, Catalog(CHECKPOINTS))
    spike = Event(type="spike", reason="loss spiked", metric="loss", onset_step=301, step=301)
    handled = Decision(action="rollback", reason="in process", event=spike, target_id="c40", target_step=40)
    grad = Event(type="threshold", reason="grad_norm > 100", metric="grad_norm", onset_step=302, step=302)
    disk = Event(type="storage_error", reason="disk full", source="in_process")
    later = Event(type="non_finite", reason="nan", metric="loss", onset_step=400, step=400)
    seg = SegmentRecord(index=3, started=0.0)
    reported = step.fold(
        seg,
        [
            _report(disk, kind="save_failed"),
            _report(spike, handled_in_process=True, decision=handled.to_dict()),
            _report(grad),
            _report(later),
        ],
    )
    assert reported == later  # left to the supervisor
    assert seg.save_failures == [_report(disk, kind="save_failed")]
    assert [e.get("part_of_incident", False) for e in seg.in_process] == [False, True]
    assert [e.decision.action for e in step.history.entries] == ["rollback"]
    assert run.tags == {"rollback.decision.000": "[in-process] rollback: in process"}


def test_fold_reports_moves_the_records_offset(tmp_path: Path):
    step, _ = _step(tmp_path, Catalog(CHECKPOINTS))
    path = tmp_path / "events.jsonl"
    nan = Event(type="non_finite", reason="nan", metric="loss", onset_step=9, step=9)
    path.write_text(json.dumps(_report(nan)) + "\n")
    record = _record(SegmentRecord(index=0, started=0.0))
    assert step.fold_reports(record, record.segments[0]) == nan
    assert (record.events_consumed, record.events_offset) == (1, path.stat().st_size)
    assert step.fold_reports(record, record.segments[0]) is None  # nothing new


@pytest.mark.parametrize(
    ("status", "final", "run_status"),
    [("finished", "c60", "FINISHED"), ("stopped", "c40", "FINISHED"), ("failed", "c40", "FAILED")],
)
def test_finish_keeps_the_newest_of_a_finished_run_else_the_best(tmp_path: Path, status, final, run_status):
    saves: list = []
    step, run = _step(tmp_path, Catalog(CHECKPOINTS), saves)
    record = step.finish(_record(), status, "why")
    assert (record.status, record.final_reason, record.final_checkpoint) == (status, "why", final)
    assert run.terminated == [run_status] and saves == [1]


def test_finish_without_checkpoints(tmp_path: Path):
    step, _ = _step(tmp_path, None)
    assert step.finish(_record(), "failed", "x").final_checkpoint is None
