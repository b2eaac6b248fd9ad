"""Lightning with FSDP2: `examples/lightning_cnn.py --devices 2 --strategy fsdp2` (`ModelParallelStrategy`, each
block `fully_shard`ed over both ranks in `configure_model()`, gloo on CPU), supervised end to end.

Every rank writes its own shards of the module and the optimizer through our sharded store and rank 0 commits
once; a NaN at step 9 is rolled back in process on both ranks without skip or LR change (the replay must be the
same steps), then rank 1 is SIGKILLed at step 21 and the group is relaunched from checkpoint 18 (mid-epoch, an
epoch being 8 steps). Each rank's shards of every tensor in the final checkpoint, and each rank's own state
(RNG streams, data position, the loop's counters), equal those of a run that never stopped, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.test_lightning_ddp import STEPS, run, supervise

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def shards(checkpoints: Path, checkpoint_id: str) -> dict[str, Any]:
    """Everything a sharded checkpoint holds, by file: each rank's tensors, each rank's JSON state."""
    manifest = json.loads((checkpoints / f"ckpt-{checkpoint_id}" / "manifest.json").read_text())
    out: dict[str, Any] = {}
    for entry in manifest["files"]:
        path = checkpoints / entry["path"]
        name = path.name.replace(checkpoint_id, "<id>")
        out[name] = load_file(path) if path.suffix == ".safetensors" else json.loads(path.read_text())
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lightning-fsdp") / "work"


def test_sigkill_and_nan_replay_under_fsdp2_are_bit_identical_to_an_uninterrupted_run(work):
    clean_rec, _ = supervise(work, "reference", strategy="fsdp2", stored=False)
    assert clean_rec["status"] == "finished" and len(clean_rec["segments"]) == 1
    replay = {"skip_batches: 5": "skip_batches: 0", "lr_scale: 0.5": "lr_scale: 1.0"}
    rec, _ = supervise(
        work, "faulted", faults="nan@9,kill@21:rank1", strategy="fsdp2", edits=replay, stored=False
    )
    assert rec["status"] == "finished", rec["segments"][-1]
    first, second = rec["segments"]
    (incident,) = first["in_process"]
    assert incident["event"]["onset_step"] == 10 and incident["decision"]["target_step"] == 6
    assert first["event"]["evidence"]["rule"] == "peer_rank_lost", first["event"]
    assert second["restore"]["checkpoint_id"].startswith("0000000018-") and second["start_step"] == 18

    clean = shards(Path(clean_rec["storage"]["checkpoints"]), clean_rec["final_checkpoint"])
    final = shards(Path(rec["storage"]["checkpoints"]), rec["final_checkpoint"])
    assert clean_rec["final_checkpoint"].startswith(f"{STEPS:010d}-")
    assert sorted(final) == sorted(clean)
    blobs = [name for name in clean if name.endswith(".safetensors")]
    assert blobs == ["<id>.r0.safetensors", "<id>.r1.safetensors"]  # each rank wrote its own shards
    r0, r1 = (clean[name] for name in blobs)
    # Sharded, not replicated: each rank holds half of the first conv's 8 filters (FSDP2 shards dim 0).
    assert (
        r0["model.features.0.weight@0,0,0,0"].shape[0] == r1["model.features.0.weight@4,0,0,0"].shape[0] == 4
    )
    for name, tensors in clean.items():
        if name.endswith(".safetensors"):
            assert final[name].keys() == tensors.keys(), name
            for key, tensor in tensors.items():
                assert torch.equal(final[name][key], tensor), (name, key)
        else:
            assert final[name] == tensors, name
    assert any("optimizer.state" in key for key in r0)  # the comparison covers the optimizer's shards too

    loss, clean_loss = (live_series_of(r) for r in (rec, clean_rec))
    assert [loss[s] for s in range(1, STEPS + 1)] == [clean_loss[s] for s in range(1, STEPS + 1)]


def live_series_of(rec: dict[str, Any]) -> dict[int, float]:
    from tests.flowkit import live_series

    return live_series(run(rec), "loss")
