"""Realistic false-positive check: a healthy 1,000-step charlm run stays quiet under palm-spike; faults fire once."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from policies import load_preset
from supervisor.events import Event
from supervisor.monitor import Point, replay
from supervisor.runtime.faults import FAULTS_ENV
from supervisor.runtime.plan import PLAN_ENV
from tests.conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

STEPS = 1000
EVAL_EVERY = 50
SPECS = load_preset("palm-spike").monitor.detectors
SPIKE = next(s for s in SPECS if s.type == "spike")
HANG = next(s for s in SPECS if s.type == "hang")


@dataclasses.dataclass(frozen=True)
class Recording:
    """What one stand-alone charlm run left behind: its metric points in arrival order and its run dir."""

    points: list[Point]
    run_dir: Path
    restored_steps: list[tuple[int, float]]
    params: dict[str, str]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Recording:
    workdir = tmp_path_factory.mktemp("charlm-healthy")
    env = {k: v for k, v in os.environ.items() if k not in (PLAN_ENV, FAULTS_ENV, "MLFLOW_TRACKING_URI")}
    # One intra-op thread: two OpenMP threads on two shared cores ran 4x slower (0.72 vs 0.18 s/step).
    args = [*f"--steps {STEPS} --eval-every {EVAL_EVERY} --threads 1".split(), "--workdir", str(workdir)]
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "charlm.py"), *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rollback-supervisor")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    points = [
        Point(key, m.step, m.value, m.timestamp / 1000)
        for key in run.data.metrics
        for m in client.get_metric_history(run.info.run_id, key)
    ]
    # Arrival order, as the watcher would see it; the step breaks ties within one millisecond.
    points.sort(key=lambda p: (p.wall_time, p.step))
    (run_dir,) = (workdir / "standalone").glob("charlm-*")
    restored = [
        (m.step, m.value) for m in client.get_metric_history(run.info.run_id, "rollback.restored_step")
    ]
    return Recording(points, run_dir, restored, dict(run.data.params))


def _steps(rec: Recording, metric: str) -> list[int]:
    return sorted(p.step for p in rec.points if p.metric == metric)


def _describe(events: list[Event], rec: Recording) -> str:
    """Each event with the recorded values around its onset, so a false positive can be diagnosed."""
    lines = []
    for e in events:
        near = [
            (p.step, round(p.value, 4))
            for p in rec.points
            if p.metric == e.metric and e.onset_step is not None and abs(p.step - e.onset_step) <= 5
        ]
        lines.append(f"{e.type} {e.metric} onset={e.onset_step} step={e.step}: {e.reason}; near: {near}")
    return "\n".join(lines)


def test_healthy_run_is_complete_and_quiet_in_process(healthy: Recording):
    for metric in ("loss", "grad_norm", "lr"):
        assert _steps(healthy, metric) == list(range(1, STEPS + 1)), metric
    assert _steps(healthy, "val_loss") == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert all(math.isfinite(p.value) for p in healthy.points)
    # Only the start-up restore at step 0 logs restored_step; an in-process rollback would add another.
    assert healthy.restored_steps == [(0, 0.0)]
    events_file = healthy.run_dir / "events.jsonl"
    records = events_file.read_text().splitlines() if events_file.exists() else []
    assert records == [], [json.loads(r)["event"]["reason"] for r in records]


def test_healthy_run_logs_to_mlflow_and_learns(healthy: Recording):
    """The standard workload trains and logs to MLflow (was test_example's own 300-step run): every step's
    loss, grad_norm and lr and every eval's val_loss are checked above; here, that it learns and logs its seed."""
    losses = sorted((p for p in healthy.points if p.metric == "loss"), key=lambda p: p.step)
    assert [p.step for p in losses] == list(range(1, STEPS + 1))
    # It learns: the last 20 steps average well below the first 20 (uniform over the vocab is ~4.2 nats).
    first = sum(p.value for p in losses[:20]) / 20
    last = sum(p.value for p in losses[-20:]) / 20
    assert last < first - 0.5, (first, last)
    assert healthy.params["seed"] == "0"


def test_healthy_run_raises_no_event_under_palm_spike(healthy: Recording):
    events = replay(healthy.points, SPECS)
    assert events == [], _describe(events, healthy)


def _edit_loss(step: int, edit: Callable[[float], float]) -> Callable[[list[Point]], list[Point]]:
    def inject(points: list[Point]) -> list[Point]:
        assert sum(p.metric == "loss" and p.step == step for p in points) == 1
        return [
            dataclasses.replace(p, value=edit(p.value)) if p.metric == "loss" and p.step == step else p
            for p in points
        ]

    return inject


def _stall_after(step: int, seconds: float) -> Callable[[list[Point]], list[Point]]:
    def inject(points: list[Point]) -> list[Point]:
        return [
            dataclasses.replace(p, wall_time=p.wall_time + seconds) if p.step > step else p for p in points
        ]

    return inject


SPIKE_STEP, NAN_STEP, STALL_STEP = 600, 400, 750
STALL_SECONDS = HANG.seconds + 60

# name -> (injection, (type, metric, onset_step))
INJECTIONS = {
    "spike_x50": (_edit_loss(SPIKE_STEP, lambda v: v * 50.0), ("spike", "loss", SPIKE_STEP)),
    "nan": (_edit_loss(NAN_STEP, lambda v: math.nan), ("non_finite", "loss", NAN_STEP)),
    "stall": (_stall_after(STALL_STEP, STALL_SECONDS), ("hang", None, STALL_STEP)),
}


@pytest.mark.parametrize("name", sorted(INJECTIONS))
def test_each_injected_fault_raises_exactly_one_correct_event(healthy: Recording, name: str):
    inject, expected = INJECTIONS[name]
    assert SPIKE.warmup_steps < expected[2] < STEPS
    points = sorted(inject(healthy.points), key=lambda p: (p.wall_time, p.step))
    events = replay(points, SPECS)
    assert [(e.type, e.metric, e.onset_step) for e in events] == [expected], _describe(events, healthy)
    event = events[0]
    if name == "spike_x50":
        original = next(p.value for p in healthy.points if p.metric == "loss" and p.step == SPIKE_STEP)
        assert event.value == original * 50.0
        assert event.evidence["score"] > SPIKE.sigmas
    elif name == "nan":
        assert math.isnan(event.value)
    else:
        assert event.evidence["silent_seconds"] >= STALL_SECONDS
        assert event.step == STALL_STEP


def test_all_injections_together_raise_one_event_each(healthy: Recording):
    points = healthy.points
    for inject, _ in INJECTIONS.values():
        points = inject(points)
    points = sorted(points, key=lambda p: (p.wall_time, p.step))
    events = replay(points, SPECS)
    got = sorted((e.type, e.metric or "", e.onset_step) for e in events)
    want = sorted((t, m or "", s) for _, (t, m, s) in INJECTIONS.values())
    assert got == want, _describe(events, healthy)
