"""Pure pieces of the training side and the supervisor: cadence, layout, plan, LR scaling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from supervisor.errors import UserError
from supervisor.layout import LineageLayout, check_lineage_name
from supervisor.runtime.cadence import MIN_OBSERVED_S, Cadence, estimate_mtbf, young_daly_interval
from supervisor.runtime.plan import LaunchPlan, RestoreSpec
from supervisor.runtime.wiring import apply_lr_scale


@pytest.mark.parametrize(
    ("every", "steps", "due"),
    [(20, [19, 20, 21, 40], [False, True, False, True]), (None, [1, 100], [False, False])],
)
def test_fixed_cadence_is_aligned_to_multiples(every, steps, due):
    cadence = Cadence(every_steps=every)
    cadence.start(0, 0.0)
    assert [cadence.due(s, 0.0) for s in steps] == due


def test_time_cadence_fires_after_every_seconds():
    cadence = Cadence(every_steps=None, every_seconds=10.0)
    cadence.start(0, 100.0)
    assert not cadence.due(5, 109.9)
    assert cadence.due(6, 110.0)
    cadence.saved(6, 110.0)
    assert not cadence.due(7, 115.0)


def _saved_steps(cadence: Cadence, upto: int) -> list[int]:
    """The steps `cadence` saves at up to `upto`: one time-triggered save at step 7, then steps alone."""
    cadence.start(0, 0.0)
    saved = []
    for step in range(1, upto + 1):
        now = 60.0 if step == 7 else 1.0 if step < 7 else 61.0
        if cadence.due(step, now):
            cadence.saved(step, now)
            saved.append(step)
    return saved


def test_keep_every_steps_saves_its_milestones_when_the_cadence_counts_from_the_last_save():
    # every_seconds makes every_steps count from the last save: the time-triggered save at 7 moves the
    # step-triggered ones to 17, 27, 37, so without the milestone trigger step 30 is never saved.
    assert _saved_steps(Cadence(every_steps=10, every_seconds=60.0), 40) == [7, 17, 27, 37]
    milestones = Cadence(every_steps=10, every_seconds=60.0, keep_every_steps=30)
    assert _saved_steps(milestones, 40) == [7, 17, 27, 30, 40]


def test_young_daly_interval_and_adaptive_steps():
    assert young_daly_interval(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    # One failure in an hour of lineage: MTBF 3600 s.
    cadence = Cadence(every_steps=1000, adaptive=True, failures=1, observed_s=3600.0)
    cadence.start(0, 0.0)
    for t in range(11):  # steps of 0.5 s
        cadence.observe_step(t * 0.5)
    cadence.observe_save(2.0)
    # sqrt(2 * 2 * 3600) = 120 s at 0.5 s a step = 240 steps, under the every_steps cap.
    assert cadence.interval_steps(0.0) == 240
    assert not cadence.due(239, 0.0) and cadence.due(240, 0.0)
    capped = Cadence(every_steps=100, adaptive=True, failures=1, observed_s=3600.0)
    capped.start(0, 0.0)
    capped.observe_step(0.0)
    capped.observe_step(0.5)
    capped.observe_save(2.0)
    assert capped.interval_steps(0.0) == 100


@pytest.mark.parametrize(
    ("observed_s", "failures", "mtbf"),
    [
        (0.0, 0, MIN_OBSERVED_S),  # a new lineage: the floor, not "fails every few seconds"
        (30.0, 0, MIN_OBSERVED_S),
        (600.0, 0, 600.0),  # ten minutes without a failure: assume at least that
        (600.0, 1, 600.0),
        (600.0, 5, 120.0),  # one per two minutes
        (30.0, 3, MIN_OBSERVED_S / 3),
    ],
)
def test_mtbf_estimate_from_lineage_time_and_failures(observed_s, failures, mtbf):
    assert estimate_mtbf(observed_s, failures) == pytest.approx(mtbf)


def test_adaptive_interval_follows_the_failure_rate_as_the_lineage_ages():
    def interval(failures: int, observed_s: float, now: float) -> int:
        c = Cadence(every_steps=10_000, adaptive=True, failures=failures, observed_s=observed_s)
        c.start(0, 0.0)
        c.observe_step(0.0)
        c.observe_step(0.25)  # 0.25 s a step
        c.observe_save(0.04)
        return c.interval_steps(now)

    # Five failures in ten minutes: sqrt(2 * 0.04 * 120) = 3.1 s = 12 steps (what the goodput benchmark sees).
    assert interval(5, 600.0, 0.0) == round(math.sqrt(2 * 0.04 * 120) / 0.25)
    # The same lineage with no failure: the interval grows with the time it has lasted, this segment included.
    assert interval(0, 600.0, 0.0) == round(math.sqrt(2 * 0.04 * 600) / 0.25)
    assert interval(0, 600.0, 1800.0) == round(math.sqrt(2 * 0.04 * 2400) / 0.25)
    assert interval(0, 600.0, 1800.0) > interval(0, 600.0, 0.0) > interval(5, 600.0, 0.0)
    # More failures, shorter interval.
    assert [interval(n, 3600.0, 0.0) for n in (1, 4, 16)] == sorted(
        [interval(n, 3600.0, 0.0) for n in (1, 4, 16)], reverse=True
    )


def test_layout_local_and_url_storage(tmp_path: Path):
    local = LineageLayout.resolve(tmp_path, "./checkpoints", "run-1")
    assert local.local == tmp_path.resolve() / "lineages" / "run-1"
    assert local.checkpoints == tmp_path.resolve() / "checkpoints" / "run-1"
    assert local.durable == str(local.local) and local.remote is None
    remote = LineageLayout.resolve(tmp_path, "s3://bucket/prefix/", "run-1")
    assert remote.durable == "s3://bucket/prefix/run-1"
    assert remote.remote == "s3://bucket/prefix/run-1/checkpoints"
    assert remote.checkpoints == tmp_path.resolve() / "lineages" / "run-1" / "checkpoints"


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "-x", "x" * 101])
def test_bad_lineage_names_are_user_errors(bad):
    with pytest.raises(UserError, match="--lineage"):
        check_lineage_name(bad)


def test_plan_round_trips_through_json(tmp_path: Path):
    plan = LaunchPlan(
        lineage="l",
        workdir=str(tmp_path),
        checkpoint_dir=str(tmp_path / "c"),
        tracking_uri="sqlite:///x.db",
        restore=RestoreSpec("0000000020-000002", skip_batches=7, lr_scale=0.5, rollback=True),
        history={"entries": []},
        supervisor_pid=123,
        lineage_seconds=4321.5,
    )
    assert LaunchPlan.read(plan.write(tmp_path / "plan.json")) == plan


def test_unreadable_plan_is_a_user_error(tmp_path: Path):
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(UserError, match="launch plan"):
        LaunchPlan.read(tmp_path / "plan.json")


def test_lr_scale_survives_the_scheduler():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    sched.step()
    before = sched.get_last_lr()[0]
    apply_lr_scale([opt], [sched], 0.5)
    assert opt.param_groups[0]["lr"] == before * 0.5
    sched.step()  # the schedule goes on from the scaled base LR
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 * 1.0 / 3)
    assert sched.state_dict()["base_lrs"] == [0.5]


def test_adaptive_cadence_keeps_the_segment_age_across_in_process_rollbacks():
    c = Cadence(every_steps=10_000, adaptive=True, failures=0, observed_s=0.0)
    c.start(0, 0.0)
    c.observe_step(0.0)
    c.observe_step(0.25)
    c.observe_save(0.04)
    before = c.interval_steps(3600.0)
    c.start(500, 3600.0)  # an in-process rollback restarts the step count, not the lineage's age
    assert c.mtbf_s(3600.0) == pytest.approx(3600.0)
    assert c.interval_steps(3600.0) == before


def test_adaptive_cadence_saves_early_to_measure_the_save_cost():
    c = Cadence(every_steps=100, adaptive=True, failures=3, observed_s=600.0)
    c.start(40, 0.0)
    assert c.interval_steps(0.0) == 100  # no step timed yet: the cap
    c.observe_step(0.25)
    assert c.due(41, 0.25)  # one timed step and no save yet: save now rather than 100 steps from now
    c.observe_save(0.04)
    c.saved(41, 0.25)
    assert c.interval_steps(0.25) == round(math.sqrt(2 * 0.04 * 200) / 0.25)
    fixed = Cadence(every_steps=100)
    fixed.start(40, 0.0)
    fixed.observe_step(0.25)
    assert not fixed.due(41, 0.25)


def test_lineage_running_time_leaves_out_idle_time_and_the_open_segment():
    from supervisor.orchestrator import running_seconds

    segments = [
        {"started": 1000.0, "ended": 1600.0},
        {"started": 90_000.0, "ended": 90_300.0},  # resumed a day later: the day in between is not counted
        {"started": 90_310.0, "ended": None},
    ]
    assert running_seconds(segments) == 900.0
    assert running_seconds([]) == 0.0


def test_a_plan_with_keys_from_another_release_still_reads(tmp_path: Path):
    plan = LaunchPlan(
        lineage="l", workdir=str(tmp_path), checkpoint_dir=str(tmp_path / "c"), tracking_uri="x"
    )
    data = {**plan.to_dict(), "lineage_started": 1.0}
    assert LaunchPlan.from_dict(data) == plan


def test_failures_for_the_cadence_count_lost_processes_not_metric_anomalies():
    from types import SimpleNamespace

    from supervisor.runtime.cadence import failures_in as _failures

    kinds = ["spike", "preemption", "non_finite", "hardware_fault", "unknown_exit", "plateau", "hang", "oom"]
    history = [SimpleNamespace(event=SimpleNamespace(type=k)) for k in kinds]
    assert _failures(history) == 5
    assert _failures([]) == 0


def test_metric_logger_connects_only_once_started_and_keeps_what_was_logged_before():
    import threading

    from supervisor.runtime.metrics import AsyncMetricLogger

    opened = threading.Event()
    sent: list[tuple[str, float, int]] = []

    class Sink:
        def send(self, points):
            sent.extend((key, value, step) for key, value, _, step in points)

    def connect():
        opened.set()
        return Sink(), "run-1"

    logger = AsyncMetricLogger(connect, start=False)
    logger.log({"loss": 1.5}, step=1)
    assert not opened.wait(0.3)  # the restore runs now: MLflow is neither imported nor opened
    logger.start()
    logger.start()  # idempotent
    assert logger.flush(timeout=10)
    assert opened.is_set() and sent == [("loss", 1.5, 1)]
    logger.close()
    # Never started explicitly: flushing starts it, so nothing logged is lost.
    late = AsyncMetricLogger(connect, start=False)
    late.log({"loss": 2.0}, step=2)
    late.close()
    assert sent[-1] == ("loss", 2.0, 2)


def test_metric_logger_ships_while_points_keep_coming_not_only_at_a_flush():
    import threading
    import time as _time

    from supervisor.runtime.metrics import AsyncMetricLogger

    batches: list[int] = []
    lock = threading.Lock()

    class Sink:
        def send(self, points):
            with lock:
                batches.append(len(points))

    logger = AsyncMetricLogger(lambda: (Sink(), "run-1"), interval=0.1)
    for step in range(60):  # a steady stream, one point every 10 ms: never 0.1 s of silence
        logger.log({"loss": float(step)}, step=step)
        _time.sleep(0.01)
    with lock:
        before_flush = list(batches)
    assert logger.flush(timeout=10)
    logger.close()
    # Shipped in several batches during the stream (a quiet-period rule would have sent nothing until the flush).
    assert len(before_flush) >= 2, before_flush
    assert sum(batches) == 60


def test_metrics_sent_is_asked_once_and_a_commit_waits_for_it_boundedly(caplog):
    import logging
    import threading

    from supervisor.runtime.metrics import AsyncMetricLogger, MetricsSent

    sent: list[int] = []
    release = threading.Event()

    class Sink:
        def send(self, points):
            assert release.wait(30)
            sent.extend(step for *_, step in points)

    logger = AsyncMetricLogger(lambda: (Sink(), "run-1"), interval=60.0)
    logger.log({"loss": 1.0}, step=1)
    later = MetricsSent(logger, step=1, timeout=0.3)
    first = later.ask()  # sent at once, not on the 60 s schedule
    assert later.ask() is first  # asked twice (commit and training thread), requested once
    with caplog.at_level(logging.WARNING, "rollback_supervisor.metrics"):
        later.wait()  # MLflow is stuck: the commit goes ahead after the timeout, with a warning
    assert "commits before its metrics reached MLflow" in caplog.text and sent == []
    release.set()
    assert first.wait(10) and sent == [1]
    # A synchronous save commits inside save(): the commit's wait makes the request itself.
    logger.log({"loss": 2.0}, step=2)
    MetricsSent(logger, step=2).wait()
    assert sent == [1, 2]
    logger.close()
