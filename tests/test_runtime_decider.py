"""The step decider without a store or a clock: heartbeat pacing, the detectors (on every rank, named by rank
under DDP, reset on a restore), the save decision with the write in flight, what a rank sends to the agreement,
and the cadence's save cost, which only the decider writes."""

from __future__ import annotations

import pytest

from supervisor.monitor import DetectorSet, build_detectors
from supervisor.runtime.agreement import Agreement, StepView
from supervisor.runtime.cadence import Cadence
from supervisor.runtime.decider import BEAT_EVERY_S, StepDecider
from supervisor.runtime.save_policy import EverySteps, NotWhileWriting, build_save_policy
from supervisor.runtime.stops import StopMode, request_for

NAN = [{"type": "non_finite", "metrics": ["loss"]}]


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _decider(cadence: Cadence | None = None, **kw) -> tuple[StepDecider, Clock]:
    clock = Clock()
    detectors = DetectorSet(build_detectors(NAN), source="in_process")
    decider = StepDecider(cadence or Cadence(every_steps=2), detectors, clock=clock, wall=lambda: 0.0, **kw)
    return decider, clock


def test_the_heartbeat_is_paced_by_the_clock():
    decider, clock = _decider()
    beats = []
    for now in [100.0, 100.2, 100.0 + BEAT_EVERY_S, 100.6, 101.2]:
        clock.now = now
        beats.append(decider.tick())
    assert beats == [(100.0, True), (100.2, False), (100.5, True), (100.6, False), (101.2, True)]


def test_every_rank_sees_its_own_anomalies_named_by_rank_and_a_restore_starts_a_new_segment():
    decider, _ = _decider()
    rank1, _ = _decider(observes=False, agreement=Agreement(lambda *f: f, rank=1, world_size=2))
    (nan_on_rank_1,) = rank1.anomalies(3, {"loss": float("nan")})  # a NaN on any rank is an anomaly
    assert nan_on_rank_1.evidence["rank"] == 1
    (event,) = decider.anomalies(3, {"loss": float("nan")})
    assert "rank" not in event.evidence  # alone: no rank to name
    assert event.step == 3 and event.source == "in_process"
    assert decider.anomalies(4, {"loss": float("nan")}) == []  # the same incident, seen once
    decider.restarted(2)
    (again,) = decider.anomalies(3, {"loss": float("nan")})  # a new segment: seen again
    assert again.step == 3


@pytest.mark.parametrize(
    ("policy", "writing", "due"),
    [
        (EverySteps(2), True, True),  # a fixed cadence keeps its multiples and waits for the write
        (EverySteps(2) & NotWhileWriting(), True, False),
        (EverySteps(2) & NotWhileWriting(), False, True),
        (build_save_policy(2, None, True), True, False),  # the adaptive rule defers by itself
    ],
)
def test_the_write_in_flight_reaches_the_policy_whatever_it_is(policy, writing, due):
    decider, _ = _decider(Cadence(every_steps=2, policy=policy))
    decider.restarted(0)
    assert decider.save_due(4, 100.0, writing=writing, stopping=False, final=False) is due


@pytest.mark.parametrize(
    ("policy", "writing", "sent"),
    [
        (EverySteps(2), True, StepView(False, StopMode.CHECKPOINT, True, False)),
        (EverySteps(2) & NotWhileWriting(), True, StepView(False, StopMode.CHECKPOINT, True, True)),
        (EverySteps(2) & NotWhileWriting(), False, StepView(False, StopMode.CHECKPOINT, True, False)),
    ],
)
def test_under_ddp_a_rank_sends_its_policys_deferral_not_its_raw_write(policy, writing, sent):
    seen = []

    def reduce(*flags: int) -> tuple[int, ...]:
        seen.append(StepView.from_flags(*flags))
        return flags

    decider, _ = _decider(Cadence(every_steps=2, policy=policy), agreement=Agreement(reduce))
    agreed = decider.agree([], request_for(StopMode.CHECKPOINT, "x"), due=True, writing=writing)
    assert seen == [sent] and agreed == sent and decider.may_stop


def test_alone_a_stop_is_carried_out_at_once_and_agree_is_for_ddp_only():
    decider, _ = _decider()
    assert decider.may_stop
    with pytest.raises(RuntimeError, match="DDP"):
        decider.agree([], None, due=False, writing=False)


def test_a_save_is_recorded_in_the_cadence_by_the_decider():
    decider, _ = _decider(Cadence(every_steps=10))
    decider.restarted(0)
    decider.saved(10, 0.5, 101.0)
    ctx = decider.cadence.context(11, 102.0)
    assert (ctx.save_cost_s, ctx.last_save_step, ctx.last_save_time) == (0.5, 10, 101.0)
