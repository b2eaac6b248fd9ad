"""Detectors on synthetic streams: exact onsets for true positives, silence on noisy healthy curves."""

from __future__ import annotations

import math
import random

import pytest

from supervisor.monitor import (
    DetectorSet,
    DetectorSpecError,
    DivergenceDetector,
    HangDetector,
    Point,
    SpikeDetector,
    build_detectors,
)

NAN, INF = float("nan"), float("inf")


def curve(n: int, seed: int, *, noise: float = 0.02, start: int = 0) -> list[float]:
    """A healthy loss curve: exponential decay to 1.0 with multiplicative Gaussian noise."""
    rng = random.Random(seed)
    return [(1.0 + 3.0 * math.exp(-(start + i) / 300)) * (1 + rng.gauss(0, noise)) for i in range(n)]


def points(metric: str, values: list[float], *, start: int = 0, every: int = 1) -> list[Point]:
    return [Point(metric, start + i * every, v, float(start + i * every)) for i, v in enumerate(values)]


def with_values(values: list[float], edits: dict[int, float | str]) -> list[float]:
    out = list(values)
    for step, edit in edits.items():
        out[step] = out[step] * float(edit[1:]) if isinstance(edit, str) else edit
    return out


def flat(n: int, level: float, seed: int, noise: float = 0.02) -> list[float]:
    rng = random.Random(seed)
    return [level * (1 + rng.gauss(0, noise)) for _ in range(n)]


def run(specs: list[dict], stream: list[Point]) -> list[tuple]:
    detectors = DetectorSet(build_detectors(specs))
    return [(e.type, e.metric, e.onset_step) for e in detectors.observe_many(stream)]


SPIKE = {
    "type": "spike",
    "metric": "loss",
    "window": 128,
    "sigmas": 6.0,
    "warmup_steps": 200,
    "min_history": 32,
}
DIVERGENCE = {"type": "divergence", "metric": "loss", "window": 200, "factor": 1.5, "patience": 50}
NON_FINITE = {"type": "non_finite", "metrics": ["loss", "grad_norm"]}
THRESHOLD = {"type": "threshold", "metric": "grad_norm", "above": 100.0, "below": None}
PLATEAU = {"type": "plateau", "metric": "val_loss", "mode": "min", "patience": 10, "min_delta": 0.001}
improving_then_flat = [2.0 - 0.1 * i for i in range(11)] + [1.0 + 0.0004 * ((-1) ** i) for i in range(12)]
jump = flat(600, 1.0, 7) + flat(300, 2.0, 8)
excursion = flat(600, 1.0, 9) + flat(40, 3.0, 10) + flat(300, 1.0, 11)  # a burst, not a trend

CASES = [
    # name, specs, stream, expected (type, metric, onset_step)
    (
        "nan_once",
        [NON_FINITE],
        points("loss", with_values(curve(400, 1), {300: NAN, 301: NAN})),
        [("non_finite", "loss", 300)],
    ),
    (
        "nan_then_inf_rearms",
        [NON_FINITE],
        points("grad_norm", with_values(curve(500, 2), {300: NAN, 450: -INF})),
        [("non_finite", "grad_norm", 300), ("non_finite", "grad_norm", 450)],
    ),
    ("nan_other_metric_ignored", [NON_FINITE], points("lr", with_values(curve(50, 3), {10: NAN})), []),
    (
        "spike_x50",
        [SPIKE],
        points("loss", with_values(curve(800, 4), {500: "x50"})),
        [("spike", "loss", 500)],
    ),
    (
        "spike_two_points_one_event",
        [SPIKE],
        points("loss", with_values(curve(800, 5), {500: "x50", 501: "x40"})),
        [("spike", "loss", 500)],
    ),
    ("spike_in_warmup_ignored", [SPIKE], points("loss", with_values(curve(400, 6), {150: "x50"})), []),
    (
        "spike_after_first_spike",
        [SPIKE],
        points("loss", with_values(curve(900, 12), {500: "x50", 700: "x3"})),
        [("spike", "loss", 500), ("spike", "loss", 700)],
    ),
    ("spike_nan_is_not_a_spike", [SPIKE], points("loss", with_values(curve(600, 13), {500: NAN})), []),
    ("divergence_jump", [DIVERGENCE], points("loss", jump), [("divergence", "loss", 600)]),
    (
        "divergence_single_outlier",
        [DIVERGENCE],
        points("loss", with_values(flat(900, 1.0, 14), {600: "x50"})),
        [],
    ),
    ("divergence_transient_excursion", [DIVERGENCE], points("loss", excursion), []),
    (
        "threshold_above_twice",
        [THRESHOLD],
        points("grad_norm", [5.0] * 10 + [150.0] * 5 + [5.0] * 10 + [101.0] + [5.0]),
        [("threshold", "grad_norm", 10), ("threshold", "grad_norm", 25)],
    ),
    (
        "threshold_below",
        [{"type": "threshold", "metric": "lr", "below": 1e-6}],
        points("lr", [1e-4] * 5 + [0.0] * 3),
        [("threshold", "lr", 5)],
    ),
    (
        "plateau_min",
        [PLATEAU],
        points("val_loss", improving_then_flat, every=50),
        [("plateau", "val_loss", 550)],
    ),
    (
        "plateau_max",
        [{"type": "plateau", "metric": "acc", "mode": "max", "patience": 3, "min_delta": 0.0}],
        points("acc", [0.1, 0.2, 0.3, 0.3, 0.29, 0.3, 0.31]),
        [("plateau", "acc", 3)],
    ),
    (
        "plateau_improving_never",
        [PLATEAU],
        points("val_loss", [2.0 - 0.01 * i for i in range(40)], every=50),
        [],
    ),
]


