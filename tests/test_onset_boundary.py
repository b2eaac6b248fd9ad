"""Which checkpoints a rollback may pick around the anomaly's onset (issue 14), table-driven.

Checkpoint step s is the state after s optimizer updates. The metrics logged at step s are computed before step
s's update, from checkpoint s - 1's state. So an anomaly whose onset is step o was produced by checkpoint o - 1:
a rollback picks at most step o - 2. The old rule ("step < onset") admitted o - 1, the poisoned state of a NaN
injected at step o - 1 (tests/test_unhealthy_e2e.py runs that case for real).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from policies import CheckpointRecord, History, decide, parse_policy
from policies.selectors import last_clean_step
from supervisor.events import Event

POLICY = parse_policy(
    """
version: 1
name: onset
checkpoint: {every_steps: 1}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
  - when: [spike]
    action: rollback
    target: {select: before, lookback_steps: 0}
  - when: [divergence]
    action: rollback
    target: {select: best_before, metric: loss, lookback_steps: 1}
  - when: [threshold]
    action: rollback
    target: {select: best, metric: loss}
  - when: [plateau]
    action: rollback
    target: {select: before, lookback_steps: 3}
  - when: [preemption]
    action: resume
    target: {select: latest}
limits: {escalation: null}
"""
)
#: One checkpoint a step around the boundary; the lower the loss, the "better" for best selectors.
LOSS = {96: 3.0, 97: 2.0, 98: 2.5, 99: 1.0, 100: 0.5, 101: 0.1}
CATALOGUE = [CheckpointRecord(f"c{s}", s, {"loss": loss}) for s, loss in LOSS.items()]


@dataclass(frozen=True)
class Case:
    name: str
    type: str
    step: int | None
    onset: int | None
    target: int | None  # the step picked; None: no candidate, the run fails
    catalogue: tuple[int, ...] = tuple(LOSS)


CASES = [
    Case("latest: onset - 1 produced the bad metric", "non_finite", 100, 100, 98),
    Case("latest: no onset_step, the step it was seen at", "non_finite", 100, None, 98),
    Case("latest: a spike seen later than its onset", "non_finite", 101, 99, 97),
    Case("latest: only onset - 1 and later exist", "non_finite", 100, 100, None, (99, 100, 101)),
    Case("latest: onset - 2 is the newest clean state", "non_finite", 100, 100, 98, (98, 99)),
    Case("before(0)", "spike", 100, 100, 98),
    Case("best_before(lookback 1): the best of <= onset - 2", "divergence", 100, 100, 97),
    Case("best: never the best-looking poisoned one", "threshold", 100, 100, 97),
    Case("before(3): the lookback counts from the onset", "plateau", 100, 100, 97),
    Case("before(3) when onset - 2 is tighter", "plateau", 99, 99, 96),
    Case("resume: no onset filter", "preemption", 100, 100, 101),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_rollback_candidates_stop_two_steps_before_the_onset(case: Case):
    event = Event(type=case.type, reason="t", metric="loss", onset_step=case.onset, step=case.step)
    catalogue = [c for c in CATALOGUE if c.step in case.catalogue]
    decision = decide(POLICY, event, History(), catalogue, now=1000.0, rng_seed=0)
    if case.target is None:
        assert decision.action == "fail", decision.reason
        assert "at or before step 98 (onset 100)" in decision.reason
        return
    assert decision.action in ("rollback", "resume"), decision.reason
    assert decision.target_step == case.target, decision.reason


@pytest.mark.parametrize(("onset", "clean"), [(1, -1), (2, 0), (100, 98)])
def test_last_clean_step(onset: int, clean: int):
    assert last_clean_step(onset) == clean
