"""FSDP2 under `Session.register` (issue 17, slice 6): every rank saves and restores its own shards through the
store, never a gathered state. Real torchrun (2 gloo processes on CPU) under the real `LineageRunner`: a
SIGKILL of rank 1 after a checkpoint, the relaunch, and a finish bit-identical (torch.equal on every gathered
model and optimizer tensor, each rank's next batch and RNG draw) to an uninterrupted run."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from supervisor.launcher import TorchrunLauncher, TorchrunOptions
from supervisor.lineage.record import LineageRecord
from tests.flowkit import FAST_POLICY

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "session_child.py"
STEPS = 30  # the fast policy checkpoints every 20 steps
pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # real multi-process runs


def supervise(workdir: Path, faults: str = "", steps: int = STEPS) -> tuple[LineageRecord, Path]:
    """One lineage of the FSDP2 child under torchrun; returns its record and the child's output folder."""
    from supervisor.orchestrator import LineageRunner, RunOptions

    out = workdir / "out"
    out.mkdir(parents=True)
    env = {
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONFAULTHANDLER": "1",
    }
    if faults:
        env["ROLLBACK_SUPERVISOR_FAULTS"] = faults
    options = RunOptions(
        command=(sys.executable, str(CHILD), str(steps), str(out)),
        policy_path=str(FAST_POLICY),
        lineage="fsdp",
        workdir=workdir / "wd",
        stop_grace_seconds=10,
        env=env,
        launcher=TorchrunLauncher(TorchrunOptions(nproc_per_node=2)),
    )
    lines: list[str] = []
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_line=lambda s, line: lines.append(line))
    (out / "segments.log").write_text("\n".join(lines))
    return record, out


def finished(out: Path) -> dict[str, Any]:
    """What the child wrote when it finished: the gathered state and each rank's next batch and draw."""
    return {
        "tensors": load_file(out / "final.safetensors"),
        "skeleton": json.loads((out / "final.json").read_text()),
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)],
    }


def manifest(checkpoints: Path, checkpoint_id: str) -> dict[str, Any]:
    return json.loads((checkpoints / f"ckpt-{checkpoint_id}" / "manifest.json").read_text())


def test_sigkill_of_one_rank_then_relaunch_restores_every_ranks_shards_bit_identically(tmp_path: Path):
    clean_record, clean_out = supervise(tmp_path / "clean")
    assert clean_record.status == "finished", json.dumps(clean_record.segments[-1].event)[-5000:]
    record, out = supervise(tmp_path / "killed", faults="kill@25:rank1")
    assert record.status == "finished", record.segments[-1].event
    killed, last = record.segments
    assert killed.returncode != 0 and killed.decision and killed.decision["action"] == "resume"
    assert last.restore["checkpoint_id"].startswith("0000000020-")
    assert last.outcome == "finished"

    # The checkpoint each relaunch read was written by both ranks, each its own shards and rank file.
    checkpoints = Path(record.storage["checkpoints"])
    m = manifest(checkpoints, last.restore["checkpoint_id"])
    assert m["world_size"] == 2 and sorted(m["rank_files"]) == ["0", "1"]
    blobs = {f["path"].split("/")[-1] for f in m["files"] if f["path"].startswith("blobs/")}
    assert any(".r0." in b for b in blobs) and any(".r1." in b for b in blobs)

    a, b = finished(clean_out), finished(out)
    assert b["tensors"].keys() == a["tensors"].keys() and len(a["tensors"]) > 10
    assert [k for k in a["tensors"] if not torch.equal(a["tensors"][k], b["tensors"][k])] == []
    assert b["skeleton"] == a["skeleton"]
    for rank in (0, 1):  # each rank got its own RNG stream and data position back
        for key in ("step", "next_batch", "draw", "lr"):
            assert b["ranks"][rank][key] == a["ranks"][rank][key], (rank, key)
    assert a["ranks"][0]["next_batch"] != a["ranks"][1]["next_batch"]
    assert a["ranks"][0]["draw"] != a["ranks"][1]["draw"]


def test_nan_under_fsdp2_rolls_back_in_process_on_both_ranks_with_skip_and_lr_scale(tmp_path: Path):
    record, out = supervise(tmp_path, faults="nan@45", steps=50)
    assert record.status == "finished", record.segments[-1].event
    (segment,) = record.segments  # no relaunch: the same processes finished
    assert segment.outcome == "finished"
    (handled,) = segment.in_process
    assert handled["event"]["type"] == "non_finite" and handled["event"]["onset_step"] == 46
    assert handled["decision"]["action"] == "rollback"
    assert handled["decision"]["target_id"].startswith("0000000020-")
    ranks = finished(out)["ranks"]
    for report in ranks:  # each rank restored its own shards and applied rank 0's skip and LR scale
        assert report["rollbacks_in_process"] == 1 and report["step"] == 50
        assert report["batches_skipped"] == 7
    assert ranks[0]["lr"] == ranks[1]["lr"]
    checkpoints = Path(record.storage["checkpoints"])
    final = manifest(checkpoints, record.final_checkpoint)
    assert final["world_size"] == 2 and final["nonfinite"] == []
    assert all(t.isfinite().all() for t in finished(out)["tensors"].values() if t.is_floating_point())
