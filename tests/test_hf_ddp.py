"""The Hugging Face Trainer under DDP: `torchrun --nproc_per_node=2 examples/hf_tiny_gpt.py` (gloo on CPU).

accelerate gives each rank a `BatchSamplerShard` of the Trainer's seeded shuffled order (256 windows at batch
8 over 2 ranks: an epoch is 16 steps); the callback follows each rank's share of it. Checkpoints every 10 steps,
written synchronously by rank 0 with every rank's RNG streams and data position. Three lineages:

- the reference, uninterrupted;
- a NaN at step 13, relaunched from checkpoint 10 without skip or LR change (the Trainer cannot be rewound in
  process, see docs/integrations.md), then a SIGKILL of rank 1 at step 22 and a relaunch from checkpoint 20:
  every tensor of the final checkpoint equals the reference's, and every logged loss, bit for bit;
- on two torchrun nodes of one rank each: a NaN relaunched with 5 batches skipped at half the LR, then node 1
  lost whole (agent and rank) and both nodes relaunched from one commit: every rank skipped 5 batches of its
  share, and each step after the target trains on the reference's batch 5 further on, at exactly half its LR.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.flowkit import live_series
from tests.nodekit import run_of, supervise_lineage
from tests.test_standby_torchrun import assert_equal_tree

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HF = str(REPO / "examples" / "hf_tiny_gpt.py")
POLICY = REPO / "tests" / "data" / "policies" / "hf-sync.yaml"
STEPS = 24


def supervise(
    work: Path,
    lineage: str,
    *,
    faults: str = "",
    edits: dict[str, str] | None = None,
    nodes: int = 1,
    kill_node_after: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One lineage of the example on 2 ranks (one torchrun node, or `nodes=2` of one rank each) under
    hf-sync.yaml with `edits` (old -> new text); see tests.nodekit.supervise_lineage."""
    text = POLICY.read_text()
    for old, new in (edits or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    command = (sys.executable, HF, "--steps", str(STEPS), "--cpu", "--threads", "1")
    launcher = "nodes" if nodes == 2 else "torchrun"
    return supervise_lineage(
        work, lineage, command, text, faults=faults, launcher=launcher, kill_node_after=kill_node_after
    )


run = run_of


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-ddp") / "work"


@pytest.fixture(scope="module")
def reference(work):
    rec, final = supervise(work, "reference")
    assert rec["status"] == "finished" and len(rec["segments"]) == 1, rec["segments"][-1]
    keys = ("loss", "learning_rate", "data.batch", "data.sample")
    return rec, final, {key: live_series(run(rec), key) for key in keys}


def test_a_nan_relaunch_and_a_sigkill_of_rank_1_resume_bit_identically(reference, work):
    _, clean, series = reference
    assert sorted(clean["ranks"]) == ["0", "1"] and clean["optimizer"]["state"]
    replay = {"skip_batches: 5": "skip_batches: 0", "lr_scale: 0.5": "lr_scale: 1.0"}
    rec, final = supervise(work, "faulted", faults="nan@13,kill@22:rank1", edits=replay)
    assert rec["status"] == "finished", rec["segments"][-1]
    nan, killed, last = rec["segments"]
    assert nan["returncode"] == 76 and nan["event"]["type"] == "non_finite"
    assert killed["restore"]["checkpoint_id"].startswith("0000000010-") and killed["restore"]["rollback"]
    assert killed["event"]["evidence"]["rule"] == "torchrun_child_sigkill", killed["event"]
    assert last["restore"]["checkpoint_id"].startswith("0000000020-") and last["start_step"] == 20
    loss = live_series(run(rec), "loss")
    assert [loss[s] for s in range(1, STEPS + 1)] == [series["loss"][s] for s in range(1, STEPS + 1)]
    assert_equal_tree(clean, final)


def test_a_nan_relaunched_with_a_skip_then_a_lost_node_resume_on_every_rank_exactly(reference, work):
    """Two torchrun nodes of one rank each (c10d on 127.0.0.1). A NaN at step 13: every rank stops (exit 76) and
    the group is relaunched from checkpoint 10 skipping 5 batches at half the LR; then rank 1 stalls at step 22
    and its whole node (agent and rank) is SIGKILLed: one event (a lost node), one decision (resume), both
    nodes relaunched from checkpoint 20 of the new branch. Every step after the target trains on the
    reference's batch 5 further on, across both relaunches, at exactly half its LR."""
    _, _, clean = reference
    rec, final = supervise(work, "nodes", faults="nan@13,hang@22:rank1", nodes=2, kill_node_after=20)
    assert rec["status"] == "finished", rec["segments"][-1]
    nan, lost, last = rec["segments"]
    assert nan["returncode"] == 76 and nan["event"]["type"] == "non_finite"
    restore = lost["restore"]
    assert restore["checkpoint_id"].startswith("0000000010-")
    assert (restore["skip_batches"], restore["lr_scale"], restore["rollback"]) == (5, 0.5, True)
    event = lost["event"]
    assert event["type"] == "hardware_fault" and event["evidence"]["kind"] == "node_lost", event
    assert event["evidence"]["node"] == 1 and lost["decision"]["action"] == "resume"
    assert not last["event"] and not lost["in_process"] and not last["in_process"]  # one event, one decision
    assert last["restore"]["checkpoint_id"].startswith("0000000020-") and last["start_step"] == 20
    result = run(rec)
    for rank in (0, 1):  # each rank skipped 5 batches of its own share
        assert live_series(result, f"rollback.rank{rank}.batches_skipped")[10] == 5
    assert [final["ranks"][r]["data"]["batches"] for r in ("0", "1")] == [STEPS + 5] * 2
    batches, samples = live_series(result, "data.batch"), live_series(result, "data.sample")
    assert [batches[s] for s in range(11, STEPS - 4)] == [
        clean["data.batch"][s + 5] for s in range(11, STEPS - 4)
    ]
    assert [samples[s] for s in range(11, STEPS - 4)] == [
        clean["data.sample"][s + 5] for s in range(11, STEPS - 4)
    ]
    lr = live_series(result, "learning_rate")
    assert [lr[s] for s in range(1, 11)] == [clean["learning_rate"][s] for s in range(1, 11)]
    assert [lr[s] for s in range(11, STEPS + 1)] == [
        clean["learning_rate"][s] * 0.5 for s in range(11, STEPS + 1)
    ]
