"""`bench goodput`: the pure wall-time accounting, the Poisson arrivals, option errors, and a tiny real run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from benchmarks.goodput_accounting import SegmentSample, account, arrivals
from benchmarks.goodput_train import FIELDS
from supervisor.cli import main

T0, T_END = 1000.0, 1100.0  # a 100 s window


def counter(**kw: float) -> dict[str, float]:
    return {**dict.fromkeys(FIELDS, 0.0), **kw}


NO_PREEMPTION = [
    SegmentSample(
        T0 + 0.5,
        T_END + 3,
        None,
        counter(restored_at=T0 + 10, last_step=90, last_step_at=T_END - 1, steps_run=90, save_s=9.0, saves=9),
    )
]
KILLED = [
    SegmentSample(  # steps 1..40 in 40 s, checkpoint at 30, killed 0.5 s into step 41
        T0 + 0.5,
        T0 + 51,
        T0 + 50.5,
        counter(restored_at=T0 + 10, last_step=40, last_step_at=T0 + 50, steps_run=40, save_s=0.0, saves=3),
    ),
    SegmentSample(  # resumes at 30 at T0+60.5: steps 31..40 are redone
        T0 + 52,
        T_END + 2,
        None,
        counter(
            restored_step=30,
            restored_at=T0 + 60.5,
            last_step=70,
            last_step_at=T_END - 0.5,
            steps_run=40,
            save_s=0.0,
            saves=4,
        ),  # fmt: skip
    ),
]
TERMINATED = [
    SegmentSample(  # SIGTERM: step 40 completes, emergency checkpoint 1 s, exits
        T0 + 0.5,
        T0 + 52,
        T0 + 49.5,
        counter(restored_at=T0 + 10, last_step=40, last_step_at=T0 + 50, steps_run=40, emergency_s=1.0),
    ),
    SegmentSample(
        T0 + 52,
        T_END + 2,
        None,
        counter(restored_step=40, restored_at=T0 + 60, last_step=80, last_step_at=T_END, steps_run=40),
    ),
]
DIED_STARTING = [
    KILLED[0],
    SegmentSample(T0 + 52, T0 + 55, T0 + 55, None),  # killed while importing: no counter yet
    SegmentSample(T0 + 56, T_END + 2, None, {**KILLED[1].counter, "restored_at": T0 + 66.5}),
]


@pytest.mark.parametrize(
    ("segments", "graceful", "useful", "expected"),
    [
        (
            NO_PREEMPTION, False, 90,
            {"executed_steps": 90, "redone_steps": 0, "goodput": 1.0, "restarts": 0, "startup": 0.10,
             "restart": 0.0, "checkpoint": 0.09, "redone": 0.0, "useful": 0.81},
        ),
        (
            KILLED, False, 70,
            {"executed_steps": 80, "redone_steps": 10, "goodput": 70 / 80, "restarts": 1, "startup": 0.10,
             "restart": 0.10, "checkpoint": 0.0, "redone": 0.1025, "useful": 0.6975},
        ),
        (
            TERMINATED, True, 80,
            {"executed_steps": 80, "redone_steps": 0, "goodput": 1.0, "restarts": 1, "startup": 0.10,
             "restart": 0.09, "checkpoint": 0.01, "redone": 0.0, "useful": 0.80},
        ),
        (
            DIED_STARTING, False, 70,
            {"executed_steps": 80, "redone_steps": 10, "goodput": 70 / 80, "restarts": 2, "startup": 0.10,
             "restart": 0.16, "checkpoint": 0.0, "redone": 0.0875, "useful": 0.6525},
        ),
    ],
    ids=["no-preemption", "sigkill", "sigterm", "killed-while-starting"],
)  # fmt: skip
def test_account_splits_steps_and_wall_time(segments, graceful, useful, expected):
    got = account(segments, T0, T_END, graceful=graceful, useful_steps=useful)
    for key in ("executed_steps", "redone_steps", "goodput", "restarts"):
        assert got[key] == pytest.approx(expected[key]), key
    for key in ("startup", "restart", "checkpoint", "redone", "useful"):
        assert got["time_fraction"][key] == pytest.approx(expected[key]), key
    assert got["time_fraction"]["other"] == pytest.approx(0.0, abs=1e-9)
    assert got["unsaved_steps"] == 0


def test_account_counts_steps_past_the_last_checkpoint_as_unsaved():
    got = account(KILLED, T0, T_END, graceful=False, useful_steps=60)
    assert (got["executed_steps"], got["redone_steps"], got["unsaved_steps"]) == (80, 10, 10)
    assert got["goodput"] == pytest.approx(60 / 80)


def test_expected_loss_weights_long_intervals_by_how_often_a_preemption_lands_in_them():
    # Checkpoints 2 s, 2 s and 8 s apart: a preemption at a random moment falls in the 8 s interval two times
    # in three and loses 4 s there on average: (4 + 4 + 64) / (2 * 12) = 3 s, not the mean interval's half (2 s).
    seg = SegmentSample(
        T0, T_END + 1, None,
        counter(restored_at=T0 + 10, last_step=90, last_step_at=T_END - 1, steps_run=90, save_s=2.0, saves=3,
                gap_s=12.0, gap_sq_s=72.0),
    )  # fmt: skip
    got = account([seg], T0, T_END, graceful=False, useful_steps=90, rate_per_min=3.0)
    assert got["expected_loss_per_preemption_s"] == pytest.approx(3.0)
    # checkpoint 2 s of 100 s, plus 3 preemptions a minute losing 3 s each: 0.02 + 0.05 * 3
    assert got["expected_cadence_overhead"] == pytest.approx(0.02 + 0.15)
    # SIGTERM: the emergency checkpoint is the resume point, nothing is lost.
    graceful = account([seg], T0, T_END, graceful=True, useful_steps=90, rate_per_min=3.0)
    assert graceful["expected_cadence_overhead"] == pytest.approx(0.02)
    # No checkpoint taken: no interval to weigh, no figure.
    assert (
        account(NO_PREEMPTION, T0, T_END, graceful=False, useful_steps=90)["expected_cadence_overhead"]
        is None
    )


def test_arrivals_are_a_seeded_poisson_process_inside_the_horizon():
    first = arrivals(3.0, 600.0, random.Random(7))
    assert first == arrivals(3.0, 600.0, random.Random(7))
    assert first == sorted(first) and all(0 < t < 600 for t in first)
    long = arrivals(6.0, 60_000.0, random.Random(1))
    gaps = [b - a for a, b in zip([0.0, *long], long, strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(10.0, rel=0.05)  # mean inter-arrival = 60 / rate
    assert arrivals(0.0, 600.0, random.Random(0)) == []


def _run(
    config: str,
    goodput: float,
    useful: float,
    overhead: float,
    adaptive: bool = False,
    expected: float | None = None,
) -> dict:
    return {"config": config, "signal": "kill", "adaptive": adaptive, "goodput": goodput,
            "time_fraction": {"useful": useful, "checkpoint": overhead / 4, "redone": overhead * 3 / 4},
            "expected_cadence_overhead": expected}  # fmt: skip


def test_summary_compares_adaptive_with_the_best_fixed_interval_by_each_measure():
    from benchmarks.bench_goodput import summarize

    runs = [
        _run("every-10", 0.99, 0.80, 0.04, expected=0.030),
        _run("every-25", 0.97, 0.82, 0.02, expected=0.025),
        _run("every-100", 0.90, 0.85, 0.08, expected=None),  # no checkpoint: left out of the expected measure
        _run("adaptive-cap100", 0.95, 0.86, 0.03, True, expected=0.024),
    ]
    got = summarize(runs, ["kill"])["kill"]
    assert got["best_fixed_by_goodput"] == {"config": "every-10", "goodput": 0.99}
    assert got["best_fixed_by_useful_time"] == {"config": "every-100", "useful_time": 0.85}
    assert got["adaptive >= best fixed (goodput)"]["met"] is False
    assert got["adaptive >= best fixed (useful_time)"]["met"] is True
    # Lower is better for the overhead the cadence controls (checkpointing + redone steps).
    assert got["best_fixed_by_cadence_overhead"] == {
        "config": "every-25",
        "cadence_overhead": pytest.approx(0.02),
    }
    assert got["adaptive_cadence_overhead"] == pytest.approx(0.03)
    assert got["adaptive <= best fixed (cadence_overhead)"]["met"] is False
    # Without the luck of where the preemptions landed, adaptive wins here.
    assert got["best_fixed_by_expected_cadence_overhead"]["config"] == "every-25"
    assert got["adaptive <= best fixed (expected_cadence_overhead)"]["met"] is True
    assert [got[f"goodput >= 0.95 ({c})"]["met"] for c in ("every-10", "every-100", "adaptive-cap100")] == [
        True, False, True,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--intervals", "0,10"], "--intervals: expected step counts >= 1"),
        (["--intervals", "ten"], "--intervals: expected step counts >= 1"),
        (["--signals", "hup"], "--signals: expected kill, term"),
        (["--size", "huge"], "--size: expected one of tiny, small, 10M, 100M"),
    ],
)
def test_bad_options_are_user_errors(args, message, capsys):
    assert main(["bench", "goodput", "--rate", "1", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_run_reports_goodput_and_time_buckets(tmp_path: Path):
    out = tmp_path / "goodput.json"
    # Seed 47 at 2/min puts the one SIGKILL 13.0 s into the 24 s budget, after the first segment trains.
    code = main([
        "bench", "goodput", "--json", str(out), "--rate", "2", "--minutes", "0.4", "--seed", "47",
        "--intervals", "10", "--no-adaptive", "--workdir", str(tmp_path),
    ])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    assert {"rate_per_min", "minutes", "size", "seed", "runs", "summary", "machine"} <= result.keys()
    (run,) = result["runs"]
    assert {
        "goodput",
        "executed_steps",
        "useful_steps",
        "redone_steps",
        "time_fraction",
        "preemptions",
    } <= run.keys()
    assert set(run["time_fraction"]) == {"startup", "restart", "checkpoint", "redone", "useful", "other"}
    assert run["preemptions"] == 1 and run["segments"] >= 2
    (at,) = run["preemption_times_s"]  # the seed's one arrival, delivered once due, within the budget
    assert 13.0 <= at < 24
    # Checkpoints every 10 steps of ~0.06 s: a preemption loses about half of that on average.
    assert 0 < run["expected_loss_per_preemption_s"] < 10 * run["step_s"]
    assert run["expected_cadence_overhead"] >= run["time_fraction"]["checkpoint"]
    assert 0 < run["goodput"] <= 1
    assert run["useful_steps"] <= run["executed_steps"]
    assert result["summary"]["kill"]["best_fixed_by_goodput"]["config"] == "every-10"
    assert result["summary"]["kill"]["goodput >= 0.95 (every-10)"]["value"] == run["goodput"]
