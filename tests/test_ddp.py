"""Supervision under DDP: torchrun with 2 gloo processes on CPU, through the real flow, with real faults.

Rank 0 writes every checkpoint with each rank's RNG streams and data position under `ranks.<r>`; every rank
restores the one rank 0 names; a SIGTERM and a SIGKILL of rank 1 are classified from torchrun's report
and resumed bit-identically; a NaN is reported by rank 0 and rolled back in process with the skip and LR scale applied on both ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from supervisor.runtime.faults import Fault, fired_path_for, parse_faults
from supervisor.runtime.plan import PLAN_ENV
from tests.flowkit import (
    CHARLM,
    FAST_POLICY,
    assert_same_state,
    history,
    live_series,
    record,
    stored_state,
)

STEPS = 60
BATCH = 8
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def run_ddp(workdir: Path, faults: str = "") -> dict[str, Any]:
    """The real Prefect flow supervising `torchrun --nproc_per_node=2 examples/charlm.py`."""
    from flows.supervised import supervised_training

    command = [*TORCHRUN, CHARLM, "--steps", str(STEPS), "--eval-every", "20", "--batch-size", str(BATCH)]
    return supervised_training(
        command=[*command, "--threads", "1"],
        policy=str(FAST_POLICY),
        lineage="ddp",
        workdir=str(workdir),
        stop_grace_seconds=15,
        env={"ROLLBACK_SUPERVISOR_FAULTS": faults} if faults else {},
    )


def load_rank(checkpoint_dir: Path, checkpoint_id: str, rank: int) -> dict[str, Any]:
    """Restore a DDP checkpoint as rank `rank` would (read-only); the test process's RNG is left as it was."""
    import charlm

    from supervisor.runtime.distributed import ReadOnlyCheckpoints
    from supervisor.state import TrainingState, capture_rng, restore_rng

    saved_rng = capture_rng()
    try:
        args = charlm.parse_args(["--steps", str(STEPS), "--batch-size", str(BATCH)])
        model, opt, sched, loader, _ = charlm.build(args, rank, 2)
        state = TrainingState()
        state.rank = rank
        for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched), ("data", loader)):
            state.register(name, obj)
        info = ReadOnlyCheckpoints(checkpoint_dir, state).restore(checkpoint_id)
        return {
            "step": info.step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "data": loader.state_dict(),
            "next_batch": next(iter(loader))[0],
        }
    finally:
        restore_rng(saved_rng)


def stored_ranks(checkpoint_dir: Path, checkpoint_id: str) -> dict[str, Any]:
    """The `ranks` subtree of a checkpoint as stored (read with a bare state, nothing registered)."""
    return stored_state(checkpoint_dir, checkpoint_id)["ranks"]


