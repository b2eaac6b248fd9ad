"""The decision engine, table-driven: every action, target, budget, escalation and fallback."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from policies import CheckpointRecord, Decision, History, decide, load_preset, parse_policy
from supervisor.events import Event

NOW = 10_000.0


def lowest_loss_scale(catalogue, event, *, metric="loss_scale", minimum=1.0):
    """Custom selector used by the YAML below: the newest checkpoint whose loss scale is still healthy."""
    healthy = [c for c in catalogue if c.metrics.get(metric, 0.0) >= minimum]
    return max(healthy, key=lambda c: c.step, default=None)


def exploding_selector(catalogue, event):
    raise RuntimeError("scaler state unreadable")


def foreign_selector(catalogue, event):
    return CheckpointRecord("ghost", 1)


def id_selector(catalogue, event):
    return catalogue[0].id


POLICY = """
version: 1
name: engine-test
checkpoint: {every_steps: 100, keep_best: {metric: val_loss, mode: min, count: 2}}
rules:
  - when: [spike]
    action: rollback
    target: {select: best_before, metric: val_loss, mode: min, lookback_steps: 100}
    skip_batches: 300
    lr_scale: 0.5
  - when: [non_finite]
    action: rollback
    target: {select: latest}
  - when: [divergence]
    action: rollback
    target: {select: before, lookback_steps: 250}
    allow_scratch: true
  - when: [threshold]
    action: rollback
    target: {select: best, metric: val_loss, mode: max}
  - when: [preemption, hang]
    action: resume
    target: {select: latest}
  - when: [hardware_fault]
    action: resume
  - when: [plateau]
    action: stop
  - when: [software_error]
    action: fail
  - when: [unknown_exit]
    action: rollback
    target: {select: "tests.test_policy_engine:lowest_loss_scale", minimum: 2.0}
limits:
  max_rollbacks: 3
  max_restarts: 5
  backoff: {initial_seconds: 1, max_seconds: 8, multiplier: 2, jitter: false}
  escalation: {same_step_window: 50, lookback_multiplier: 3, max_escalations: 1}
