"""Fallback targets (issue 30): a target that matches nothing falls back to the newest usable checkpoint before the
onset, unless `target.strict`; only with no candidate at all do allow_scratch and fail apply. Table-driven, pure."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from policies import CheckpointRecord, Decision, History, decide, load_preset, parse_policy
from policies.summary import summarize
from supervisor.events import Event

NOW = 10_000.0
PALM = load_preset("palm-spike")
#: palm-spike's rollback rule on its own, with room for the variations below.
POLICY = """
version: 1
name: fallback-test
checkpoint: {every_steps: 100, allow_nonfinite: ALLOW}
rules:
  - when: [non_finite, spike]
    action: rollback
    target: {select: best_before, metric: val_loss, mode: min, lookback_steps: 100, strict: STRICT}
    allow_scratch: SCRATCH
  - when: [preemption]
    action: resume
    target: {select: best, metric: val_loss, strict: STRICT}
limits:
  escalation: {same_step_window: 50, lookback_multiplier: 2, max_escalations: 1}
"""


def policy(*, strict: bool = False, scratch: bool = False, allow_nonfinite: bool = False):
    text = POLICY.replace("STRICT", str(strict).lower()).replace("SCRATCH", str(scratch).lower())
    return parse_policy(text.replace("ALLOW", str(allow_nonfinite).lower()))


def ck(
    step: int, val_loss: float | None = 2.0, *, healthy: bool = True, valid: bool = True
) -> CheckpointRecord:
    metrics = {} if val_loss is None else {"val_loss": val_loss}
    return CheckpointRecord(f"ckpt-{step:06d}", step, metrics, valid=valid, healthy=healthy)


def nan(onset: int, step: int | None = None) -> Event:
    return Event(type="non_finite", reason="loss is nan", metric="loss", onset_step=onset, step=step or onset)


def earlier_rollback(onset: int) -> History:
    history = History()
    event = nan(onset)
    history.record(event, Decision(action="rollback", reason="earlier", event=event), NOW - 60)
    return history


@dataclass
class Case:
    name: str
    event: Event
    catalogue: tuple[CheckpointRecord, ...]
    action: str
    target: str | None
    fallback: bool
    reason_has: tuple[str, ...] = ()
    strict: bool = False
    scratch: bool = False
    allow_nonfinite: bool = False
    history: History | None = None


CASES = [
    Case(
        "a match needs no fallback",
        nan(420),
        (ck(200, 2.1), ck(300, 2.3), ck(400, 2.0)),
        "rollback",
        "ckpt-000200",
        False,
        ("chosen by best_before(val_loss, min, lookback_steps=100), i.e. saved at or before step 320",),
    ),
    Case(
        "too far back: newest healthy before the onset",
        nan(231),
        (ck(200, 2.1),),
        "rollback",
        "ckpt-000200",
        True,
        (
            "no checkpoint matches best_before(val_loss, min, lookback_steps=100) among 1 valid checkpoint(s) at "
            "or before step 229 (onset 231); falling back to the newest healthy checkpoint before the onset "
            "(target.strict: false): roll back to ckpt-000200 (step 200, val_loss=2.1)",
        ),
    ),
    Case(
        "a match far enough back wins over a newer one",
        nan(650),
        (ck(100, 1.0), ck(200, 3.0), ck(600, 2.5)),
        "rollback",
        "ckpt-000100",
        False,
    ),
    Case(
        "after a gap, nothing far enough back: the newest before the onset",
        nan(640),
        (ck(600, 2.5), ck(610, 2.4), ck(620, 9.0)),
        "rollback",
        "ckpt-000620",
        True,
    ),
    Case(
        "the checkpoint that produced the anomaly is never the fallback",
        nan(231),
        (ck(200, 2.1), ck(230, 2.0)),
        "rollback",
        "ckpt-000200",
        True,
        ("among 1 valid checkpoint(s) at or before step 229",),
    ),
    Case(
        "a fallback needs no metric",
        nan(231),
        (ck(100, None), ck(200, None)),
        "rollback",
        "ckpt-000200",
        True,
    ),
    Case(
        "unhealthy checkpoints are never fallback targets",
        nan(231),
        (ck(150, 2.2), ck(200, 2.1, healthy=False)),
        "rollback",
        "ckpt-000150",
        True,
        ("skipped 1 unhealthy checkpoint(s)", "falling back to the newest healthy checkpoint"),
    ),
    Case(
        "invalid checkpoints are never fallback targets",
        nan(231),
        (ck(150, 2.2), ck(200, 2.1, valid=False)),
        "rollback",
        "ckpt-000150",
        True,
    ),
    Case(
        "only an unhealthy one: no candidate, the run fails",
        nan(231),
        (ck(200, 2.1, healthy=False),),
        "fail",
        None,
        False,
        (
            "among 0 valid checkpoint(s) at or before step 229 (onset 231) (skipped 1 unhealthy",
            "allow_scratch is false",
        ),
    ),
    Case(
        "an unhealthy one is a fallback with allow_nonfinite",
        nan(231),
        (ck(200, 2.1, healthy=False),),
        "rollback",
        "ckpt-000200",
        True,
        ("falling back to the newest checkpoint before the onset", "ckpt-000200 is unhealthy"),
        allow_nonfinite=True,
    ),
    Case(
        "strict: no fallback, today's failure",
        nan(231),
        (ck(200, 2.1),),
        "fail",
        None,
        False,
        strict=True,
    ),
    Case(
        "strict with allow_scratch: from scratch",
        nan(231),
        (ck(200, 2.1),),
        "rollback",
        None,
        False,
        ("restarting from scratch (allow_scratch)",),
        strict=True,
        scratch=True,
    ),
    Case(
        "no candidate at all: fail",
        nan(150),
        (ck(200, 2.1),),
        "fail",
        None,
        False,
        ("allow_scratch is false",),
    ),
    Case("empty catalogue: fail", nan(150), (), "fail", None, False, ("among 0 valid checkpoint(s)",)),
    Case(
        "no candidate at all, allow_scratch: from scratch",
        nan(150),
        (),
        "rollback",
        None,
        False,
        ("restarting from scratch (allow_scratch)",),
        scratch=True,
    ),
    Case(
        "a resume falls back to the newest, with no onset cut",
        Event(type="preemption", reason="SIGTERM", step=250),
        (ck(100, None), ck(200, None)),
        "resume",
        "ckpt-000200",
        True,
        (
            "no checkpoint matches best(val_loss, min) among 2 valid checkpoint(s); falling back to the newest "
            "healthy checkpoint (target.strict: false): resume from ckpt-000200",
        ),
    ),
    Case(
        "escalation still lengthens the lookback",
        nan(420),
        (ck(200, 2.1), ck(300, 2.0)),
        "rollback",
        "ckpt-000200",
        False,
        ("recurrence 1 of 1 allowed: lookback 100 x2 = 200 steps", "saved at or before step 220"),
        history=earlier_rollback(410),
    ),
    Case(
        "an escalated lookback that matches nothing falls back",
        nan(240),
        (ck(200, 2.1),),
        "rollback",
        "ckpt-000200",
        True,
        (
            "best_before(val_loss, min, lookback_steps=200)",
            "recurrence 1 of 1 allowed: lookback 100 x2 = 200 steps",
        ),
        history=earlier_rollback(231),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_fallback_table(case: Case):
    p = policy(strict=case.strict, scratch=case.scratch, allow_nonfinite=case.allow_nonfinite)
    decision = decide(p, case.event, case.history or History(), case.catalogue, now=NOW, rng_seed=3)
    assert (decision.action, decision.target_id, decision.fallback) == (
        case.action,
        case.target,
        case.fallback,
    ), decision.reason
    for words in case.reason_has:
        assert words in decision.reason


def test_the_issue_case_under_the_palm_spike_preset_rolls_back_to_step_200():
    """A NaN at step 231 of examples/charlm.py with one healthy checkpoint at step 200 (issue 30)."""
    event = Event(type="non_finite", reason="loss is nan", metric="loss", onset_step=231, step=231)
    decision = decide(PALM, event, History(), [ck(200, 2.1)], now=NOW, rng_seed=1)
    assert (decision.action, decision.target_id, decision.target_step) == ("rollback", "ckpt-000200", 200)
    assert decision.fallback and (decision.skip_batches, decision.lr_scale) == (300, 0.5)
    assert decision.reason == (
        "rules[0] (non_finite, spike, divergence, threshold -> rollback): non_finite on loss at step 231; no "
        "checkpoint matches best_before(val_loss, min, lookback_steps=100) among 1 valid checkpoint(s) at or "
        "before step 229 (onset 231); falling back to the newest healthy checkpoint before the onset "
        "(target.strict: false): roll back to ckpt-000200 (step 200, val_loss=2.1); skip 300 batches, lr x0.5, "
        f"relaunch in {decision.delay_seconds:.1f} s; budgets left: 4 of 5 rollbacks, 19 of 20 restarts"
    )


def test_strict_keeps_todays_message():
    decision = decide(policy(strict=True), nan(231), History(), [ck(200, 2.1)], now=NOW)
    assert decision.reason == (
        "rules[0] (non_finite, spike -> rollback): non_finite on loss at step 231; no checkpoint matches "
        "best_before(val_loss, min, lookback_steps=100) among 1 valid checkpoint(s) at or before step 229 "
        "(onset 231), and allow_scratch is false, so the run fails"
    )


def test_the_fallback_flag_is_recorded_and_read_back():
    fell_back = decide(policy(), nan(231), History(), [ck(200, 2.1)], now=NOW)
    matched = decide(policy(), nan(420), History(), [ck(200, 2.1)], now=NOW)
    assert fell_back.to_dict()["fallback"] is True
    assert (
        "fallback" not in matched.to_dict()
    )  # older records, without the key, read and write back unchanged
    for decision in (fell_back, matched):
        assert Decision.from_dict(json.loads(json.dumps(decision.to_dict()))) == decision
    history = History()
    history.record(fell_back.event, fell_back, NOW)
    restored = History.from_dict(json.loads(json.dumps(history.to_dict())))
    assert next(iter(restored)).decision.fallback


EXPLAIN_CASES = [
    # (strict, scratch, words in the rollback rule's line)
    (
        False,
        False,
        "If none matches, fall back to the newest healthy checkpoint saved before the anomaly's onset instead "
        "(the decision says fallback: true); if there is none at all, the run fails.",
    ),
    (
        False,
        True,
        "saved before the anomaly's onset instead (the decision says fallback: true); if there is none at all, "
        "restart from scratch.",
    ),
    (True, False, "If none matches, the run fails (target.strict: true, no fallback)."),
    (True, True, "If none matches, restart from scratch (target.strict: true, no fallback)."),
]


@pytest.mark.parametrize(("strict", "scratch", "words"), EXPLAIN_CASES)
def test_policy_explain_describes_the_fallback(strict, scratch, words):
    text = summarize(policy(strict=strict, scratch=scratch))
    (line,) = [
        line for line in text.splitlines() if line.strip().startswith("non_finite") and "rules[" in line
    ]
    assert line.endswith(words), line
    (resume,) = [line for line in text.splitlines() if line.strip().startswith("preemption")]
    if not strict:
        assert "fall back to the newest healthy checkpoint instead" in resume  # no onset for a resume


def test_a_latest_target_has_nothing_to_fall_back_to():
    text = summarize(load_preset("conservative"))
    (line,) = [
        line for line in text.splitlines() if line.strip().startswith("non_finite") and "rules[" in line
    ]
    assert "fall back" not in line and line.endswith("If there is none, the run fails.")
