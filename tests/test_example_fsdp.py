"""examples/fsdp_charlm.py (issue 17, docs): the standard workload sharded with FSDP2, under
`rollback-supervisor run` and torchrun with 2 gloo processes. One run meets a SIGKILL of rank 1, relaunched
from the last sharded commit, then a NaN, rolled back in process on both ranks (no relaunch), and finishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.flowkit import FAST_POLICY, record

CLI = Path(sys.executable).with_name("rollback-supervisor")
EXAMPLE = str(REPO / "examples" / "fsdp_charlm.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
SMALL = ["--batch-size", "8", "--data", str(REPO / "tests" / "data" / "corpus-30k.txt"), "--threads", "1"]
STEPS = 30


def policy(tmp_path: Path, extra: str = "") -> Path:
    """The fast test policy, checkpointing every 10 steps (plus `extra` checkpoint keys), its rollback target any
    checkpoint before the NaN."""
    text = FAST_POLICY.read_text()
    assert "every_steps: 20" in text and "lookback_steps: 20" in text
    path = tmp_path / "fast-10.yaml"
    path.write_text(
        text.replace("every_steps: 20", "every_steps: 10" + extra).replace(
            "lookback_steps: 20", "lookback_steps: 0"
        )
    )
    return path


pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # real multi-process runs


def assert_kill_then_nan(example: str, policy_path: Path, lineage: str, tmp_path: Path) -> None:
    """`rollback-supervisor run` of `example` under torchrun (2 ranks): a SIGKILL of rank 1 at step 15 is
    relaunched from the last sharded commit, a NaN at step 25 is rolled back in process on both ranks, and the
    run finishes with every checkpoint sharded and verified."""
    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "ROLLBACK_SUPERVISOR_FAULTS": "kill@15:rank1,nan@25",
    }
    workdir = tmp_path / "w"
    command = [*TORCHRUN, example, "--steps", str(STEPS), "--eval-every", "10", "--eval-batches", "1", *SMALL]
    proc = subprocess.run(
        [str(CLI), "run", "--policy", str(policy_path), "--lineage", lineage, "--workdir", str(workdir),
         "--stop-grace", "10", "--", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = record(workdir, lineage)
    assert rec["status"] == "finished", rec["segments"][-1]
    killed, last = rec["segments"]

    # The SIGKILL of rank 1 at step 15: torchrun's report names it; every rank relaunched from step 10.
    assert killed["returncode"] != 0 and killed["event"]["evidence"]["rule"] == "torchrun_child_sigkill"
    assert killed["decision"]["action"] == "resume"
    assert last["restore"]["checkpoint_id"].startswith("0000000010-")
    # The NaN at step 25: both ranks agreed, restored their own shards of a checkpoint before it, skipped 7
    # batches at half the LR and finished in the same processes (no third segment).
    (handled,) = last["in_process"]
    assert handled["event"]["type"] == "non_finite" and handled["decision"]["action"] == "rollback"
    assert handled["decision"]["target_id"][:10] in ("0000000010", "0000000020"), handled["decision"]
    assert handled["decision"]["skip_batches"] == 7 and handled["decision"]["lr_scale"] == 0.5
    assert last["outcome"] == "finished"

    # Every checkpoint is sharded (each rank wrote its own blob and rank file) and verifies in full.
    checkpoints = Path(rec["storage"]["checkpoints"])
    manifest = json.loads((checkpoints / f"ckpt-{rec['final_checkpoint']}" / "manifest.json").read_text())
    assert rec["final_checkpoint"].startswith("0000000030-")
    assert manifest["world_size"] == 2 and sorted(manifest["rank_files"]) == ["0", "1"]
    blobs = [f["path"] for f in manifest["files"] if f["path"].startswith("blobs/")]
    assert any(".r0." in b for b in blobs) and any(".r1." in b for b in blobs)
    verify = subprocess.run(
        [str(CLI), "checkpoints", "verify", str(checkpoints)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0 and "INVALID" not in verify.stdout, verify.stdout + verify.stderr


def test_fsdp_example_resumes_a_killed_rank_then_rolls_back_a_nan_in_process(prefect_harness, tmp_path: Path):
    assert_kill_then_nan(EXAMPLE, policy(tmp_path), "fsdp", tmp_path)
