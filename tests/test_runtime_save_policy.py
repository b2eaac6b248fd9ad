"""The save decision: each strategy over an explicit context, their combinations, and the policy a
`checkpoint:` section builds. No clock: every case states its time."""

from __future__ import annotations

import math

import pytest

from supervisor.runtime.cadence import Cadence
from supervisor.runtime.save_policy import (
    Adaptive,
    AllOf,
    AnyOf,
    EverySeconds,
    EverySteps,
    Never,
    NotWhenStopping,
    NotWhileWriting,
    SaveContext,
    StepsSinceSave,
    build_save_policy,
)


def ctx(step: int, now: float = 0.0, **kw) -> SaveContext:
    return SaveContext(step=step, now=now, **kw)


@pytest.mark.parametrize(
    ("policy", "context", "save"),
    [
        (EverySteps(10), ctx(20, last_save_step=19), True),  # aligned: 20 is a multiple, whatever was saved
        (EverySteps(10), ctx(25, last_save_step=15), False),
        (StepsSinceSave(10), ctx(25, last_save_step=15), True),  # counted from the last save
        (StepsSinceSave(10), ctx(24, last_save_step=15), False),
        (EverySeconds(5.0), ctx(3, now=104.9, last_save_time=100.0), False),
        (EverySeconds(5.0), ctx(3, now=105.0, last_save_time=100.0), True),
        (
            EverySeconds(5.0),
            ctx(3, now=1e9, last_save_time=None),
            False,
        ),  # not started: nothing to count from
        (Never(), ctx(100), False),
        (NotWhileWriting(), ctx(1, writing=True), False),
        (NotWhileWriting(), ctx(1), True),
        (NotWhenStopping(), ctx(1, stopping=True), False),
        (NotWhenStopping(), ctx(1, final=True), False),
        (NotWhenStopping(), ctx(1), True),
    ],
)
def test_each_strategy_decides_from_the_context_alone(policy, context, save):
    assert policy.should_save(context) is save


def test_combinators_read_as_any_and_all():
    by_steps_or_time = EverySteps(10) | EverySeconds(5.0)
    assert isinstance(by_steps_or_time, AnyOf)
    assert by_steps_or_time.should_save(ctx(10, now=0.0, last_save_time=0.0))
    assert by_steps_or_time.should_save(ctx(3, now=6.0, last_save_time=0.0))
    assert not by_steps_or_time.should_save(ctx(3, now=1.0, last_save_time=0.0))
    guarded = EverySteps(10) & NotWhileWriting()
    assert isinstance(guarded, AllOf)
    assert guarded.should_save(ctx(10)) and not guarded.should_save(ctx(10, writing=True))


@pytest.mark.parametrize(
    ("context", "interval"),
    [
        (ctx(0), 100),  # no step timed yet: the cap
        (ctx(0, step_time_s=0.5), 1),  # a step timed, no save yet: save now to measure the cost
        # sqrt(2 * 2 s * 3600 s) = 120 s at 0.5 s a step = 240 steps: over the cap.
        (ctx(0, step_time_s=0.5, save_cost_s=2.0, mtbf_s=3600.0), 100),
        (ctx(0, step_time_s=0.25, save_cost_s=0.04, mtbf_s=120.0), round(math.sqrt(2 * 0.04 * 120) / 0.25)),
    ],
)
def test_adaptive_interval_is_young_daly_in_steps_under_the_cap(context, interval):
    assert Adaptive(cap=100).interval_steps(context) == interval


def test_adaptive_without_a_cap_and_nothing_measured_never_saves_by_steps():
    assert Adaptive(cap=None).interval_steps(ctx(0)) is None
    assert not Adaptive(cap=None).should_save(ctx(10_000))
    assert Adaptive(cap=None).interval_steps(ctx(0, step_time_s=0.5, save_cost_s=2.0, mtbf_s=3600.0)) == 240


