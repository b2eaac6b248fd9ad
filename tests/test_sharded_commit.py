"""The sharded commit protocol under faults: a SIGKILL of either rank at each phase of a save leaves the old
latest or the new one, never a mix; a hung rank is a RankLost within the group's timeout; a failed write is a
CheckpointError on every rank, and training saves again. Two real processes (gloo), real signals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from supervisor.checkpoint import open_store
from supervisor.checkpoint.local import TMP
from supervisor.checkpoint.sharded import ShardedCheckpoints
from supervisor.sharded_state import ShardedTrainingState
from tests.servers import free_port
from tests.sharded_workers import fsdp_child

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "commit_child.py"
TIMEOUT_S = 3.0  # the checkpoint group's collective timeout in the hang case
pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # real multi-process runs


def _run(out: Path, fault_rank: int, phase: str, kind: str) -> dict[int, dict]:
    """Both ranks, started by hand (no torchrun agent that would kill the survivor before it reports)."""
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
        }
        args = [sys.executable, str(CHILD), out, out / "store", fault_rank, phase, kind, TIMEOUT_S]
        procs.append(
            subprocess.Popen(
                list(map(str, args)), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    try:
        survivor = procs[1 - fault_rank] if kind == "hang" else None
        deadline = time.monotonic() + 120
        for p in [survivor] if survivor else procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:  # the hung rank, or anything left by a failure above
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = [p.stdout.read().decode(errors="replace")[-2000:] for p in procs if p.stdout]
    reports = {}
    for rank in (0, 1):
        path = out / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text())
    assert reports, logs
    return reports


def _restored_equals(out: Path, ref: str) -> str:
    """Open the store (its cleanup runs), restore latest at world 1 and compare with the gathered `ref`."""
    model, opt = fsdp_child.build(1, 1)
    with ShardedCheckpoints(out / "store") as ckpts:
        cid = ckpts.restore(ShardedTrainingState(model, opt))
        assert os.listdir(out / "store" / TMP) == []
        kept = ckpts.catalog.referenced_blobs()
        assert set(ckpts.catalog.blob_files()) == kept  # no blob of the broken save is left behind
    fsdp_child.gather(model, opt, str(out), "restored", 0)
    want, got = load_file(out / f"{ref}.safetensors"), load_file(out / "restored.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    return cid


@pytest.mark.parametrize(
    "fault_rank,phase,expect",
    [
        (0, "plan", "old"),  # rank 0 in the global plan: rank 1 waits for the scatter
        (1, "after_blob", "old"),  # its shards are staged, the gather never completes
        (0, "before_marker", "old"),  # every rank's files durable, manifest built, nothing renamed, no marker
        (0, "committed", "new"),  # marker written, killed before the result reaches rank 1
    ],
)
def test_a_sigkill_of_a_rank_mid_save_leaves_the_old_latest_or_the_new_one(
    tmp_path, fault_rank, phase, expect
):
    reports = _run(tmp_path, fault_rank, phase, "kill")
    survivor = reports[1 - fault_rank]
    assert fault_rank not in reports and survivor["save2_error"] == "RankLost", survivor
    assert survivor["save2_s"] < 30  # a dead peer is noticed at once, not at the timeout
    cid = _restored_equals(tmp_path, "ref2" if expect == "new" else "ref1")
    assert cid.startswith("0000000002-" if expect == "new" else "0000000001-")
    if expect == "old":
        assert cid == survivor["save1"]


def test_a_hung_rank_is_a_lost_rank_within_the_group_timeout(tmp_path):
    reports = _run(tmp_path, 1, "write_start", "hang")
    rank0 = reports[0]
    assert rank0["save2_error"] == "RankLost" and "relaunch" in rank0["save2_message"]
    assert TIMEOUT_S <= rank0["save2_s"] < 10 * TIMEOUT_S
    assert _restored_equals(tmp_path, "ref1") == rank0["save1"]


def test_a_failed_write_on_one_rank_fails_the_save_on_every_rank_and_training_saves_again(tmp_path):
    reports = _run(tmp_path, 1, "after_blob", "oserror")
    for rank in (0, 1):
        assert reports[rank]["save2_error"] == "CheckpointError", reports[rank]
        assert (
            "rank 1" in reports[rank]["save2_message"] and "No space left" in reports[rank]["save2_message"]
        )
        assert reports[rank]["save3"].startswith("0000000003-")
    assert reports[0]["save3"] == reports[1]["save3"]
    assert _restored_equals(tmp_path, "ref3") == reports[0]["save3"]


@pytest.mark.parametrize("phase", ["plan", "finish"])
def test_a_save_refused_by_rank_0s_gate_is_skipped_on_every_rank_in_lockstep(tmp_path, phase):
    """Only rank 0 decides, inside DCP's steps: before the write, or after it just before the commit."""
    reports = _run(tmp_path, 0, phase, "refuse")
    for rank in (0, 1):
        assert reports[rank]["save2"] is None and "save2_error" not in reports[rank], reports[rank]
        assert reports[rank]["save3"].startswith("0000000003-")
    assert _restored_equals(tmp_path, "ref3") == reports[0]["save3"]
    assert [i.step for i in open_store(tmp_path / "store").list()] == [1, 3]
