"""The training-side core driven without Session.loop(), as a framework's callbacks would drive it: a real
store, model and policy; the driver only reports steps and acts on the answers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from supervisor import exitcodes
from supervisor.runtime.actions import CONTINUE, Rollback, SaveDue, Stop
from supervisor.runtime.core import TrainingCore
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.seams import NullMetrics
from supervisor.runtime.wiring import load_session_policy
from supervisor.state import TrainingState

POLICY = (
    "version: 1\nname: core\n"
    "checkpoint: {every_steps: 5, keep_last: 50, async: false}\n"
    "monitor: {detectors: [{type: non_finite, metrics: [loss]}]}\n"
)
ROLLBACK = "rules: [{when: [non_finite], action: rollback, target: {select: latest}, lr_scale: 0.5}]\n"
STOP = "rules: [{when: [non_finite], action: stop}]\n"


def _core(tmp_path: Path, rules: str = ROLLBACK, *, in_process_rollback: bool = True) -> TrainingCore:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY + rules)
    plan = LaunchPlan(
        lineage="core",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "work" / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}",
        policy_path=str(policy),
        supervised=False,
    )
    core = TrainingCore(
        plan, load_session_policy(plan), TrainingState(), in_process_rollback=in_process_rollback
    )
    core.outputs.metrics = NullMetrics()  # no MLflow: what is logged is not under test here
    return core


class Model:
    def __init__(self, core: TrainingCore):
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)
        core.register("model", self.net)
        core.register("optimizer", self.opt)

    def step(self) -> float:
        self.opt.zero_grad()
        loss = self.net(torch.ones(2, 4)).pow(2).mean()
        loss.backward()
        self.opt.step()
        return loss.item()


def test_building_the_core_starts_nothing_and_writes_nothing(tmp_path: Path):
    threads = threading.active_count()
    core = _core(tmp_path)
    assert not (tmp_path / "work").exists() and core.store is None
    assert threading.active_count() == threads
    core.start()
    try:
        assert (tmp_path / "work" / "checkpoints").is_dir() and core.store is not None
    finally:
        core.close()


def test_the_core_says_when_to_save_and_the_driver_saves(tmp_path: Path):
    core = _core(tmp_path)
    model = Model(core)
    assert core.restore() is None  # an empty store: from scratch
    actions = []
    try:
        for _ in range(11):
            core.state.step += 1
            loss = model.step()
            action = core.step_ended(core.state.step, {"loss": loss}, final=core.state.step == 11)
            actions.append(action)
            if isinstance(action, SaveDue):
                assert core.save(action.step, {"loss": loss})
        assert core.stopping() is None
        assert core.save(11, {}, force=True) and core.wait()  # the driver's final checkpoint
        steps = [i.step for i in core.store.list()]  # type: ignore[union-attr]
    finally:
        core.close()
    assert [a for a in actions if a != CONTINUE] == [SaveDue(5), SaveDue(10)]
    assert steps == [5, 10, 11] and core.exit_code == exitcodes.EXIT_OK


def test_a_nan_is_rolled_back_in_process_and_the_answer_says_where_to(tmp_path: Path):
    core = _core(tmp_path)
    model = Model(core)
    core.restore()
    try:
        for step in range(1, 8):
            core.state.step = step
            loss = model.step()
            if step == 5:
                at_5 = model.net.weight.detach().clone()
            action = core.step_ended(step, {"loss": float("nan") if step == 7 else loss})
            if isinstance(action, SaveDue):
                core.save(step, {"loss": loss})
    finally:
        core.close()
    assert isinstance(action, Rollback)
    assert (action.step, action.skip_batches, action.lr_scale) == (5, 0, 0.5)
    assert core.state.step == 5 and core.rollbacks_in_process == 1
    assert torch.equal(model.net.weight, at_5)
    assert model.opt.param_groups[0]["lr"] == pytest.approx(0.05)
    (report,) = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()]
    assert report["handled_in_process"] and report["decision"]["target_id"] == action.target_id


def test_an_anomaly_the_policy_leaves_to_the_supervisor_stops_now_with_exit_76(tmp_path: Path):
    core = _core(tmp_path, STOP)
    model = Model(core)
    core.restore()
    try:
        core.state.step = 1
        model.step()
        action = core.step_ended(1, {"loss": float("nan")})
    finally:
        core.close()
    assert isinstance(action, Stop) and action.reason.startswith("anomaly: ")
    assert (action.exit_code, action.checkpoint) == (exitcodes.EXIT_ANOMALY, False)
    assert core.stopping() == action and core.exit_code == exitcodes.EXIT_ANOMALY


def test_a_stop_with_a_checkpoint_is_answered_and_ends_with_exit_75(tmp_path: Path):
    core = _core(tmp_path)
    model = Model(core)
    core.restore()
    try:
        core.state.step = 1
        model.step()
        core.request_stop("preempted by the test", checkpoint=True)
        action = core.step_ended(1, {"loss": 1.0})
        assert action == Stop("preempted by the test", exitcodes.EXIT_PREEMPTED, checkpoint=True)
        saved = core.save(1, {}) and core.wait()
        assert core.stopped(action, saved=saved) == exitcodes.EXIT_PREEMPTED
        assert [i.step for i in core.store.list()] == [1]  # type: ignore[union-attr]
    finally:
        core.close()


def test_without_in_process_rollback_the_core_reports_the_anomaly_and_stops_with_exit_76(tmp_path: Path):
    """A driver whose loop cannot restart its data (the HF Trainer's): with a policy and a checkpoint that would
    roll back in process, the core reports the anomaly and stops with 76, restoring nothing."""
    core = _core(tmp_path, in_process_rollback=False)
    net = torch.nn.Linear(4, 1)
    core.register("model", net)
    core.restore()
    try:
        core.state.step = 5
        assert core.step_ended(5, {"loss": 1.0}) == SaveDue(5)
        assert core.save(5, {"loss": 1.0}) and core.wait()
        with torch.no_grad():
            net.weight.add_(1.0)
        after = net.weight.detach().clone()
        core.state.step = 6
        action = core.step_ended(6, {"loss": float("nan")})
    finally:
        core.close()
    assert isinstance(action, Stop) and action.reason.startswith("anomaly: ")
    assert (action.exit_code, action.checkpoint) == (exitcodes.EXIT_ANOMALY, False)
    assert core.exit_code == exitcodes.EXIT_ANOMALY and core.rollbacks_in_process == 0
    assert core.state.step == 6 and torch.equal(net.weight, after)  # nothing was restored
    (report,) = [json.loads(line) for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()]
    assert report["handled_in_process"] is False and report["event"]["type"] == "non_finite"


def test_save_may_be_due_answers_what_step_ended_would_without_changing_anything(tmp_path: Path):
    core = _core(tmp_path)
    Model(core)
    core.restore()
    try:
        asked = [s for s in range(1, 12) if core.save_may_be_due(s)]
        assert asked == [5, 10]  # every_steps: 5, asked before any step ended: the cadence moved not at all
        assert core.save_may_be_due(3, final=True)
        core.request_stop("test", checkpoint=True)
        assert core.save_may_be_due(3)
    finally:
        core.close()