@pytest.mark.parametrize(("name", "specs", "stream", "expected"), CASES, ids=[c[0] for c in CASES])
def test_detector_table(name, specs, stream, expected):
    assert run(specs, stream) == expected


def test_events_carry_evidence_and_reason():
    stream = points("loss", with_values(curve(800, 4), {500: "x50"}))
    (event,) = DetectorSet(build_detectors([SPIKE])).observe_many(stream)
    assert event.step == 500 and event.value == stream[500].value and event.wall_time == 500.0
    assert event.source == "monitor"
    assert {"median", "sigma", "score", "window"} <= set(event.evidence)
    assert event.evidence["window"] == 128 and event.evidence["score"] > 6
    assert "sigma" in event.reason and "\n" not in event.reason


def test_divergence_is_noticed_after_patience_but_dated_at_onset():
    detector = DivergenceDetector("loss", window=200, factor=1.5, patience=50)
    fired = [(p.step, e) for p in points("loss", jump) if (e := detector.observe(p))]
    ((noticed, event),) = fired
    assert event.onset_step == 600 and noticed == event.step > 650
    assert event.evidence["best_mean"] == pytest.approx(1.0, abs=0.01)


def test_spike_outliers_do_not_enter_the_window():
    # A five-point plateau in an eight-point window would move the median onto itself if it entered.
    detector = SpikeDetector("loss", window=8, sigmas=6.0, warmup_steps=0, min_history=8)
    values = [1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0, 1.01] * 2 + [5.0] * 5 + [1.0, 5.0]
    onsets = [e.onset_step for p in points("loss", values) if (e := detector.observe(p))]
    assert onsets == [16, 22]


def test_spike_needs_min_history():
    detector = SpikeDetector("loss", window=128, sigmas=6.0, warmup_steps=0, min_history=32)
    assert [detector.observe(p) for p in points("loss", [1.0] * 20 + [50.0])][-1] is None


@pytest.mark.parametrize("seed", range(6))
def test_noisy_healthy_curves_raise_nothing(seed):
    rng = random.Random(100 + seed)
    specs = [
        NON_FINITE,
        SPIKE,
        {**SPIKE, "metric": "grad_norm"},
        DIVERGENCE,
        THRESHOLD,
        {"type": "threshold", "metric": "lr", "above": 1e-3},
    ]
    stream = []
    for step, loss in enumerate(curve(2000, seed, noise=0.03)):
        warm = min(1.0, step / 100)
        stream += [
            Point("loss", step, loss, step),
            Point(
                "grad_norm", step, 2.0 * math.exp(rng.gauss(0, 0.15)) * (1 + 3 * math.exp(-step / 200)), step
            ),
            Point("lr", step, 3e-4 * warm * 0.5 * (1 + math.cos(math.pi * step / 2000)), step),
        ]
    assert run(specs, stream) == []


