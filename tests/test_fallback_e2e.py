"""Issue 30 end to end: a NaN too early for the rule's lookback rolls back to the newest healthy checkpoint, and the
run finishes instead of failing; the fallback shows in the lineage record and in `status --json`.

Scaled down from the issue (palm-spike, checkpoints every 200 steps, lookback 100, a NaN at step 231): checkpoints
every 10 steps, lookback 10, `nan@13`. The NaN poisons step 13's update, so step 14's loss is the first NaN (onset
14): the step-10 checkpoint is the only one before it, and it is not 10 steps before the onset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.cli import main
from supervisor.orchestrator import LineageRunner, RunOptions, python_command
from tests.test_status_real_run import TRAIN  # a real, small supervised training (steps take milliseconds)

pytestmark = [pytest.mark.e2e]

STEPS = 20
POLICY = """\
version: 1
name: fallback-e2e
checkpoint: {every_steps: 10, keep_last: 10, async: false, storage: ./checkpoints}
monitor:
  poll_seconds: 0.5
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: best_before, metric: loss, mode: min, lookback_steps: 10}
  - when: [preemption, unknown_exit]
    action: resume
    target: {select: latest}
limits:
  backoff: {initial_seconds: 0.1, max_seconds: 1, multiplier: 2, jitter: false}
"""


def test_a_nan_before_the_lookback_reaches_a_checkpoint_falls_back_and_the_run_finishes(
    tmp_path: Path, capsys
):
    policy, script, workdir = tmp_path / "policy.yaml", tmp_path / "train.py", tmp_path / "wd"
    policy.write_text(POLICY)
    script.write_text(TRAIN)
    options = RunOptions(
        command=python_command(["python", str(script), str(STEPS)]),
        policy_path=str(policy),
        lineage="fb",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "nan@13"},
        max_segments=2,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise().to_dict()
    assert (record["status"], record["final_reason"]) == ("finished", "training finished")
    (segment,) = record["segments"]
    (entry,) = segment["in_process"]
    decision = entry["decision"]
    assert (decision["action"], decision["target_step"], decision["fallback"]) == ("rollback", 10, True)
    assert entry["event"]["onset_step"] == 14
    assert (
        "no checkpoint matches best_before(loss, min, lookback_steps=10) among 1 valid checkpoint(s) at or "
        "before step 12 (onset 14); falling back to the newest healthy checkpoint before the onset"
    ) in decision["reason"]

    assert main(["status", "--workdir", str(workdir), "--json"]) == 0
    (view,) = json.loads(capsys.readouterr().out)["lineages"]
    (row,) = view["timeline"]
    assert (row["action"], row["target_step"], row["fallback"]) == ("rollback", 10, True)
    assert view["segments"][0]["in_process"][0]["decision"]["fallback"] is True
