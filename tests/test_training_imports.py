"""A supervised training process reads the policy the supervisor validated from its plan: it imports neither
pydantic nor the policy schema (~0.1 s of a relaunch's start-up) unless an anomaly must be decided, and then
the engine is imported on the spot and decides as it always did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from policies import load_policy
from policies.plain import PolicyView, policy_data
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan
from supervisor.runtime.wiring import load_session_policy
from tests.conftest import REPO

POLICY = """\
version: 1
name: imports
checkpoint: {every_steps: 2, async: true, keep_best: {metric: loss}}
monitor:
  detectors: [{type: non_finite, metrics: [loss]}, {type: spike, warmup_steps: 0, min_history: 2, window: 4}]
rules:
  - {when: [non_finite], action: rollback, target: {select: latest}}
  - {when: [preemption], action: resume}
"""

#: Trains a linear model for 8 steps under the plan, and prints which of the heavy modules each step found
#: imported (in the order the steps ran), with the in-process rollbacks, the exit code and the policy's type.
SCRIPT = """\
import json, sys, torch
from supervisor.runtime import Session

HEAVY = ("pydantic", "policies.schema", "policies.monitor_schema", "policies.engine",
         "supervisor.monitor.classifier", "mlflow")
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(4)]
sess = Session.attach(run_name="imports")
sess.register(model=model, optimizer=optimizer)
seen = []
with sess:
    for step, (x, y) in sess.loop(data, max_steps=8):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sess.log(loss=loss.item())
        seen.append([step, [m for m in HEAVY if m in sys.modules]])
print(json.dumps({"seen": seen, "rollbacks": sess.rollbacks_in_process, "exit": sess.exit_code,
                  "policy": type(sess.policy).__name__}))
"""


def _run(tmp_path: Path, faults: str) -> dict:
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    plan = LaunchPlan(
        lineage="imports",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "work" / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}",
        policy_path=str(policy),
        policy=policy_data(load_policy(policy)),
        run_id="0123",  # with the spool: metrics go to the supervisor's spool, MLflow is never imported
        metrics_spool=str(tmp_path / "work" / "metrics.jsonl"),
    ).write(tmp_path / "plan.json")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, PLAN_ENV: str(plan), "ROLLBACK_SUPERVISOR_FAULTS": faults, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_supervised_run_without_anomalies_never_builds_the_schema(tmp_path: Path):
    out = _run(tmp_path, "")
    assert out["policy"] == "PolicyView" and out["exit"] == 0 and out["rollbacks"] == 0
    assert out["seen"] == [[step, []] for step in range(1, 9)]


def test_an_anomaly_imports_the_engine_then_and_is_still_rolled_back_in_process(tmp_path: Path):
    out = _run(tmp_path, "nan@5")  # the weights poisoned after step 5: step 6's loss is NaN
    assert out["exit"] == 0 and out["rollbacks"] == 1
    steps = [step for step, _ in out["seen"]]
    assert steps == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]  # back to step 4's checkpoint after step 6
    assert all(heavy == [] for _, heavy in out["seen"][:6])
    assert out["seen"][6][1] == ["pydantic", "policies.schema", "policies.monitor_schema", "policies.engine"]
    (line,) = [
        json.loads(line)
        for line in (tmp_path / "work" / "events.jsonl").read_text().splitlines()
        if json.loads(line).get("handled_in_process")
    ]
    assert line["decision"]["action"] == "rollback" and line["decision"]["target_step"] == 4


def test_the_plan_view_reads_as_the_validated_policy(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    model = load_policy(policy)
    data = json.loads(json.dumps(policy_data(model)))
    plan = LaunchPlan(
        lineage="v", workdir=str(tmp_path), checkpoint_dir=str(tmp_path), tracking_uri="", policy=data
    )
    view = load_session_policy(plan)
    assert isinstance(view, PolicyView)
    ck = view.checkpoint
    assert (ck.every_steps, ck.async_, ck.keep_last, ck.memory_slots) == (
        2,
        True,
        3,
        model.checkpoint.memory_slots,
    )
    assert (ck.keep_best.metric, ck.keep_best.mode, ck.keep_best.count) == ("loss", "min", 1)
    assert [d.type for d in view.monitor.detectors] == ["non_finite", "spike"]
    assert view.monitor.detectors[1].sigmas == model.monitor.detectors[1].sigmas
    assert view.monitor.preemption_notice.provider == "none" and view.monitor.replay.enabled is False
    assert view.name == "imports" and view.rule_for("preemption")[0] == 1 and view.rule_for("hang") is None
    assert view.rule_for("non_finite")[1].action == "rollback"
    assert view.model() == model  # what the engine decides with: validated again, the same policy
    # A plan without the data (a stand-alone run, an older supervisor): the file, validated here.
    assert (
        load_session_policy(
            LaunchPlan(lineage="v", workdir="", checkpoint_dir="", tracking_uri="", policy_path=str(policy))
        )
        == model
    )
