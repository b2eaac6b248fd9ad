"""The straggler detector (issue 28, item 2): pure, table-driven; its policy spec; and the per-step agreement that
carries every rank's step time and host to it (two simulated ranks, the clock injected)."""

from __future__ import annotations

import threading

import pytest

from policies import parse_policy
from policies.monitor_schema import StragglerSpec
from supervisor.errors import PolicyError
from supervisor.monitor import DetectorSet, build_detectors
from supervisor.monitor.detectors import (
    OTHERS_STEP_S,
    SLOWEST_RANK,
    SLOWEST_STEP_S,
    Point,
    StragglerDetector,
    rank_step_metrics,
)
from supervisor.runtime.agreement import HOST_BYTES, Agreement, StepView
from supervisor.runtime.cadence import Cadence
from supervisor.runtime.decider import StepDecider


def points(step: int, times: list[float]) -> list[Point]:
    return [Point(key, step, value, float(step)) for key, value in rank_step_metrics(times).items()]


def feed(detector: StragglerDetector, steps: list[list[float]], first: int = 1) -> list[tuple[int, int, int]]:
    """(step, onset, rank) of each event the detector raises over these per-rank step times."""
    fired = []
    for i, times in enumerate(steps):
        for point in points(first + i, times):
            if (event := detector.observe(point)) is not None:
                fired.append((event.step, event.onset_step, event.evidence["rank"]))
    return fired


FAST = [0.1, 0.1, 0.1, 0.1]
SLOW2 = [0.1, 0.1, 0.35, 0.1]  # rank 2 at 3.5 x the median
SLOW3 = [0.1, 0.1, 0.1, 0.35]

CASES = [
    # (per-step times, factor, patience, min_gap, expected (step, onset, rank) events)
    ("steady ranks", [FAST] * 6, 2.0, 3, 0.0, []),
    ("one slow step", [FAST, SLOW2, FAST, FAST], 2.0, 2, 0.0, []),
    ("slow for patience steps", [FAST, SLOW2, SLOW2, SLOW2], 2.0, 3, 0.0, [(4, 2, 2)]),
    ("fires once while it stays slow", [SLOW2] * 6, 2.0, 2, 0.0, [(2, 1, 2)]),
    ("re-arms after it keeps up", [SLOW2, SLOW2, FAST, SLOW2, SLOW2], 2.0, 2, 0.0, [(2, 1, 2), (5, 4, 2)]),
    ("another rank starts its own streak", [SLOW2, SLOW3, SLOW3], 2.0, 2, 0.0, [(3, 2, 3)]),
    ("below the factor", [SLOW2] * 4, 4.0, 2, 0.0, []),
    ("below the gap", [SLOW2] * 4, 2.0, 2, 0.3, []),
    ("tiny steps jitter", [[0.001, 0.001, 0.004, 0.001]] * 4, 2.0, 2, 0.05, []),
    ("two ranks", [[0.1, 0.5]] * 3, 2.0, 3, 0.0, [(3, 1, 1)]),
]