"""

CATALOGUE = (
    CheckpointRecord("c100", 100, {"val_loss": 3.0, "loss_scale": 4.0}),
    CheckpointRecord("c200", 200, {"val_loss": 2.5, "loss_scale": 4.0}),
    CheckpointRecord("c300", 300, {"val_loss": 2.8, "loss_scale": 1.0}),
    CheckpointRecord("c400", 400, {"val_loss": 2.1, "loss_scale": 1.0}, valid=False),
    CheckpointRecord("c500", 500, {"val_loss": 2.4, "loss_scale": 0.5}),
    CheckpointRecord("c600", 600, {"val_loss": 2.6}),
    CheckpointRecord("c700", 700, {"val_loss": 9.9, "loss_scale": 0.5}),
)


def ev(type_: str, step: int | None = 650, onset: int | None = None, **kw: Any) -> Event:
    return Event(
        type=type_, reason="test", metric=kw.pop("metric", "loss"), onset_step=onset, step=step, **kw
    )


def past(*items: tuple[str, str, int | None]) -> History:
    """A history of (event type, action, onset) entries, one second apart, an hour before NOW."""
    history = History()
    for i, (type_, action, onset) in enumerate(items):
        event = ev(type_, step=onset, onset=onset)
        history.record(event, Decision(action=action, reason="earlier", event=event), NOW - 3600 - 10 + i)
    return history


@dataclass
class Case:
    name: str
    event: Event
    action: str
    target: str | None = None
    history: History = field(default_factory=History)
    catalogue: tuple[CheckpointRecord, ...] = CATALOGUE
    skip: int = 0
    lr: float = 1.0
    rule: int | None = None
    reason_has: tuple[str, ...] = ()
    yaml: str = POLICY
    fallback: bool = False


def _custom(function: str) -> str:
    return POLICY.replace(
        '"tests.test_policy_engine:lowest_loss_scale", minimum: 2.0', f'"tests.test_policy_engine:{function}"'
    )


CASES = [
    # best_before: step <= 600 - 100 = 500; c400 has the best val_loss but is invalid, so c500 (2.4)
    Case(
        "best_before skips invalid",
        ev("spike", 650, 600),
        "rollback",
        "c500",
        skip=300,
        lr=0.5,
        rule=0,
        reason_has=("saved at or before step 500", "c500 (step 500, val_loss=2.4)"),
    ),
    Case(
        "best_before respects lookback", ev("spike", 560, 520), "rollback", "c200", skip=300, lr=0.5, rule=0
    ),
    Case("rollback latest excludes onset", ev("non_finite", 620, 600), "rollback", "c500", rule=1),
    Case("rollback latest, onset = step", ev("non_finite", 700, 700), "rollback", "c600", rule=1),
    Case("before", ev("divergence", 900, 800), "rollback", "c500", rule=2),
    Case("best max", ev("threshold", 800, 750), "rollback", "c700", rule=3),
    Case("resume latest", ev("preemption", 710), "resume", "c700", rule=4),
    Case("resume hang", ev("hang", None), "resume", "c700", rule=4),
    Case("resume default target", ev("hardware_fault", 705), "resume", "c700", rule=5),
    Case(
        "stop keeps best",
        ev("plateau", 720),
        "stop",
        "c500",
        rule=6,
        reason_has=("stopping the run successfully",),
    ),
    Case("fail rule", ev("software_error", 720), "fail", None, rule=7, reason_has=("the policy says fail",)),
    Case("no rule", ev("oom", 720), "fail", None, reason_has=("no rule handles oom events",)),
    Case("unknown type", ev("cosmic_ray", 720), "fail", None, reason_has=("unknown event type",)),
    Case(
        "custom selector with options",
        ev("unknown_exit", 800, 800),
        "rollback",
        "c200",
        rule=8,
        reason_has=("tests.test_policy_engine:lowest_loss_scale(minimum=2.0)",),
    ),
    Case(
        "rollback budget exhausted",
        ev("spike", 650, 600),
        "fail",
        None,
        rule=0,
        history=past(
            ("spike", "rollback", 100), ("non_finite", "rollback", 200), ("divergence", "rollback", 300)
        ),
        reason_has=("rollback budget exhausted: 3 of 3 used (limits.max_rollbacks)",),
    ),
    Case(
        "restart budget exhausted",
        ev("preemption", 710),
        "fail",
        None,
        rule=4,
        history=past(*[("preemption", "resume", None)] * 5),
        reason_has=("restart budget exhausted: 5 of 5 used (limits.max_restarts)",),
    ),
    Case(
        "stop ignores budgets",
        ev("plateau", 720),
        "stop",
        "c500",
        rule=6,
        history=past(*[("preemption", "resume", None)] * 5),
    ),
    # one earlier spike rollback with onset 620 (within 50 of 600): lookback 100 x3 = 300 -> step <= 300
    Case(
        "escalation widens lookback",
        ev("spike", 650, 600),
        "rollback",
        "c200",
        skip=300,
        lr=0.5,
        rule=0,
        history=past(("spike", "rollback", 620)),
        reason_has=("recurrence 1 of 1 allowed: lookback 100 x3 = 300 steps",),
    ),
    Case(
        "escalation exhausted fails",
        ev("spike", 650, 600),
        "fail",
        None,
        rule=0,
        history=past(("spike", "rollback", 620), ("spike", "rollback", 590)),
        reason_has=("rollback loop: spike recurred within 50 steps",),
    ),
    Case(
        "recurrence outside window",
        ev("spike", 650, 600),
        "rollback",
        "c500",
        skip=300,
        lr=0.5,
        rule=0,
        history=past(("spike", "rollback", 651), ("spike", "rollback", 549)),
    ),
    Case(
        "other type is no recurrence",
        ev("spike", 650, 600),
        "rollback",
        "c500",
        skip=300,
        lr=0.5,
        rule=0,
        history=past(("non_finite", "rollback", 600), ("divergence", "rollback", 600)),
    ),
    Case(
        "resume is no recurrence",
        ev("spike", 650, 600),
        "rollback",
        "c500",
        skip=300,
        lr=0.5,
        rule=0,
        history=past(("spike", "resume", 600), ("spike", "resume", 600)),
    ),
    Case(
        "no match falls back to the newest before onset",
        ev("spike", 150, 120),
        "rollback",
        "c100",
        skip=300,
        lr=0.5,
        rule=0,
        fallback=True,
        reason_has=(
            "no checkpoint matches best_before(val_loss, min, lookback_steps=100)",
            "falling back to the newest healthy checkpoint before the onset",
        ),
    ),
    Case(
        "strict target, no match, no scratch",
        ev("spike", 150, 120),
        "fail",
        None,
        rule=0,
        reason_has=(
            "no checkpoint matches best_before(val_loss, min, lookback_steps=100)",
            "allow_scratch is false",
        ),
        yaml=POLICY.replace("lookback_steps: 100}", "lookback_steps: 100, strict: true}"),
    ),
    Case(
        "strict target, no match, scratch allowed",
        ev("divergence", 300, 240),
        "rollback",
        None,
        rule=2,
        reason_has=("restarting from scratch (allow_scratch)",),
        yaml=POLICY.replace("lookback_steps: 250}", "lookback_steps: 250, strict: true}"),
    ),
    Case(
        "nothing before onset, scratch allowed",
        ev("divergence", 90, 90),
        "rollback",
        None,
        rule=2,
        reason_has=("among 0 valid checkpoint(s) at or before step 88", "restarting from scratch"),
    ),
    Case("empty catalogue resume", ev("preemption", 10), "fail", None, rule=4, catalogue=()),
    Case(
        "all invalid",
        ev("non_finite", 800, 800),
        "fail",
        None,
        rule=1,
        catalogue=tuple(CheckpointRecord(c.id, c.step, c.metrics, valid=False) for c in CATALOGUE),
    ),
    Case("no step: measured from newest", ev("divergence", None), "rollback", "c300", rule=2),
    Case(
        "escalation off",
        ev("spike", 650, 600),
        "rollback",
        "c500",
        skip=300,
        lr=0.5,
        rule=0,
        history=past(("spike", "rollback", 600), ("spike", "rollback", 600)),
        yaml=POLICY.replace(
            "  escalation: {same_step_window: 50, lookback_multiplier: 3, max_escalations: 1}",
            "  escalation: null",
        ),
    ),
    Case(
        "custom selector raises",
        ev("unknown_exit", 800, 800),
        "fail",
        None,
        rule=8,
        yaml=_custom("exploding_selector"),
        reason_has=("raised RuntimeError: scaler state unreadable",),
    ),
    Case(
        "custom selector returns a stranger",
        ev("unknown_exit", 800, 800),
        "fail",
        None,
        rule=8,
        yaml=_custom("foreign_selector"),
        reason_has=("returned 'ghost', not a valid candidate",),
    ),
    Case(
        "custom selector returns an id, not a record",
        ev("unknown_exit", 800, 800),
        "fail",
        None,
        rule=8,
        yaml=_custom("id_selector"),
        reason_has=("returned 'c100', not a valid candidate",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_decision_table(case: Case):
    policy = parse_policy(case.yaml)
    decision = decide(policy, case.event, case.history, case.catalogue, now=NOW, rng_seed=7)
    assert (decision.action, decision.target_id) == (case.action, case.target), decision.reason
    assert decision.fallback == case.fallback, decision.reason
    assert decision.rule_index == case.rule
    assert decision.event == case.event
    for words in case.reason_has:
        assert words in decision.reason
    assert "\n" not in decision.reason
    if decision.relaunches:
        assert (decision.skip_batches, decision.lr_scale) == (case.skip, case.lr)
        chosen = next((c for c in case.catalogue if c.id == decision.target_id), None)
        assert decision.target_step == (chosen.step if chosen else 0)
        assert decision.from_scratch == (chosen is None)
        assert chosen is None or chosen.valid
    else:
        assert (decision.skip_batches, decision.lr_scale, decision.delay_seconds) == (0, 1.0, 0.0)


def test_reason_names_rule_event_checkpoint_why_and_budgets():
    policy = load_preset("palm-spike")
    catalogue = [
        CheckpointRecord(f"step-{s:06d}", s, {"val_loss": v})
        for s, v in [(800, 2.4), (1000, 2.3), (1200, 2.2)]
    ]
    event = Event(type="spike", reason="loss 9.1 > 6 sigmas", metric="loss", onset_step=1180, step=1200)
    decision = decide(policy, event, History(), catalogue, now=NOW, rng_seed=1)
    assert decision.reason == (
        "rules[0] (non_finite, spike, divergence, threshold -> rollback): spike on loss at step 1200 (onset 1180); "
        "roll back to step-001000 (step 1000, val_loss=2.3) chosen by best_before(val_loss, min, lookback_steps=100), "
        f"i.e. saved at or before step 1080; skip 300 batches, lr x0.5, relaunch in {decision.delay_seconds:.1f} s; "
        "budgets left: 4 of 5 rollbacks, 19 of 20 restarts"
    )


def test_an_in_process_rollback_says_so_and_has_no_relaunch_delay():
    """The training process carries out its own rollback: no "relaunch in X s" in its reason (issue 14)."""
    policy = load_preset("palm-spike")
    catalogue = [CheckpointRecord(f"step-{s:06d}", s, {"val_loss": v}) for s, v in [(800, 2.4), (1000, 2.3)]]
    event = Event(type="spike", reason="loss 9.1 > 6 sigmas", metric="loss", onset_step=1180, step=1200)
    decision = decide(policy, event, History(), catalogue, now=NOW, rng_seed=1, in_process=True)
    assert decision.action == "rollback" and decision.target_id == "step-001000"
    assert decision.delay_seconds == 0.0
    assert "skip 300 batches, lr x0.5, carried out in process, no relaunch" in decision.reason
    assert "relaunch in" not in decision.reason
    # A decision the training process cannot carry out (here: no checkpoint, so from scratch) keeps its delay.
    fresh = decide(policy, event, History(), [], now=NOW, rng_seed=1, in_process=True)
    assert fresh.action != "rollback" or fresh.target_id is None


def test_decide_never_touches_history_or_catalogue():
    policy = parse_policy(POLICY)
    history = past(("spike", "rollback", 620))
    before = json.dumps(history.to_dict(), sort_keys=True)
    catalogue = list(CATALOGUE)
    decide(policy, ev("spike", 650, 600), history, catalogue, now=NOW)
    assert json.dumps(history.to_dict(), sort_keys=True) == before
    assert catalogue == list(CATALOGUE)


def test_backoff_doubles_up_to_the_cap_and_resets_after_the_window():
    policy = parse_policy(POLICY.replace("max_restarts: 5", "max_restarts: 20"))
    history, delays = History(), []
    for i in range(6):
        event = ev("preemption", 700 + i)
        decision = decide(policy, event, history, CATALOGUE, now=NOW + i)
        delays.append(decision.delay_seconds)
        history.record(event, decision, NOW + i)
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    # an hour later (reset_after_seconds defaults to 3600) the earlier relaunches no longer count
    at_edge = decide(policy, ev("preemption", 800), history, CATALOGUE, now=NOW + 5 + 3600)
    assert at_edge.delay_seconds == 2.0  # the last relaunch is exactly 3600 s old: it still counts
    later = decide(policy, ev("preemption", 800), history, CATALOGUE, now=NOW + 5 + 3600.5)
    assert later.delay_seconds == 1.0


def test_jitter_is_seeded_and_within_half_to_full():
    policy = parse_policy(POLICY.replace("jitter: false", "jitter: true"))
    history = past(("preemption", "resume", None), ("preemption", "resume", None))
    history = History([type(e)(time=NOW - 5, event=e.event, decision=e.decision) for e in history])
    delays = {
        decide(policy, ev("preemption"), history, CATALOGUE, now=NOW, rng_seed=s).delay_seconds
        for s in range(20)
    }
    assert all(2.0 <= d <= 4.0 for d in delays)  # third relaunch: 4 s, jittered to [2, 4]
    assert len(delays) > 10
    again = {
        decide(policy, ev("preemption"), history, CATALOGUE, now=NOW, rng_seed=s).delay_seconds
        for s in range(20)
    }
    assert again == delays
    unseeded = [decide(policy, ev("preemption"), history, CATALOGUE, now=NOW).delay_seconds for _ in range(3)]
    assert len(set(unseeded)) == 1


def test_decision_round_trips_through_json():
    policy = parse_policy(POLICY)
    for case in CASES[:12]:
        decision = decide(policy, case.event, case.history, case.catalogue, now=NOW, rng_seed=3)
        assert Decision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision
