"""The `warn` rule action (issue 28, item 2): the schema, the engine, `policy explain`, the training side's
in-process warning (alone and rank 0 deciding for every rank), the supervisor's side, and one real run of two
gloo ranks with a straggler the policy only warns about."""

from __future__ import annotations

import json
import signal
import socket
from pathlib import Path

import pytest

from policies import Decision, History, PolicyError, decide, parse_policy
from policies.schema import WARN_EVENTS
from policies.summary import summarize
from supervisor import exitcodes
from supervisor.events import EVENT_TYPES, Event
from supervisor.launcher import ExitInfo
from supervisor.lineage import LineageRecord, MlflowRef, SegmentRecord
from supervisor.lineage.exclusions import HostPool
from supervisor.orchestrator import SegmentResult
from supervisor.orchestrator.decision_step import DecisionStep
from supervisor.orchestrator.events_log import EventsLog
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.rollback import WARNED, InProcessRollback
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.seams import NullHeartbeat, NullMetrics, Outputs
from tests.test_runner_segment_run import Rig

POLICY = """\
version: 1
name: warn
monitor:
  detectors:
    - {type: straggler, factor: 2, patience: 3}
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [straggler, spike]
    action: warn
  - when: [non_finite]
    action: rollback
    target: {select: latest}
  - when: [preemption]
    action: resume
limits: {max_rollbacks: 1, max_restarts: 1}
"""

STRAGGLER = Event(
    "straggler",
    "rank 1 took 0.6 s per step, 6 x the other ranks' median",
    metric="ranks/slowest_step_s",
    onset_step=3,
    step=5,
    source="in_process",
    evidence={"rank": 1, "host": "n4"},
)
NAN = Event("non_finite", "loss is NaN", metric="loss", onset_step=5, step=5, source="in_process")


# -- the schema -----------------------------------------------------------------------------------


@pytest.mark.parametrize("event", WARN_EVENTS)
def test_warn_is_a_rule_action_for_the_events_training_can_go_on_after(event):
    policy = parse_policy(f"version: 1\nname: p\nrules: [{{when: [{event}], action: warn}}]\n")
    assert policy.rule_for(event)[1].action == "warn"


@pytest.mark.parametrize(
    ("event", "why"),
    [
        ("non_finite", "NaN or infinite values leave nothing worth training on: roll back"),
        ("hang", "the process is hung: resume or fail"),
        ("oom", "the process is gone"),
        ("hardware_fault", "the process is gone"),
    ],
)
def test_warn_is_refused_where_training_cannot_go_on_naming_file_line_and_key(event, why):
    text = f"version: 1\nname: p\nrules:\n  - when: [spike, {event}]\n    action: warn\n"
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    (message,) = caught.value.problems
    assert message.startswith("p.yaml:4:") and "rules[0].when[1]: expected an event type warn can" in message
    assert why in message and message.endswith(f'got "{event}"')


@pytest.mark.parametrize(
    ("key", "value"),
    [("target", "{select: latest}"), ("skip_batches", "3"), ("lr_scale", "0.5"), ("allow_scratch", "true")],
)
def test_a_warn_rule_refuses_the_relaunch_keys_as_stop_and_fail_do(key, value):
    text = f"version: 1\nname: p\nrules:\n  - when: [straggler]\n    action: warn\n    {key}: {value}\n"
    with pytest.raises(PolicyError) as caught:
        parse_policy(text, "p.yaml")
    assert f"rules[0].{key}: expected no {key} with action warn (nothing is relaunched)" in str(caught.value)


# -- the engine and explain -----------------------------------------------------------------------


def test_a_warn_decision_names_no_target_spends_no_budget_and_says_so():
    policy = parse_policy(POLICY)
    spent = History()  # every budget spent: a relaunch would fail the run; a warning does not
    spent.record(NAN, Decision(action="rollback", target_id="c1", target_step=1, reason="r", event=NAN), 1.0)
    assert (spent.rollbacks, spent.restarts) == (1, 1)
    assert decide(policy, NAN, spent, [], now=2.0).action == "fail"
    decision = decide(policy, STRAGGLER, spent, [], now=10.0, in_process=True)
    assert (decision.action, decision.target_id, decision.target_step, decision.delay_seconds) == (
        "warn",
        None,
        None,
        0.0,
    )
    assert not decision.relaunches and not decision.from_scratch and decision.rule_index == 0
    assert decision.reason == (
        "rules[0] (straggler, spike -> warn): straggler on ranks/slowest_step_s at step 5 (onset 3); warning "
        "only: training goes on (no restore, no stop, no relaunch); budgets untouched: 0 of 1 rollbacks, 0 of "
        "1 restarts left"
    )
    spent.record(STRAGGLER, decision, 10.0)
    assert (spent.rollbacks, spent.restarts) == (1, 1)  # warnings are not counted
    again = History.from_dict(json.loads(json.dumps(spent.to_dict())))
    assert again == spent and again.entries[-1].decision == decision


