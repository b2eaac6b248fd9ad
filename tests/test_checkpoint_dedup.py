"""Deduplication: unchanged tensors are referenced, not rewritten; garbage collection respects references."""

from __future__ import annotations

import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from tests.ckpt_scripts.tiny import Tiny


def test_frozen_layers_cost_nothing_after_the_first_save_and_gc_respects_references(tmp_path):
    root = tmp_path / "store"
    t = Tiny(width=64, frozen_width=64)
    options = CheckpointOptions(root, keep_last=1, async_save=False, memory_slots=0)
    t.step()
    with CheckpointManager(options, t.state) as mgr:
        first = mgr.save(1)
        t.step()
        second = mgr.save(2)
        first_bytes, second_info = first.nbytes, mgr.get(second.id)
        frozen = t.model[0].weight.numel() * 4 + t.model[0].bias.numel() * 4
        assert second_info.written_bytes < second_info.nbytes - frozen + 4096
        assert mgr.get(second.id).nbytes == first_bytes
        # keep_last=1 deleted checkpoint 1, but its blob stays: checkpoint 2 references the frozen layer in it.
        assert [i.id for i in mgr.list()] == [second.id]
        assert (root / "blobs" / f"{first.id}.safetensors").exists()
        saved = t.snapshot()
    catalog = open_store(root)
    assert catalog.verify(second.id, "full") is None
    t2 = Tiny(seed=7, width=64, frozen_width=64)
    with CheckpointManager(options, t2.state) as mgr:
        mgr.restore(second.id)
        assert t2.equals(saved)
        with torch.no_grad():
            for p in t2.model[0].parameters():
                p.add_(1.0)  # the frozen layer changes after all: nothing references blob 1 any more
        mgr.save(3)
    assert not (root / "blobs" / f"{first.id}.safetensors").exists()
    assert open_store(root).verify(open_store(root).latest().id, "full") is None


def test_tied_tensors_are_written_once(tmp_path):
    t = Tiny(width=32)
    t.state.extras = {"copy_of_weight": t.model[0].weight.detach().clone()}
    with CheckpointManager(CheckpointOptions(tmp_path / "s", async_save=False), t.state) as mgr:
        info = mgr.save(1)
        got = mgr.get(info.id)
    assert got.written_bytes < got.nbytes
