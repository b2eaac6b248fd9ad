"""The core's wiring, each piece checked where removing it would go unnoticed elsewhere: the size of the core,
the write in flight reaching a composed save policy, the DDP stop adoption, the iterator restart after an
in-process rollback, nothing started when built, the drill after the detectors, the supervisor's pid, the
detectors' reset after a restore, and the stand-alone run's terminal status."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from supervisor import exitcodes
from supervisor.runtime import Session
from supervisor.runtime.actions import CONTINUE, Rollback, SaveDue, Stop
from supervisor.runtime.core import TrainingCore
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.save_policy import EverySteps, NotWhileWriting
from supervisor.runtime.seams import NullMetrics
from supervisor.runtime.wiring import load_session_policy
from supervisor.state import TrainingState

CHECKPOINT = "checkpoint: {every_steps: 100, async: false}\n"
RESUME = "rules: [{when: [preemption], action: resume, target: {select: latest}}]\n"
NAN_ROLLBACK = (
    "monitor: {detectors: [{type: non_finite, metrics: [loss]}]}\n"
    "rules: [{when: [non_finite], action: rollback, target: {select: latest}}]\n"
)


def _plan(tmp_path: Path, body: str = CHECKPOINT + NAN_ROLLBACK, **kw: Any) -> LaunchPlan:
    policy = tmp_path / "policy.yaml"
    policy.write_text("version: 1\nname: wiring\n" + body)
    return LaunchPlan(
        lineage="wiring",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "work" / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}",
        policy_path=str(policy),
        **kw,
    )


def _core(plan: LaunchPlan, **kw: Any) -> TrainingCore:
    core = TrainingCore(plan, load_session_policy(plan), TrainingState(), **kw)
    core.outputs.metrics = NullMetrics()
    return core


def _events(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "work" / "events.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_core_holds_a_dozen_attributes_or_fewer(tmp_path: Path):
    core = _core(_plan(tmp_path))
    assert len(vars(core)) <= 12, sorted(vars(core))


def test_a_composed_policy_sees_the_write_in_flight(tmp_path: Path):
    core = _core(_plan(tmp_path), save_policy=EverySteps(1) & NotWhileWriting())
    core.restore()
    try:
        core.store.writing = lambda: True  # type: ignore[union-attr,method-assign]  # a write is in flight
        core.state.step = 1
        assert core.step_ended(1, {}) == CONTINUE
        core.store.writing = lambda: False  # type: ignore[union-attr,method-assign]
        core.state.step = 2
        assert core.step_ended(2, {}) == SaveDue(2)
    finally:
        core.close()


class TwoRanks:
    """All-reduce(MAX) between two simulated ranks, each calling from its own thread."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=10)
        self._flags: dict[int, tuple[int, ...]] = {}

    def rank(self, rank: int) -> FakeRank:
        return FakeRank(self, rank)

    def reduce(self, rank: int, flags: tuple[int, ...]) -> tuple[int, ...]:
        self._flags[rank] = flags
        self._barrier.wait()
        merged = tuple(max(values) for values in zip(*self._flags.values(), strict=True))
        self._barrier.wait()
        return merged