def training_processes(workdir: Path) -> list[psutil.Process]:
    """Live processes launched with a plan from under `workdir` (torchrun and its workers)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(PLAN_ENV, "").startswith(str(workdir)) and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def uninterrupted(prefect_harness, tmp_path_factory) -> dict[str, Any]:
    """One clean 2-rank run, shared by the tests below."""
    workdir = tmp_path_factory.mktemp("ddp-clean")
    result = run_ddp(workdir)
    assert result["status"] == "finished", result
    rec = record(workdir, "ddp")
    assert [s["outcome"] for s in rec["segments"]] == ["finished"]
    return {"result": result, "dir": Path(rec["storage"]["checkpoints"]), "id": result["final_checkpoint"]}


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_and_sigkill_of_one_rank_are_classified_and_resumed_bit_identically(
    uninterrupted, tmp_path: Path
):
    result = run_ddp(tmp_path, faults="term@30:rank1,kill@45:rank1")
    assert result["status"] == "finished", result
    rec = record(tmp_path, "ddp")
    termed, killed, last = rec["segments"]
    checkpoints = Path(rec["storage"]["checkpoints"])

    # SIGTERM reached rank 1 only; every rank agreed to stop, rank 0 wrote the emergency checkpoint at
    # step 30 with both ranks' state, every rank exited 75, and torchrun's report names that exit.
    assert termed["event"]["type"] == "preemption", termed["event"]
    assert termed["event"]["evidence"]["rule"] == "torchrun_child_preempted"
    assert termed["decision"]["action"] == "resume"
    assert killed["restore"]["checkpoint_id"].startswith("0000000030-")
    assert sorted(stored_ranks(checkpoints, killed["restore"]["checkpoint_id"])) == ["0", "1"]

    # SIGKILL of rank 1: torchrun tears rank 0 down and exits 1; the report's root cause is the SIGKILL.
    assert killed["returncode"] != 0
    assert killed["event"]["type"] == "unknown_exit", killed["event"]
    assert killed["event"]["evidence"]["rule"] == "torchrun_child_sigkill"
    assert killed["decision"]["action"] == "resume"
    assert last["restore"]["checkpoint_id"].startswith("0000000040-")
    assert last["outcome"] == "finished"
    assert not training_processes(tmp_path)

    # Both ranks restored their own state each time: the finish equals the clean run's, bit for bit.
    for rank in (0, 1):
        a = load_rank(uninterrupted["dir"], uninterrupted["id"], rank)
        b = load_rank(checkpoints, result["final_checkpoint"], rank)
        assert_same_state(a, b)
        assert torch.equal(a["torch_rng"], b["torch_rng"])
        assert torch.equal(a["next_batch"], b["next_batch"])
    la, lb = live_series(uninterrupted["result"], "loss"), live_series(result, "loss")
    assert [la[s] for s in range(21, STEPS + 1)] == [lb[s] for s in range(21, STEPS + 1)]


@pytest.mark.e2e
@pytest.mark.slow
def test_checkpoint_holds_each_ranks_stream_and_rank1_gets_its_own_back(uninterrupted):
    ranks = stored_ranks(uninterrupted["dir"], uninterrupted["id"])
    assert sorted(ranks) == ["0", "1"]
    assert not torch.equal(ranks["0"]["rng"]["torch"], ranks["1"]["rng"]["torch"])
    assert not torch.equal(ranks["0"]["data"]["generator"], ranks["1"]["data"]["generator"])
    zero = load_rank(uninterrupted["dir"], uninterrupted["id"], 0)
    one = load_rank(uninterrupted["dir"], uninterrupted["id"], 1)
    assert torch.equal(one["torch_rng"], ranks["1"]["rng"]["torch"])
    assert torch.equal(zero["torch_rng"], ranks["0"]["rng"]["torch"])
    assert torch.equal(one["data"]["generator"], ranks["1"]["data"]["generator"])
    assert not torch.equal(zero["next_batch"], one["next_batch"])  # each rank reads its own shard
    assert_same_state(zero, one)  # the replicated parts are one copy


@pytest.mark.e2e
@pytest.mark.slow
def test_nan_under_ddp_rolls_back_in_process_with_skip_and_lr_scale_on_both_ranks(
    uninterrupted, tmp_path: Path
):
    result = run_ddp(tmp_path, faults="nan@45")
    assert result["status"] == "finished", result
    rec = record(tmp_path, "ddp")
    (segment,) = rec["segments"]  # no relaunch: both ranks rolled back in their own processes
    assert segment["outcome"] == "finished"
    (handled,) = segment["in_process"]
    assert handled["event"]["type"] == "non_finite" and handled["event"]["onset_step"] == 46
    assert handled["decision"]["action"] == "rollback"
    # palm-spike shape: the best val_loss checkpoint at least 20 steps before the onset (46 - 20 = 26).
    assert handled["decision"]["target_id"].startswith("0000000020-")
    assert handled["decision"]["skip_batches"] == 7 and handled["decision"]["lr_scale"] == 0.5
    assert not training_processes(tmp_path)
    reports = [json.loads(line) for line in (tmp_path / "lineages" / "ddp" / "events.jsonl").open()]
    assert reports and {r["event"]["type"] for r in reports} == {"non_finite"}
    assert len({r["pid"] for r in reports}) == 1  # rank 0 alone reports

    # What each rank actually had after restoring (logged by rank 0 for every rank).
    lr_before = min((t, v) for s, v, t in history(result, "lr") if s == 20)[1]
    for rank in (0, 1):
        assert live_series(result, f"rollback.rank{rank}.batches_skipped")[20] == 7
        assert live_series(result, f"rollback.rank{rank}.lr")[20] == pytest.approx(lr_before * 0.5, rel=1e-12)
    # And in the final checkpoint, each rank's own loader counted the skipped batches.
    ranks = stored_ranks(Path(rec["storage"]["checkpoints"]), result["final_checkpoint"])
    assert [ranks[r]["data"]["batches_skipped"] for r in ("0", "1")] == [7, 7]
    loss = live_series(result, "loss")
    assert all(loss[s] == loss[s] for s in range(21, STEPS + 1))  # no NaN on the live branch


# -- unit level: fault targeting, per-rank packing, sharding ------------------------------------------


def test_fault_rank_qualifier_round_trips_and_targets_one_rank(tmp_path: Path):
    faults = parse_faults("nan@3, kill@7:rank1")
    assert faults == [Fault("nan", 3), Fault("kill", 7, 1)]
    assert [f.key for f in faults] == ["nan@3", "kill@7:rank1"]
    from supervisor.runtime.faults import FaultInjector

    zero = FaultInjector(faults, tmp_path / "faults-fired.json", rank=0)
    one = FaultInjector(faults, tmp_path / "faults-fired.json", rank=1)
    assert zero.due(7, ("kill",)) is None and one.due(7, ("kill",)) == Fault("kill", 7, 1)
    assert zero.due(3, ("nan",)) == one.due(3, ("nan",)) == Fault("nan", 3)
    assert one.fired_path == fired_path_for(tmp_path / "faults-fired.json", 1)
    assert one.fired_path.name == "faults-fired.rank1.json"


@pytest.mark.parametrize("bad", ["kill@7:1", "kill@7:rank", "kill@7:rankx", "kill@7:node1"])
def test_fault_rank_qualifier_rejects_bad_items(bad: str):
    from supervisor.errors import UserError

    with pytest.raises(UserError, match="rankN"):
        parse_faults(bad)


def test_pack_state_round_trips_without_pickle():
    from supervisor.runtime.distributed import pack_state, unpack_state

    nested = {
        "rng": {"torch": torch.get_rng_state(), "python": {"state": [1, 2, 3], "gauss_next": None}},
        "data": {"generator": torch.Generator().manual_seed(3).get_state(), "batches_skipped": 7},
    }
    data = pack_state(nested)
    assert b"pickle" not in data and not data.startswith(b"\x80")
    back = unpack_state(data)
    assert torch.equal(back["rng"]["torch"], nested["rng"]["torch"])
    assert torch.equal(back["data"]["generator"], nested["data"]["generator"])
    assert back["rng"]["python"] == nested["rng"]["python"] and back["data"]["batches_skipped"] == 7


def test_shards_are_disjoint_equal_and_cover_the_usable_data():
    from supervisor.data import ResumableLoader, shard

    data = list(range(11))
    parts = [list(shard(data, r, 2)) for r in range(2)]
    assert parts == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert shard(data, 0, 1) is data
    with pytest.raises(ValueError, match="rank"):
        shard(data, 2, 2)
    single = ResumableLoader(torch.arange(8), batch_size=2, shuffle=True, seed=5)
    reference = ResumableLoader(torch.arange(8), batch_size=2, shuffle=True, seed=5, rank=0, world_size=1)
    assert [b.tolist() for b in single] == [b.tolist() for b in reference]  # a single process is unchanged
    a = ResumableLoader(torch.arange(8), batch_size=2, shuffle=True, seed=5, rank=0, world_size=2)
    b = ResumableLoader(torch.arange(8), batch_size=2, shuffle=True, seed=5, rank=1, world_size=2)
    seen = [x for batch in [*a, *b] for x in batch.tolist()]
    assert sorted(seen) == list(range(8))


def test_rank1_refuses_a_single_process_checkpoint():
    from supervisor.errors import CheckpointError
    from supervisor.state import TrainingState

    state = TrainingState()
    state.rank = 1
    with pytest.raises(CheckpointError, match="no state for rank 1"):
        state.load_state_dict({"counters": {"step": 3}, "extras": {}})


_REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
/work/main/examples/charlm.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_05:18:03
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 24944)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 24944
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_05:18:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 24945)  ({name})
  error_file: <N/A>
  traceback : {traceback}
=======================================================
"""


@pytest.mark.parametrize(
    ("code", "name", "traceback", "expected", "rule"),
    [
        (
            "-9",
            "SIGKILL",
            "Signal 9 (SIGKILL) received by PID 24945",
            "unknown_exit",
            "torchrun_child_sigkill",
        ),
        (
            "75",
            "",
            "To enable traceback see: https://pytorch.org/docs",
            "preemption",
            "torchrun_child_preempted",
        ),
    ],
    ids=["rank-sigkilled", "rank-preempted"],
)
def test_torchrun_report_is_classified_by_its_root_cause(code, name, traceback, expected, rule):
    from supervisor.monitor import classify_exit

    report = _REPORT.replace("{code}", code).replace("{name}", name).replace("{traceback}", traceback)
    event = classify_exit(1, "Traceback (most recent call last):\n" + report)
    assert event is not None and event.type == expected and event.evidence["rule"] == rule
    # The rank torchrun tore down itself (SIGTERM, listed under "Failures:") is a consequence, not the cause.
    assert "torchrun_sigterm" not in event.evidence["matched_rules"]
