"""A NaN step with a checkpoint due at the same step (issue 14): the poisoned checkpoint is never the way back.

Real training processes (examples/charlm.py, as the supervisor launches a segment: a plan and a metric spool, no
MLflow) with the real fault drill, scaled down from the issue's step 200 to step 8 with a checkpoint every 4
steps. `nan@8` poisons the gradients of step 8's update: step 8's loss is still finite (it is computed before
the update), the checkpoint due at step 8 holds NaN weights, and step 9's loss is NaN. The old engine rolled
back to step 8 (candidates "before onset 9"), the NaN came straight back, and the escalation failed the run;
a resume took step 8 as "latest".
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from supervisor import exitcodes
from supervisor.checkpoint import open_store
from supervisor.spool import SpoolReader
from tests.segmentkit import segment_env

REPO = Path(__file__).resolve().parents[1]
RUNNER = "import sys; sys.path.insert(0, 'examples'); import charlm; sys.exit(charlm.main(sys.argv[1:]))"
RUN_ID = "0" * 32  # the spool names the run; the training process never opens MLflow
#: A NaN loss rolls back, in process, to the latest checkpoint (tests/segmentkit.py's policy, every 4 steps).
NAN_POLICY = """\
version: 1
name: nan-rollback
checkpoint: {every_steps: 4, keep_last: 10, async: true, storage: ./checkpoints}
monitor:
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
"""
#: No detector: a NaN goes unnoticed in training, as with a policy that watches nothing (or a killed process).
UNWATCHED_POLICY = """\
version: 1
name: unwatched
checkpoint: {every_steps: 4, keep_last: 10, async: true, storage: ./checkpoints}
monitor: {detectors: []}
rules:
  - when: [preemption]
    action: resume
    target: {select: latest}
"""


def _segment(
    workdir: Path, steps: int, faults: str = "", policy: str = NAN_POLICY
) -> subprocess.CompletedProcess:
    env = segment_env(workdir, RUN_ID, f"sqlite:///{workdir / 'unused.db'}", faults)
    (workdir / "policy.yaml").write_text(policy)
    cmd = [
        sys.executable,
        "-c",
        RUNNER,
        "--size",
        "tiny",
        "--batch-size",
        "4",
        "--eval-every",
        "1000",
        "--threads",
        "1",
    ]
    return subprocess.run(
        [*cmd, "--steps", str(steps)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def _points(workdir: Path, segment: int, key: str) -> list[tuple[int, float]]:
    points, _ = SpoolReader(workdir / "metrics" / f"{segment}.jsonl").pending(limit=100_000)
    return [(step, value) for k, value, _, step in points if k == key]


def _final_state(workdir: Path) -> dict[str, str]:
    """Content digest of every model and optimizer tensor of the final checkpoint (bit-for-bit comparison)."""
    catalog = open_store(workdir / "checkpoints")
    final = catalog.latest()
    assert final is not None
    tensors = catalog.manifest(final.id).tensors
    return {name: ref.digest for name, ref in tensors.items() if name.startswith(("model.", "optimizer."))}


def test_a_nan_with_a_checkpoint_due_at_its_step_rolls_back_past_the_poisoned_checkpoint(tmp_path: Path):
    faulty, clean = tmp_path / "faulty", tmp_path / "clean"
    proc = _segment(faulty, 12, faults="nan@8")
    assert proc.returncode == exitcodes.EXIT_OK, proc.stderr[-3000:]
    losses = _points(faulty, 0, "loss")
    assert math.isfinite(dict(losses)[8]), "step 8's loss is computed before its poisoned update"

    reports = [json.loads(line) for line in (faulty / "events.jsonl").read_text().splitlines()]
    assert len(reports) == 1, reports  # one rollback, no recurrence, no escalation
    decision = reports[0]["decision"]
    assert reports[0]["handled_in_process"] and decision["action"] == "rollback"
    assert reports[0]["event"]["onset_step"] == 9
    assert decision["target_step"] == 4, decision["reason"]  # not the step-8 checkpoint
    assert _points(faulty, 0, "rollback.restored_step") == [(0, 0.0), (4, 4.0)]  # start, then the rollback
    assert [s for s, v in losses if not math.isfinite(v)] == [9]  # replayed from step 4, finite ever since

    # The rollback lost nothing: the run ends bit for bit where an uninterrupted run ends.
    assert _segment(clean, 12).returncode == exitcodes.EXIT_OK
    assert _final_state(faulty) == _final_state(clean)


def test_a_resume_after_a_kill_skips_an_unhealthy_latest_checkpoint(tmp_path: Path):
    work = tmp_path / "w"
    killed = _segment(work, 12, faults="nan@8,kill@10", policy=UNWATCHED_POLICY)
    assert killed.returncode == -9, killed.stderr[-3000:]
    infos = {i.step: i for i in open_store(work / "checkpoints").list()}
    assert sorted(infos) == [4, 8]
    assert infos[4].healthy and not infos[8].healthy  # marked when taken, durable in the manifest
    assert "model.head.weight" in infos[8].nonfinite

    resumed = _segment(work, 12, policy=UNWATCHED_POLICY)  # a plain resume: the plan names no checkpoint
    assert resumed.returncode == exitcodes.EXIT_OK, resumed.stderr[-3000:]
    assert _points(work, 1, "rollback.restored_step") == [(4, 4.0)]
    assert "Not restoring checkpoint" in resumed.stderr and infos[8].id in resumed.stderr
    assert all(math.isfinite(v) for _, v in _points(work, 1, "loss"))
