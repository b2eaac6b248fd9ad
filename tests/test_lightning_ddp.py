"""Lightning under DDP: `examples/lightning_cnn.py --devices 2 --strategy ddp` (gloo on CPU), supervised end to end.

Two ranks, a plain shuffled `DataLoader` that Lightning gives a `DistributedSampler` (each rank reads 128 of the
256 images: an epoch is 8 steps), checkpoints every 6 steps (6 and 18 fall mid-epoch). Three lineages:

- the reference, launched by torchrun;
- started by Lightning's own launcher instead (rank 0 runs the script again for rank 1): a NaN at step 9 rolled
  back in process on both ranks without skip or LR change (so the replay must be the same steps), then a
  SIGKILL of rank 1 at step 21 (rank 0 fails on the lost peer) and a relaunch of the group; every tensor of its
  final checkpoint (model, optimizer, scheduler, loop counters, each rank's RNG streams and data position)
  equals the reference's bit for bit;
- on two torchrun nodes of one rank each: a NaN rolled back in process with 5 batches skipped at half the LR,
  then node 1 lost whole (agent and rank) and both nodes relaunched from one commit: each rank's logged sample
  indices stay 5 batches ahead of the reference's, and every LR after the target is exactly half of its.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import REPO
from tests.flowkit import live_series
from tests.nodekit import run_of, supervise_lineage
from tests.test_standby_torchrun import assert_equal_tree

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLE = str(REPO / "examples" / "lightning_cnn.py")
POLICY = REPO / "tests" / "data" / "policies" / "lightning.yaml"
STEPS = 24
PER_EPOCH = 8  # 256 images, 2 ranks, batches of 16


def command(strategy: str, nodes: int = 1) -> tuple[str, ...]:
    return (sys.executable, EXAMPLE, "--steps", str(STEPS), "--val-every", "12", "--plain-loader",
            "--batch-counter", "--threads", "1", "--devices", str(2 // nodes), "--num-nodes", str(nodes),
            "--strategy", strategy)  # fmt: skip


def supervise(
    work: Path,
    lineage: str,
    *,
    faults: str = "",
    launcher: str = "lightning",
    strategy: str = "ddp",
    edits: dict[str, str] | None = None,
    stored: bool = True,
    kill_node_after: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One lineage under tests/data/policies/lightning.yaml, checkpointing every 6 steps synchronously, with
    `edits` (old text -> new) applied to it. `launcher`: "lightning" (its own launcher), "torchrun" (one node
    of 2 ranks) or "nodes" (2 torchrun nodes of 1 rank); see tests.nodekit.supervise_lineage."""
    text = (
        POLICY.read_text().replace("every_steps: 8", "every_steps: 6").replace("async: true", "async: false")
    )
    for old, new in (edits or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    return supervise_lineage(
        work,
        lineage,
        command(strategy, 2 if launcher == "nodes" else 1),
        text,
        faults=faults,
        launcher="own" if launcher == "lightning" else launcher,
        kill_node_after=kill_node_after,
        stored=stored,
    )


run = run_of


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lightning-ddp") / "work"


@pytest.fixture(scope="module")
def reference(work):
    rec, final = supervise(work, "reference", launcher="torchrun")
    series = {key: live_series(run(rec), key) for key in ("loss", "lr", "sample.rank0", "sample.rank1")}
    return rec, final, series


def test_the_reference_runs_both_ranks_to_the_end(reference):
    rec, final, series = reference
    assert rec["status"] == "finished" and [s["outcome"] for s in rec["segments"]] == ["finished"]
    assert rec["final_checkpoint"].startswith(f"{STEPS:010d}-")
    assert sorted(final["ranks"]) == ["0", "1"]  # each rank's own RNG streams and data position
    # Lightning's DistributedSampler gave the ranks different halves of the data.
    assert all(series["sample.rank0"][s] != series["sample.rank1"][s] for s in range(1, STEPS + 1))


def test_nan_replay_then_sigkill_of_rank_1_is_bit_identical_to_the_torchrun_reference(reference, work):
    _, clean, series = reference
    replay = {"skip_batches: 5": "skip_batches: 0", "lr_scale: 0.5": "lr_scale: 1.0"}
    rec, final = supervise(work, "faulted", faults="nan@9,kill@21:rank1", edits=replay)
    assert rec["status"] == "finished", rec["segments"][-1]
    first, second = rec["segments"]
    (incident,) = first["in_process"]
    assert incident["event"]["type"] == "non_finite" and incident["event"]["onset_step"] == 10
    assert incident["decision"]["target_step"] == 6
    # Lightning's launcher has no agent to report the lost rank: rank 0's next collective fails on it.
    assert first["event"]["evidence"]["rule"] == "peer_rank_lost", first["event"]
    # Checkpoint 18 (two batches into epoch 3) was the newest committed when rank 1 died at step 21.
    assert second["restore"]["checkpoint_id"].startswith("0000000018-") and second["start_step"] == 18
    loss = live_series(run(rec), "loss")
    assert [loss[s] for s in range(1, STEPS + 1)] == [series["loss"][s] for s in range(1, STEPS + 1)]
    assert_equal_tree(clean, final)
    assert clean["optimizer"]["state"]  # the comparison can fail: there is optimizer state to compare


def test_a_nan_rolled_back_on_both_ranks_then_a_lost_node_resumes_the_skip_and_lr_scale_exactly(
    reference, work
):
    """Two torchrun nodes of one rank each (c10d on 127.0.0.1). A NaN at step 13 is rolled back in process on
    both ranks to checkpoint 12, skipping 5 batches at half the LR; then rank 1 stalls at step 21 and its whole
    node (agent and rank) is SIGKILLed: one event (a lost node), one decision (resume), both nodes relaunched
    from checkpoint 18 of the new branch. Each rank's samples stay 5 batches ahead of the reference, across the
    relaunch too, and every LR from step 13 on is exactly half the reference's."""
    _, _, clean = reference
    rec, final = supervise(work, "nodes", faults="nan@13,hang@21:rank1", launcher="nodes", kill_node_after=18)
    assert rec["status"] == "finished", rec["segments"][-1]
    lost, last = rec["segments"]
    (incident,) = lost["in_process"]  # the NaN, handled in process on both ranks
    decision = incident["decision"]
    assert (decision["target_step"], decision["skip_batches"], decision["lr_scale"]) == (12, 5, 0.5)
    event = lost["event"]
    assert event["type"] == "hardware_fault" and event["evidence"]["kind"] == "node_lost", event
    assert event["evidence"]["node"] == 1 and lost["decision"]["action"] == "resume"
    assert not last["event"] and not last["in_process"]  # the node's loss: one event, one decision
    assert last["restore"]["checkpoint_id"].startswith("0000000018-") and last["start_step"] == 18
    result = run(rec)
    for key in ("sample.rank0", "sample.rank1"):
        sample = live_series(result, key)
        assert sorted(sample) == list(range(1, STEPS + 1))
        assert [sample[s] for s in range(1, 13)] == [clean[key][s] for s in range(1, 13)], key
        # From the target on, each rank trains on its own batches 5 further on, before and after the relaunch.
        assert [sample[s] for s in range(13, 20)] == [clean[key][s] for s in range(18, 25)], key
        assert len({sample[s] for s in range(13, 20)}) == 7
    lr = live_series(result, "lr")
    assert [lr[s] for s in range(1, 13)] == [clean["lr"][s] for s in range(1, 13)]
    assert [lr[s] for s in range(13, STEPS + 1)] == [clean["lr"][s] * 0.5 for s in range(13, STEPS + 1)]
    for rank in (0, 1):  # what each rank had after the in-process restore, as rank 0 logged it
        assert live_series(result, f"rollback.rank{rank}.batches_skipped")[12] == 5
        # Restored to the end of step 12, the optimizer holds the LR of step 13 (exact in float64; the module
        # logs the LR through Lightning as float32, where halving is exact too).
        applied = live_series(result, f"rollback.rank{rank}.lr")[12]
        assert float(torch.tensor(applied, dtype=torch.float32)) == clean["lr"][13] * 0.5
    assert [final["ranks"][r]["data"]["batches_skipped"] for r in ("0", "1")] == [5, 5]