@pytest.mark.parametrize(
    ("steps", "factor", "patience", "gap", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_straggler_detector(steps, factor, patience, gap, expected):
    detector = StragglerDetector(factor=factor, patience=patience, min_gap_seconds=gap)
    assert feed(detector, steps) == expected


def test_the_event_says_which_rank_how_slow_against_what():
    detector = StragglerDetector(factor=2.0, patience=2, min_gap_seconds=0.0)
    events = [e for p in points(7, SLOW2) + points(8, SLOW2) if (e := detector.observe(p)) is not None]
    (event,) = events
    assert (event.type, event.metric, event.onset_step, event.step, event.value) == (
        "straggler",
        SLOWEST_STEP_S,
        7,
        8,
        0.35,
    )
    assert event.evidence == {
        "rank": 2,
        "step_s": 0.35,
        "median_s": 0.1,
        "ratio": pytest.approx(3.5),
        "factor": 2.0,
        "streak": 2,
    }
    assert (
        event.reason
        == "rank 2 took 0.35 s per step, 3.5 x the other ranks' median (0.1 s), for 2 steps (factor 2)"
    )


def test_a_step_missing_one_of_its_metrics_is_not_judged_and_order_does_not_matter():
    detector = StragglerDetector(factor=2.0, patience=1, min_gap_seconds=0.0)
    assert detector.observe(Point(SLOWEST_STEP_S, 1, 1.0, 0.0)) is None
    assert detector.observe(Point(SLOWEST_RANK, 1, 1.0, 0.0)) is None
    # step 2 begins before step 1 had its median: step 1 is dropped
    assert detector.observe(Point(OTHERS_STEP_S, 2, 0.1, 0.0)) is None
    assert detector.observe(Point(SLOWEST_RANK, 2, 3.0, 0.0)) is None
    event = detector.observe(Point(SLOWEST_STEP_S, 2, 1.0, 0.0))
    assert event is not None and event.evidence["rank"] == 3 and event.onset_step == 2
    assert detector.observe(Point("loss", 3, 1.0, 0.0)) is None


def test_reset_forgets_the_streak():
    detector = StragglerDetector(factor=2.0, patience=2, min_gap_seconds=0.0)
    assert feed(detector, [SLOW2]) == []
    detector.reset()
    assert feed(detector, [SLOW2], first=2) == []
    assert feed(detector, [SLOW2], first=3) == [(3, 2, 2)]


def test_rank_step_metrics_name_the_slowest_and_the_others_median():
    assert rank_step_metrics([0.2, 0.9, 0.4, 0.1]) == {
        SLOWEST_STEP_S: 0.9,
        OTHERS_STEP_S: 0.2,
        SLOWEST_RANK: 1.0,
    }
    assert rank_step_metrics([0.3]) == {}


# -- the policy spec ------------------------------------------------------------------------------


def policy_with(detector: str) -> str:
    return f"version: 1\nname: p\nmonitor:\n  detectors:\n    - {detector}\nrules:\n  - when: [straggler]\n    action: resume\n"


def test_the_spec_builds_the_detector_with_its_settings_and_a_rule_may_name_the_event():
    policy = parse_policy(policy_with("{type: straggler, factor: 1.5, patience: 10, min_gap_seconds: 0.2}"))
    (spec,) = policy.monitor.detectors
    assert isinstance(spec, StragglerSpec)
    (detector,) = build_detectors([spec])
    assert isinstance(detector, StragglerDetector)
    assert (detector.factor, detector.patience, detector.min_gap_seconds) == (1.5, 10, 0.2)
    assert policy.rule_for("straggler")[1].action == "resume"
    (default,) = build_detectors([{"type": "straggler"}])
    assert (default.factor, default.patience, default.min_gap_seconds) == (2.0, 5, 0.05)


@pytest.mark.parametrize(
    ("detector", "message"),
    [
        ("{type: straggler, factor: 1}", "factor: expected a number > 1, got 1"),
        ("{type: straggler, factor: slow}", "factor: expected a number"),
        ("{type: straggler, patience: 0}", "patience: expected an integer >= 1, got 0"),
        ("{type: straggler, min_gap_seconds: -1}", "min_gap_seconds: expected a number >= 0, got -1"),
        ("{type: straggler, ranks: 4}", 'ranks: expected a known key, got unknown key "ranks"'),
    ],
)
def test_bad_spec_values_name_the_key_what_was_expected_and_what_was_found(detector, message):
    with pytest.raises(PolicyError) as caught:
        parse_policy(policy_with(detector))
    assert message in str(caught.value)
    assert "monitor.detectors[0]" in str(caught.value)


# -- the agreement carries each rank's step time and host -----------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TwoRanks:
    """all_reduce(MAX) between two threads, as `Distributed.agree` does between two processes."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2)
        self._flags: dict[int, tuple[int, ...]] = {}

    def reduce_for(self, rank: int):
        def reduce(*flags: int) -> tuple[int, ...]:
            self._flags[rank] = flags
            self._barrier.wait()
            merged = tuple(max(v) for v in zip(*self._flags.values(), strict=True))
            self._barrier.wait()
            return merged

        return reduce


def run_ranks(work: list[list[float]], hosts: tuple[str, str]) -> tuple[list[Agreement], list]:
    """Each rank works `work[rank][i]` seconds (on its own clock) before its i-th agreement; its clock stands
    still while it waits inside the collective, which is not its step time."""
    ranks = TwoRanks()
    clocks = [Clock(), Clock()]
    agreements = [
        Agreement(ranks.reduce_for(r), rank=r, world_size=2, host=hosts[r], clock=clocks[r]) for r in (0, 1)
    ]
    seen: list[list] = [[], []]

    def rank(r: int) -> None:
        for seconds in work[r]:
            clocks[r].now += seconds
            agreements[r].agree(StepView())
            seen[r].append(agreements[r].ranks)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen[0] == seen[1]
    return agreements, seen[0]


def test_every_rank_learns_every_ranks_step_time_and_host():
    long_host = "node-" + "x" * 100
    _, seen = run_ranks([[0.5, 0.1, 0.1], [0.5, 0.25, 0.4]], ("alpha", long_host))
    assert seen[0] is None  # the first agreement has no previous one to count from
    assert [r.step_s for r in seen[1:]] == [(0.1, 0.25), (0.1, 0.4)]
    assert seen[1].hosts == ("alpha", long_host[:HOST_BYTES])


def test_without_a_world_size_the_agreement_sends_the_flags_alone():
    sent = []

    def reduce(*flags: int) -> tuple[int, ...]:
        sent.append(flags)
        return flags

    agreement = Agreement(reduce)
    agreement.agree(StepView(save_due=True))
    agreement.agree(StepView())
    assert sent == [(0, 0, 1, 0), (0, 0, 0, 0)] and agreement.ranks is None


def test_rank_0_feeds_the_step_times_to_its_detectors_and_names_the_host():
    ranks = TwoRanks()
    clocks = [Clock(), Clock()]
    deciders = [
        StepDecider(
            Cadence(every_steps=100),
            DetectorSet(
                build_detectors([{"type": "straggler", "factor": 2, "patience": 2}]), source="in_process"
            ),
            Agreement(ranks.reduce_for(r), rank=r, world_size=2, host=f"host{r}", clock=clocks[r]),
            observes=r == 0,
            clock=clocks[r],
            wall=clocks[r],
        )
        for r in (0, 1)
    ]
    work = [[0.1] * 5, [0.1, 0.6, 0.6, 0.6, 0.6]]
    events: list[list] = [[], []]
    logged: list[list] = [[], []]

    def rank(r: int) -> None:
        decider = deciders[r]
        for step, seconds in enumerate(work[r], start=1):
            clocks[r].now += seconds
            events[r] += decider.anomalies(step, {"loss": 1.0})
            decider.agree([], None, due=False, writing=False, step=step)
            logged[r].append(decider.rank_metrics)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert events[1] == []  # only rank 0 observes
    (event,) = events[0]
    assert event.type == "straggler" and event.source == "in_process"
    assert (event.onset_step, event.step) == (
        2,
        3,
    )  # seen at step 4, from the times step 3's agreement carried
    assert event.evidence["rank"] == 1 and event.evidence["host"] == "host1"
    assert logged[0][0] is None and logged[0][1] == (
        2,
        {SLOWEST_STEP_S: pytest.approx(0.6), OTHERS_STEP_S: pytest.approx(0.1), SLOWEST_RANK: 1.0},
    )