@pytest.mark.parametrize(
    ("options", "context", "save"),
    [
        # Fixed steps only: aligned multiples.
        ((20, None, False), ctx(40, last_save_step=39), True),
        ((20, None, False), ctx(41, last_save_step=0), False),
        # Steps and seconds: steps count from the last save; whichever comes first.
        ((20, 10.0, False), ctx(41, now=1.0, last_save_step=21, last_save_time=0.0), True),
        ((20, 10.0, False), ctx(40, now=1.0, last_save_step=21, last_save_time=0.0), False),
        ((20, 10.0, False), ctx(22, now=10.0, last_save_step=21, last_save_time=0.0), True),
        ((None, 10.0, False), ctx(1000, now=9.0, last_save_time=0.0), False),
        # Nothing periodic is ever due on the last step or when a stop is pending: those save anyway.
        ((20, None, False), ctx(40, final=True), False),
        ((20, None, False), ctx(40, stopping=True), False),
        # A fixed cadence keeps its schedule while a write is in flight (the save then waits for it) ...
        ((20, None, False), ctx(40, writing=True), True),
        # ... an adaptive one saves right after the write instead of blocking on it.
        ((20, None, True), ctx(40, writing=True), False),
        ((20, None, True), ctx(40), True),
    ],
)
def test_a_checkpoint_section_builds_the_policy_it_describes(options, context, save):
    assert build_save_policy(*options).should_save(context) is save


def test_cadence_builds_the_context_from_what_it_measured():
    cadence = Cadence(every_steps=100, adaptive=True, failures=1, observed_s=3600.0)
    cadence.start(40, 10.0)
    cadence.observe_step(10.5)
    cadence.observe_save(2.0)
    got = cadence.context(41, 11.0, writing=True)
    assert (got.last_save_step, got.last_save_time, got.step_time_s, got.save_cost_s) == (40, 10.0, 0.5, 2.0)
    assert got.mtbf_s == pytest.approx(3601.0) and got.writing and not got.stopping
    cadence.observe_save(1.0)  # smoothed: 0.7 * 2.0 + 0.3 * 1.0
    cadence.saved(41, 11.0)
    again = cadence.context(42, 11.5)
    assert again.save_cost_s == pytest.approx(1.7) and again.last_save_step == 41
    assert cadence.due(141, 11.5)  # the cap, 100 steps after the save at 41
    assert not cadence.due(141, 11.5, writing=True)  # adaptive: never on top of a write in flight


@pytest.mark.parametrize(
    ("policy", "defers"),
    [
        (EverySteps(1), False),
        (EverySteps(1) & NotWhileWriting(), True),
        (EverySteps(1) | NotWhileWriting(), False),  # any-of: the steps alone still save
        (AnyOf((NotWhileWriting(), NotWhileWriting() & EverySteps(2))), True),
        (build_save_policy(10, None, False), False),
        (build_save_policy(10, 5.0, False), False),
        (build_save_policy(10, None, True), True),  # the adaptive rule is the policy's own strategy
        (build_save_policy(None, 5.0, True), True),
    ],
)
def test_whether_a_policy_defers_for_a_write_in_flight_is_read_from_its_strategies(policy, defers):
    assert policy.defers_while_writing is defers


@pytest.mark.parametrize(
    ("policy", "interval"),
    [
        (EverySteps(7), 7),
        (EverySteps(7) | StepsSinceSave(3), 3),  # whichever comes first
        (EverySteps(7) & StepsSinceSave(3), 7),  # both must agree
        (EverySeconds(5.0), None),
        (build_save_policy(10, 5.0, False), 10),
        (build_save_policy(None, 5.0, False), None),
        (build_save_policy(100, None, True), 1),  # a step timed, no save yet: save now to learn the cost
    ],
)
def test_the_step_interval_comes_from_the_policy(policy, interval):
    assert policy.interval_steps(ctx(0, step_time_s=0.5)) == interval


def test_an_injected_policy_decides_alone_and_the_cadence_never_rebuilds_the_adaptive_rule():
    cadence = Cadence(every_steps=100, adaptive=True, policy=EverySteps(4) & NotWhileWriting())
    cadence.start(0, 0.0)
    assert cadence.interval_steps(1.0) == 4 and cadence.defers_while_writing
    assert cadence.due(4, 1.0) and not cadence.due(4, 1.0, writing=True) and not cadence.due(5, 1.0)