def test_explain_says_what_a_warn_rule_does_and_describes_the_straggler_detector():
    text = summarize(parse_policy(POLICY))
    width = max(len(t) for t in EVENT_TYPES)
    said = (
        "rules[0]: warn: the event and the decision are logged and recorded, and training goes on (no restore, "
        "no stop, no relaunch, no budget spent)."
    )
    assert f"  {'straggler':<{width}}  {said}" in text and f"  {'spike':<{width}}  {said}" in text
    assert (
        "  straggler: fires when one rank's step takes 2 x the other ranks' median, and at least 0.05 s more, "
        "for 3 steps in a row (torchrun only)." in text
    )


# -- the training side ----------------------------------------------------------------------------


def _in_process(tmp_path: Path) -> InProcessRollback:
    reporter = EventReporter(tmp_path / "events.jsonl", 0, clock=lambda: 100.0)
    failures = SaveFailures(reporter, Outputs(NullMetrics(), NullHeartbeat()))
    return InProcessRollback(parse_policy(POLICY), History(), failures, reporter, clock=lambda: 100.0)


def _reports(tmp_path: Path) -> list[dict]:
    path = tmp_path / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_alone_a_warned_event_is_reported_and_recorded_and_nothing_is_left_to_decide(tmp_path: Path):
    rollback = _in_process(tmp_path)
    assert rollback.warn([STRAGGLER], 5) is None
    (report,) = _reports(tmp_path)
    assert report["handled_in_process"] and report["event"] == STRAGGLER.to_dict()
    assert report["decision"]["action"] == "warn" and report["decision"]["target_id"] is None
    assert [e.decision.action for e in rollback.history] == ["warn"] and rollback.count == 0


def test_an_anomaly_beside_a_warned_one_is_still_decided(tmp_path: Path):
    rollback = _in_process(tmp_path)
    assert rollback.warn([STRAGGLER, NAN], 5) == [NAN]  # a NaN must never ride on a warning
    assert rollback.warn([NAN], 6) == [NAN]
    assert [r["event"]["type"] for r in _reports(tmp_path)] == ["straggler"]


class Dist:
    """One rank's side of `broadcast_outcome`: rank 0 sends, the others get `answer`."""

    def __init__(self, rank: int, answer: str | None = None) -> None:
        self.rank, self.world_size, self.answer = rank, 2, answer
        self.sent: list[tuple[str | None, BaseException | None]] = []

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def broadcast_outcome(self, value: str | None, error: BaseException | None = None) -> str | None:
        self.sent.append((value, error))
        return value if self.rank == 0 else self.answer


@pytest.mark.parametrize(
    ("events", "sent", "left"),
    [([STRAGGLER], WARNED, None), ([STRAGGLER, NAN], None, [NAN]), ([NAN], None, [NAN])],
)
def test_under_ddp_rank_0_decides_and_every_rank_learns_whether_it_trains_on(tmp_path, events, sent, left):
    rank0 = Dist(0)
    assert _in_process(tmp_path).warn(events, 5, rank0) == left
    assert rank0.sent == [(sent, None)]
    rank1 = Dist(1, answer=sent)
    assert _in_process(tmp_path / "..").warn([], 5, rank1) == (None if sent == WARNED else [])
    assert rank1.sent == [(None, None)]


def test_under_ddp_a_failure_deciding_on_rank_0_is_sent_to_every_rank(tmp_path: Path):
    rollback = _in_process(tmp_path)
    rollback._reporter.path = tmp_path / "missing" / "events.jsonl"  # the report cannot be written
    rank0 = Dist(0)
    with pytest.raises(FileNotFoundError):
        rollback.warn([STRAGGLER], 5, rank0)
    ((value, error),) = rank0.sent
    assert value is None and isinstance(error, FileNotFoundError)


# -- the supervisor's side ------------------------------------------------------------------------


class Run:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def tag(self, key: str, text: str) -> None:
        self.tags[key] = text

    def terminate(self, status: str) -> None:
        pass


def _decisions(tmp_path: Path) -> tuple[DecisionStep, Run]:
    run = Run()
    step = DecisionStep(
        parse_policy(POLICY),
        history=History(),
        events=EventsLog(tmp_path / "events.jsonl"),
        catalog=lambda: None,
        run=run,
        save=lambda: None,
        clock=lambda: 1000.0,
        host_pool=lambda: HostPool(1, None),
    )
    return step, run


def _record(seg: SegmentRecord) -> LineageRecord:
    return LineageRecord(lineage="t", status="running", mlflow=MlflowRef("u", "e", "r"), segments=[seg])


def _report(event: Event, decision: Decision | None, *, handled: bool, seq: int) -> str:
    return json.dumps(
        {
            "seq": seq,
            "time": 50.0 + seq,
            "handled_in_process": handled,
            "event": event.to_dict(),
            "decision": decision.to_dict() if decision else None,
        }
    )