def test_hang_uses_the_callers_clock_and_phase_grace():
    hang = HangDetector(600)
    assert hang.check(0.0) is None  # arms
    hang.observe(Point("loss", 7, 1.0, 0.0))
    assert hang.check(100.0) is None  # the point counts as progress at t=100
    assert hang.check(700.0) is None
    event = hang.check(700.5)
    assert event.type == "hang" and event.onset_step == 7 and event.value == pytest.approx(600.5)
    assert hang.check(900.0) is None  # one event per stall
    hang.progress(1000.0, step=8, phase="checkpoint")
    assert hang.check(2700.0) is None  # a checkpoint may take 3 x 600 s
    assert hang.check(2800.5).evidence == {
        "silent_seconds": 1800.5,
        "timeout_seconds": 1800,
        "phase": "checkpoint",
    }
    hang.progress(3000.0, step=9, phase="train")
    assert hang.check(3601.0).onset_step == 9


def test_hang_explicit_phase_grace():
    hang = HangDetector(10, phase_grace_seconds=25)
    hang.progress(0.0, phase="eval")
    assert hang.check(25.0) is None and hang.check(25.1).type == "hang"


def test_detector_set_dedupes_duplicate_specs_and_resets_per_segment():
    detectors = DetectorSet(build_detectors([NON_FINITE, NON_FINITE]))
    assert len(detectors.observe(Point("loss", 5, NAN, 0.0))) == 1
    assert detectors.observe(Point("loss", 3, NAN, 1.0, segment=0)) == []  # latched
    again = detectors.observe(Point("loss", 5, NAN, 2.0, segment=1))
    assert [(e.type, e.onset_step) for e in again] == [("non_finite", 5)]
    assert detectors.observe(Point("loss", 9, NAN, 3.0, segment=0)) == []  # abandoned branch


def test_reset_segment_warms_up_on_history_without_reporting():
    detectors = DetectorSet(build_detectors([{**SPIKE, "warmup_steps": 0}]))
    history = points("loss", with_values(curve(300, 20), {100: "x50"}))
    detectors.reset_segment(1, history)
    event = detectors.observe(Point("loss", 300, 50.0, 300.0, segment=1))
    assert [(e.type, e.onset_step) for e in event] == [("spike", 300)]


# A mapping is checked by the policy schema itself (policies/monitor_schema.py), so the words match a policy file's.
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "spiky", "metric": "loss"}, "detectors[0].type: expected one of non_finite"),
        ({"type": "spike", "metric": "loss", "sigma": 6}, 'got unknown key "sigma" (did you mean "sigmas"?)'),
        (
            {"type": "spike", "metric": "loss", "window": 0},
            "detectors[0].window: expected an integer >= 2, got 0",
        ),
        (
            {"type": "spike", "metric": "loss", "window": 8, "min_history": 9},
            "min_history: expected an integer <= window (8), got 9",
        ),
        ({"type": "spike", "metric": "loss", "sigmas": "six"}, 'sigmas: expected a number > 0, got "six"'),
        ({"type": "divergence", "metric": "loss", "factor": 1.0}, "factor: expected a number > 1"),
        ({"type": "threshold", "metric": "x"}, "expected at least one of above or below, got neither"),
        (
            {"type": "threshold", "metric": "x", "above": "high"},
            'detectors[0].above: expected a number or null, got "high"',
        ),
        (
            {"type": "threshold", "metric": "x", "above": 1, "below": 2},
            "below: expected a number < above (1)",
        ),
        ({"type": "plateau", "metric": "x", "mode": "up"}, 'mode: expected one of min, max, got "up"'),
        ({"type": "non_finite", "metrics": []}, "metrics: expected a non-empty list"),
        ({"type": "hang", "seconds": -1}, "seconds: expected a number > 0"),
        ({"type": "threshold", "above": 1}, "metric: expected a non-empty string, got nothing"),
        ("spike", "expected a mapping"),
    ],
)
def test_bad_specs_are_rejected_with_the_key(spec, message):
    with pytest.raises(DetectorSpecError) as info:
        build_detectors([spec])
    assert message in str(info.value)


def test_specs_accept_pydantic_models_and_nulls():
    class Model:
        def model_dump(self):
            return {"type": "threshold", "metric": "grad_norm", "above": 100.0, "below": None}

    (detector,) = build_detectors([Model()])
    assert detector.above == 100.0 and detector.below is None
