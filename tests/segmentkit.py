"""Start the example as the supervisor would, without the supervisor: a launch plan naming an MLflow run id and
a metric spool, so the training process imports no MLflow (the GPU tests run where MLflow is not installed)."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.runtime.faults import FAULTS_ENV
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan

#: Checkpoint every 10 steps; a NaN loss rolls back, in process, to the latest checkpoint.
NAN_ROLLBACK_POLICY = """\
version: 1
name: nan-rollback
checkpoint: {every_steps: 10, keep_last: 10, async: true, storage: ./checkpoints}
monitor:
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
"""


def segment_env(workdir: Path, run_id: str, tracking_uri: str, faults: str = "") -> dict[str, str]:
    """The environment of the next segment in `workdir` (plan-<n>.json, spool metrics/<n>.jsonl); a relaunch on
    the same workdir restores the latest checkpoint, and a fault fires once per workdir."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "policy.yaml").write_text(NAN_ROLLBACK_POLICY)
    segment = len(list(workdir.glob("plan-*.json")))
    plan = LaunchPlan(
        lineage="segments",
        workdir=str(workdir),
        checkpoint_dir=str(workdir / "checkpoints"),
        tracking_uri=tracking_uri,
        run_id=run_id,
        segment=segment,
        policy_path=str(workdir / "policy.yaml"),
        metrics_spool=str(workdir / "metrics" / f"{segment}.jsonl"),
    ).write(workdir / f"plan-{segment}.json")
    env = {k: v for k, v in os.environ.items() if k != FAULTS_ENV}
    return {**env, PLAN_ENV: str(plan), FAULTS_ENV: faults}
