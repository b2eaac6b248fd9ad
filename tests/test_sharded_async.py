"""Asynchronous sharded saves and the per-rank memory ring (issue 17, slice 5): FSDP2 on 2 real torchrun
processes over gloo. Each rank copies its shards into reused host buffers and its writer thread writes them
over the checkpoint group while training goes on; restores from disk and from memory give back, bit for bit
(torch.equal), the state cloned at the save; an in-process rollback under the Session restores from every
rank's ring; a background save that fails on one rank is reported on both, and training goes on."""

from __future__ import annotations

import json
import os
import subprocess
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
CHILD = REPO / "tests" / "sharded_workers" / "async_child.py"
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # real multi-process runs


def test_async_saves_while_training_restore_bit_exactly_from_disk_and_memory_in_reused_buffers(
    tmp_path: Path,
):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(CHILD)]
    done = subprocess.run(
        [*cmd, "save", str(tmp_path), str(tmp_path / "store")],
        cwd=REPO,
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-5000:]
    reports = [json.loads((tmp_path / f"save.rank{r}.json").read_text()) for r in (0, 1)]
    ids = reports[0]["ids"]
    assert len(ids) == 4 and reports[1]["ids"] == ids  # every rank names each save alike
    for report in reports:
        assert report["writing_after_submit"] == [True] * 4  # save() returned before the write ended
        assert report["writing_after_wait"] is False
        assert report["reused"] and report["distinct"]  # 2 slots: saves 1 and 3 in one, 2 and 4 in the other
        assert report["held"] == [False, False, True, True]
        # Against the local shards and RNG state cloned when each save was asked for, training having
        # changed the live state meanwhile: from disk, from memory, and from disk once memory no longer has it.
        assert report["restored"] == {
            "disk_second": True,
            "memory_last": True,
            "fallback_first": True,
            "disk_last": True,
        }
        # An overlapped save: the copy ran beside the next forward and backward, the optimizer's step waited
        # for it, and the ring and the disk hold the state of the save, not the one after the step.
        overlap = report["overlap"]
        assert overlap["pending_after_save"] and overlap["waited_s"] > 0.1 and overlap["live_moved"]
        assert overlap["memory"] is True and overlap["disk"] is True
        # A capture that failed on rank 1 alone: the save failed on both ranks (a BackgroundSaveError at the
        # next wait; the blocking save raised on both), and the next save committed in step and restores exactly.
        failed = report["capture_failure"]
        assert failed["async_error"] == "BackgroundSaveError"
        assert failed["blocking_error"] == ("MemoryError" if report["rank"] == 1 else "CheckpointError")
        assert failed["committed"] == [failed["last"]] and failed["restored"] is True
        timing = report["timing"]
        assert timing["async"] < timing["sync"], timing
    for rank in (0, 1):
        assert f"Restored sharded checkpoint {ids[3]} from memory on rank {rank}" in logs
        assert f"Restored sharded checkpoint {ids[0]} from disk on rank {rank}" in logs
    assert f"Restoring {ids[0]} from disk, not memory" in logs
    # Every save was committed, by both ranks, each its own shards.
    for cid in ids:
        manifest = json.loads((tmp_path / "store" / f"ckpt-{cid}" / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and sorted(manifest["rank_files"]) == ["0", "1"]


def supervise(
    workdir: Path, steps: int, *, faults: str = "", fail: bool = False
) -> tuple[LineageRecord, Path, str]:
    """One lineage of the child's Session mode under torchrun (the fast policy: async saves every 20 steps, 2
    memory slots); returns its record, the child's output folder and every line the ranks printed."""
    from supervisor.orchestrator import LineageRunner, RunOptions

    out = workdir / "out"
    out.mkdir(parents=True)
    env = dict(ENV)
    if faults:
        env["ROLLBACK_SUPERVISOR_FAULTS"] = faults
    command = [sys.executable, str(CHILD), "session", str(steps), str(out)] + (["fail"] if fail else [])
    options = RunOptions(
        command=tuple(command),
        policy_path=str(FAST_POLICY),
        lineage="fsdp-async",
        workdir=workdir / "wd",
        stop_grace_seconds=10,
        env=env,
        launcher=TorchrunLauncher(TorchrunOptions(nproc_per_node=2)),
    )
    lines: list[str] = []
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_line=lambda s, line: lines.append(line))
    return record, out, "\n".join(lines)


def ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_nan_under_fsdp2_rolls_back_in_process_from_every_ranks_memory_ring(tmp_path: Path):
    record, out, logs = supervise(tmp_path, 50, faults="nan@45")
    assert record.status == "finished", logs[-5000:]
    (segment,) = record.segments  # no relaunch: the same processes rolled back and finished
    assert segment.outcome == "finished"
    (handled,) = segment.in_process
    assert handled["event"]["type"] == "non_finite" and handled["decision"]["action"] == "rollback"
    target = handled["decision"]["target_id"]
    assert target.startswith("0000000020-")
    for rank in (0, 1):  # each rank copied its own shards back from its ring, with no disk read
        assert f"Restored sharded checkpoint {target} from memory on rank {rank}" in logs
    assert "from disk, not memory" not in logs  # (the child's own check below reads the disk on purpose)
    reports = ranks(out)
    assert len({r["pid"] for r in reports}) == 2
    for report in reports:  # rank 0's skip and LR scale on every rank; the memory restore equals the disk's
        assert report["rollbacks_in_process"] == 1 and report["step"] == 50
        assert report["batches_skipped"] == 7
        assert report["same_as_disk"] is True
    assert reports[0]["lr"] == reports[1]["lr"]
    assert "lr_scale" in json.dumps(handled["decision"]) and handled["decision"]["lr_scale"] == 0.5
    checkpoints = Path(record.storage["checkpoints"])
    final = json.loads((checkpoints / f"ckpt-{record.final_checkpoint}" / "manifest.json").read_text())
    assert final["world_size"] == 2 and final["nonfinite"] == []
    final_state = load_file(out / "final.safetensors")
    assert all(t.isfinite().all() for t in final_state.values() if t.is_floating_point())
    assert len(final_state) > 10 and all(isinstance(t, torch.Tensor) for t in final_state.values())


def test_a_background_save_failing_on_one_rank_is_reported_on_both_and_training_goes_on(tmp_path: Path):
    record, out, logs = supervise(tmp_path, 45, fail=True)
    assert record.status == "finished", logs[-5000:]
    (segment,) = record.segments
    assert segment.outcome == "finished"
    reports = ranks(out)
    assert [r["step"] for r in reports] == [45, 45]
    assert reports[0]["save_failures"] == 1  # rank 0 reports it for the run: log, MLflow, events.jsonl
    assert "checkpoint not saved at step 40, training goes on" in logs
    assert "No space left on device" in logs
    assert "checkpoint not saved on rank 1, training goes on (rank 0 reports it)" in logs
    checkpoints = Path(record.storage["checkpoints"])
    steps = sorted(int(p.name[5:15]) for p in checkpoints.glob("ckpt-*") if (p / "COMMITTED").exists())
    assert 20 not in steps and 40 in steps and 45 in steps, steps  # the failed one only
    # The supervisor got exactly one report, from rank 0, of the failed save: training went on without it.
    (failed,) = segment.save_failures or []
    assert failed["kind"] == "save_failed" and "No space left on device" in failed["event"]["reason"]