def test_a_warning_reported_in_process_is_recorded_and_a_later_anomaly_is_decided_on_its_own(tmp_path):
    step, run = _decisions(tmp_path)
    warned = decide(step.policy, STRAGGLER, History(), [], now=1.0, in_process=True)
    lines = [_report(STRAGGLER, warned, handled=True, seq=1), _report(NAN, None, handled=False, seq=2)]
    (tmp_path / "events.jsonl").write_text("\n".join(lines) + "\n")
    seg = SegmentRecord(index=0, started=0.0, host="n4")
    record = _record(seg)
    exit_info = ExitInfo(exitcodes.EXIT_ANOMALY, "", "", None, "1", 1.0)
    decision = step.conclude(record, SegmentResult(0, exit_info, None, 0.0, 10.0, 5))
    # The NaN shares the straggler's onset window, but a warning handled nothing: the NaN gets its own decision
    # (its rule's; with no checkpoint in this catalogue, a rollback fails the run).
    assert decision is not None and decision.event == NAN and decision.rule_index == 1
    assert [e.decision.action for e in step.history] == ["warn", "fail"]
    assert run.tags["rollback.decision.000"].startswith("[in-process] warn: rules[0]")
    assert record.excluded_hosts is None  # a warned straggler excludes no host


def test_a_warning_seen_by_the_supervisors_monitor_is_recorded_and_the_segment_runs_on(tmp_path: Path):
    step, run = _decisions(tmp_path)
    seg = SegmentRecord(index=0, started=0.0)
    record = _record(seg)
    assert step.warn(seg, STRAGGLER) is True
    assert step.warn(seg, NAN) is False  # its rule rolls back: the segment is stopped for it as before
    (entry,) = seg.warnings
    assert entry["event"] == STRAGGLER.to_dict() and entry["decision"]["action"] == "warn"
    assert [e.decision.action for e in step.history] == ["warn"] and record.excluded_hosts is None
    assert run.tags["rollback.decision.000"].startswith("warn: rules[0]")
    assert SegmentRecord.from_dict(seg.to_dict()) == seg and "warnings" not in SegmentRecord(1, 0.0).to_dict()


def test_a_segment_that_stopped_for_a_warned_event_anyway_goes_on_from_its_newest_checkpoint(tmp_path):
    step, _ = _decisions(tmp_path)
    seg = SegmentRecord(index=0, started=0.0, restore={"checkpoint_id": "c40"})
    record = _record(seg)
    record.next_restore = {"checkpoint_id": "c40"}
    decision = step.apply(record, seg, STRAGGLER)
    assert decision.action == "warn" and seg.outcome == "warn" and not decision.relaunches
    assert record.next_restore == {
        "checkpoint_id": None,
        "skip_batches": 0,
        "lr_scale": 1.0,
        "from_scratch": False,
        "rollback": False,
    }
    assert record.excluded_hosts is None and step.history.restarts == 0


def test_the_watch_keeps_a_segment_running_through_an_event_the_policy_only_warns_about(tmp_path: Path):
    spike = Event("spike", "loss spiked", metric="loss", onset_step=3, step=3)
    warned: list[Event] = []
    rig = Rig(tmp_path, polls=4, events={1: [STRAGGLER], 2: [spike]})
    rig.run.warn = lambda seg, event: warned.append(event) or event.type == "straggler"
    result = rig()
    assert warned == [STRAGGLER, spike] and result.stopped_for == spike
    assert rig.handle.signals == [(signal.SIGUSR2, 7.0)]


def test_a_warning_reported_in_process_covers_only_its_own_event_type(tmp_path: Path):
    warned = decide(parse_policy(POLICY), STRAGGLER, History(), [], now=1.0, in_process=True)
    (tmp_path / "events.jsonl").write_text(_report(STRAGGLER, warned, handled=True, seq=1) + "\n")
    on_monitor = Event("straggler", "rank 1 slow", metric="ranks/slowest_step_s", onset_step=3, step=5)
    spike = Event("spike", "loss spiked", metric="loss", onset_step=4, step=4)
    rig = Rig(tmp_path, polls=4, events={1: [on_monitor], 2: [spike]})
    assert rig().stopped_for == spike  # the straggler was the training side's; the spike is new


# -- a real run: two gloo ranks, one slow, the policy warns ---------------------------------------

WARN_RUN = """\
version: 1
name: straggler-warn
checkpoint: {every_steps: 4, keep_last: 2, storage: ./checkpoints}
monitor:
  detectors:
    - {type: straggler, factor: 2.5, patience: 3, min_gap_seconds: 0.1}
rules:
  - when: [straggler]
    action: warn
"""


@pytest.mark.e2e
@pytest.mark.slow
def test_two_ranks_train_on_past_a_straggler_the_policy_warns_about(tmp_path: Path):
    from tests.test_faults_hardware_e2e import losses, segment

    proc = segment(tmp_path, "slow@3:rank1:0.6s", WARN_RUN, 8, ranks=2)
    assert proc.returncode == exitcodes.EXIT_OK, proc.stderr[-3000:]
    (report,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    event, decision = report["event"], report["decision"]
    assert event["type"] == "straggler" and event["onset_step"] == 3 and event["step"] == 5
    assert event["evidence"]["rank"] == 1 and event["evidence"]["host"] == socket.gethostname()
    assert decision["action"] == "warn" and report["handled_in_process"]
    # Nothing was rolled back: every step ran once, to the last.
    assert [step for step, _ in losses(tmp_path, 0)] == list(range(1, 9))