class FakeRank:
    """One rank's `Collective` over `TwoRanks` (nothing but the agreement is exercised here)."""

    world_size = 2

    def __init__(self, ranks: TwoRanks, rank: int):
        self._ranks, self.rank = ranks, rank

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def agree(self, *flags: int) -> tuple[int, ...]:
        return self._ranks.reduce(self.rank, flags)

    def broadcast_outcome(self, value: str | None, error: BaseException | None = None) -> str | None:
        return value

    def gather_values(self, values: Any) -> list[list[float]]:
        return [list(values)] * 2

    def gather_state(self, nested: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def finish(self, timeout_s: float = 60.0) -> None:
        pass


def test_under_ddp_a_sigterm_on_one_rank_stops_both_with_a_checkpoint(tmp_path: Path):
    ranks = TwoRanks()
    plans = [_plan(tmp_path, CHECKPOINT + "monitor: {detectors: []}\n" + RESUME) for _ in (0, 1)]
    cores = [_core(plans[r], dist=ranks.rank(r)) for r in (0, 1)]
    cores[1].resources.stops.requests.on_signal(15)  # SIGTERM reaches rank 1 only
    answers: dict[int, Any] = {}

    def step(rank: int) -> None:
        cores[rank].state.step = 1
        answers[rank] = cores[rank].step_ended(1, {})

    other = threading.Thread(target=step, args=(0,))
    other.start()
    step(1)
    other.join(10)
    expected = Stop("SIGTERM", exitcodes.EXIT_PREEMPTED, checkpoint=True)
    assert answers[1] == expected
    assert answers[0] == Stop("another rank was asked to stop", exitcodes.EXIT_PREEMPTED, checkpoint=True)
    assert [core.stopping() for core in cores] == [answers[0], expected]


def test_after_an_in_process_rollback_the_next_batch_follows_the_restored_position(tmp_path: Path):
    from supervisor.data import ResumableLoader

    sess = Session(_plan(tmp_path, "checkpoint: {every_steps: 2, async: false}\n" + NAN_ROLLBACK))
    sess._metrics = NullMetrics()
    loader = ResumableLoader(torch.arange(20.0), batch_size=1)
    sess.register(model=torch.nn.Linear(1, 1), data=loader)
    seen, nan_sent = [], False
    with sess:
        for step, batch in sess.loop(loader, max_steps=7):
            seen.append((step, float(batch[0])))
            if step == 5 and not nan_sent:
                nan_sent = True
                sess.log(loss=float("nan"))
            else:
                sess.log(loss=1.0)
    assert sess.rollbacks_in_process == 1
    (target,) = [r["decision"]["target_id"] for r in _events(tmp_path)]
    restored = int(target.split("-")[0])  # the policy picks it (the newest healthy checkpoint)
    assert restored < 5
    after = [(step, float(step - 1)) for step in range(restored + 1, 8)]
    # Batch i is step i+1's: after the rollback the loader resumes right after the restored step's batch.
    assert seen == [(step, float(step - 1)) for step in range(1, 6)] + after


def test_building_the_core_starts_no_notice_watcher_and_start_does(tmp_path: Path):
    body = (
        CHECKPOINT
        + (
            "monitor: {detectors: [], preemption_notice: {provider: gcp, endpoint: 'http://127.0.0.1:9/x', "
            "poll_seconds: 60}}\n"
        )
        + RESUME
    )
    threads = threading.active_count()
    core = _core(_plan(tmp_path, body))
    assert threading.active_count() == threads and not (tmp_path / "work").exists()
    core.start()
    try:
        assert threading.active_count() > threads  # the watcher polls (a dead endpoint: it never fires)
    finally:
        core.close()


class Drill:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def after_step(self, step: int) -> None:
        self.steps.append(step)


def test_the_fault_drill_runs_after_the_detectors_and_not_on_a_rolled_back_step(tmp_path: Path):
    core = _core(_plan(tmp_path, "checkpoint: {every_steps: 1, async: false}\n" + NAN_ROLLBACK))
    core.register("model", torch.nn.Linear(1, 1))
    drill = Drill()
    core._drill = drill  # type: ignore[assignment]
    core.restore()
    try:
        for step in range(1, 7):
            core.state.step = step
            action = core.step_ended(step, {"loss": float("nan") if step == 6 else 1.0})
            if isinstance(action, SaveDue):
                core.save(step, {})
    finally:
        core.close()
    assert isinstance(action, Rollback) and drill.steps == [1, 2, 3, 4, 5]


def test_a_vanished_supervisor_stops_the_segment_with_an_emergency_checkpoint(tmp_path: Path):
    core = _core(_plan(tmp_path, supervisor_pid=_dead_pid()))
    core.restore()
    try:
        core.state.step = 1
        action = core.step_ended(1, {"loss": 1.0})
    finally:
        core.close()
    assert action == Stop("the supervisor process vanished", exitcodes.EXIT_PREEMPTED, checkpoint=True)


def test_a_restore_resets_the_detectors_to_a_new_segment(tmp_path: Path):
    core = _core(_plan(tmp_path, "checkpoint: {every_steps: 1, async: false}\n" + NAN_ROLLBACK))
    core.register("model", torch.nn.Linear(1, 1))
    core.restore()
    try:
        for step in range(1, 5):
            core.state.step = step
            core.save(step, {})
        segment = core.decider._detectors.segment
        core.state.step = 5
        assert isinstance(core.step_ended(5, {"loss": float("nan")}), Rollback)
        assert core.decider._detectors.segment == segment + 1
    finally:
        core.close()


class Sink:
    def __init__(self) -> None:
        self.terminated: list[tuple[str, str]] = []
        self.client = self

    def set_terminated(self, run_id: str, status: str) -> None:
        self.terminated.append((run_id, status))


class Metrics(NullMetrics):
    def __init__(self, sink: Sink):
        self._sink = sink

    def connection(self, timeout: float = 0.0) -> tuple[Any, str | None]:  # type: ignore[override]
        return self._sink, "run-1"


def test_a_stand_alone_run_is_marked_terminated_with_its_status_and_a_supervised_one_is_not(tmp_path: Path):
    statuses = []
    for supervised, fail in [(False, False), (False, True), (True, False)]:
        sink = Sink()
        directory = tmp_path / f"{supervised}-{fail}"
        directory.mkdir()
        core = _core(_plan(directory, supervised=supervised))
        core.outputs.metrics = Metrics(sink)
        if fail:
            core.fail()
        core.close()
        statuses.append(sink.terminated)
    assert statuses == [[("run-1", "FINISHED")], [("run-1", "FAILED")], []]


def test_a_stand_alone_run_in_a_sqlite_store_ends_finished(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    plan = _plan(tmp_path, supervised=False)
    core = TrainingCore(plan, load_session_policy(plan), TrainingState())  # the real metric logger
    core.restore()
    core.log({"loss": 1.0})
    run_id = core.outputs.metrics.connection()[1]
    core.close()
    assert run_id is not None
    assert MlflowClient(plan.tracking_uri).get_run(run_id).info.status == "FINISHED"
