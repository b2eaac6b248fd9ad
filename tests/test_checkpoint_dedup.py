"""Deduplication: unchanged tensors are referenced, not rewritten, but only from blobs a checkpoint mostly needs."""

from __future__ import annotations

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.blobs import DTYPE_NAMES, tensor_digest
from supervisor.checkpoint.dedup import MIN_SHARE, DedupIndex, plan, shared_blob
from supervisor.checkpoint.manifest import FileEntry, Manifest, TensorRef
from tests.ckpt_scripts.tiny import Tiny


def test_frozen_layers_are_copied_out_of_the_first_blob_once_then_cost_nothing(tmp_path):
    root = tmp_path / "store"
    blobs = root / "blobs"
    t = Tiny(width=160, frozen_width=160)  # the frozen layer: 103 kB, a quarter of the state
    options = CheckpointOptions(root, keep_last=1, async_save=False, memory_slots=0)
    frozen = sum(p.numel() * 4 for p in t.model[0].parameters())
    t.step()
    with CheckpointManager(options, t.state) as mgr:
        first = mgr.save(1)
        t.step()
        second = mgr.get(mgr.save(2).id)
        # Referencing the frozen layer in blob 1 would keep its other three quarters on disk for good: the
        # layer is copied into checkpoint 2's shared blob instead, and keep_last=1 then deletes blob 1.
        assert second.written_bytes > second.nbytes
        assert sorted(p.name for p in blobs.iterdir()) == [
            f"{second.id}.safetensors",
            f"{second.id}.shared.safetensors",
        ]
        t.step()
        third = mgr.get(mgr.save(3).id)
        assert third.written_bytes < third.nbytes - frozen + 4096
        assert third.nbytes == first.nbytes
        assert sorted(p.name for p in blobs.iterdir()) == [
            f"{second.id}.shared.safetensors",
            f"{third.id}.safetensors",
        ]
        saved = t.snapshot()
    catalog = open_store(root)
    assert catalog.verify(third.id, "full") is None
    t2 = Tiny(seed=7, width=160, frozen_width=160)
    with CheckpointManager(options, t2.state) as mgr:
        mgr.restore(third.id)
        assert t2.equals(saved)
        with torch.no_grad():
            for p in t2.model[0].parameters():
                p.add_(1.0)  # the frozen layer changes after all: nothing references the shared blob any more
        mgr.save(4)
    assert not (blobs / f"{second.id}.shared.safetensors").exists()
    assert open_store(root).verify(open_store(root).latest().id, "full") is None


def test_tied_tensors_are_written_once(tmp_path):
    t = Tiny(width=32)
    t.state.extras = {"copy_of_weight": t.model[0].weight.detach().clone()}
    with CheckpointManager(CheckpointOptions(tmp_path / "s", async_save=False), t.state) as mgr:
        info = mgr.save(1)
        got = mgr.get(info.id)
    assert got.written_bytes < got.nbytes


# ---- where plan() puts each tensor: table-driven over hand-made stores ---------------------------------
def _t(kb: float, seed: int) -> torch.Tensor:
    return torch.full((int(kb * 256),), float(seed))  # kb kilobytes of float32


E, F, G, H = _t(5, 1), _t(100, 2), _t(100, 3), _t(20, 4)
BYTES = {"e": E, "f": F, "g": G, "h": H}
NEW, MAIN, SHARED = "blobs/new.safetensors", "main", "shared"


def _index(stored: list[tuple[str, int, list[str]]]) -> DedupIndex:
    """An index over one manifest per (blob path, blob file size, names of the tensors it holds)."""
    index = DedupIndex()
    for n, (blob, size, names) in enumerate(stored):
        refs = {
            k: TensorRef(blob, k, tensor_digest(BYTES[k]), BYTES[k].numel() * 4, DTYPE_NAMES[torch.float32])
            for k in names
        }
        index.add(Manifest(f"m{n}", n, n, 0.0, {}, None, [FileEntry(blob, size, "0")], refs, 0, 0))
    return index


PLANS = [
    (
        "the issue's case: 5 kB shared with a 37.8 MB blob is written again, in the main blob (too small "
        "for a file of its own)",
        [("blobs/1.safetensors", 37_800_000, ["e"])],
        ["e"],
        {"e": MAIN},
    ),
    (
        "100 kB in a 1 MB blob is copied into the shared blob; a new tensor goes to the main blob",
        [("blobs/1.safetensors", 1_000_000, ["f"])],
        ["f", "e"],
        {"f": SHARED, "e": MAIN},  # e is new: the shared blob holds only tensors stored before
    ),
    (
        "a blob the checkpoint needs 93% of is referenced",
        [("blobs/1.safetensors", 110_000, ["f"])],
        ["f"],
        {"f": "blobs/1.safetensors"},
    ),
    (
        "two tensors together reach the share",
        [("blobs/1.safetensors", 230_000, ["f", "g"])],
        ["f", "g"],
        {"f": "blobs/1.safetensors", "g": "blobs/1.safetensors"},
    ),
    (
        "the same blob when one of them changed: the other is copied",
        [("blobs/1.safetensors", 230_000, ["f", "g"])],
        ["f"],
        {"f": SHARED},
    ),
    (
        "the dense shared copy wins over the sparse first blob",
        [("blobs/1.safetensors", 1_000_000, ["f", "g"]), ("blobs/2.shared.safetensors", 102_600, ["f"])],
        ["f", "g"],
        {"f": "blobs/2.shared.safetensors", "g": SHARED},
    ),
    (
        "the blob offering more bytes is used whole; the smaller duplicate is not",
        [("blobs/1.safetensors", 230_000, ["f", "g"]), ("blobs/2.shared.safetensors", 102_600, ["f"])],
        ["f", "g"],
        {"f": "blobs/1.safetensors", "g": "blobs/1.safetensors"},
    ),
    (
        "a blob left short once its tensors go elsewhere is dropped, not referenced for a sliver",
        [
            ("blobs/1.safetensors", 250_000, ["f", "g", "h"]),  # 88% offered, but f and g find a denser home
            ("blobs/2.safetensors", 210_000, ["f", "g"]),
            ("blobs/3.safetensors", 205_000, ["f", "g"]),
        ],
        ["f", "g", "h"],
        {"f": "blobs/1.safetensors", "g": "blobs/1.safetensors", "h": "blobs/1.safetensors"},
    ),
    ("nothing stored: everything is new", [], ["f", "e"], {"f": MAIN, "e": MAIN}),
]


@pytest.mark.parametrize(("stored", "names", "expected"), [c[1:] for c in PLANS], ids=[c[0] for c in PLANS])
def test_plan_references_only_blobs_it_needs_most_of(stored, names, expected):
    tensors = {n: BYTES[n] for n in names}
    out = plan(tensors, NEW, _index(stored))
    got = {n: {NEW: MAIN, shared_blob(NEW): SHARED}.get(out.refs[n].blob, out.refs[n].blob) for n in names}
    assert got == expected
    for blob in {r.blob for r in out.refs.values()} - {NEW, shared_blob(NEW)}:  # the invariant
        size = next(s for b, s, _ in stored if b == blob)
        assert sum(tensors[n].numel() * 4 for n in names if out.refs[n].blob == blob) >= MIN_SHARE * size
    for blob, part in out.writes.items():
        assert all(out.refs[n].blob == blob and out.refs[n].key == n for n in part)


def test_plan_stores_tied_tensors_once_and_without_an_index_writes_all():
    out = plan({"w": F, "w2": F.clone(), "b": G}, NEW, None)
    assert list(out.writes) == [NEW] and sorted(out.writes[NEW]) == ["b", "w"]
    assert out.refs["w2"] == TensorRef(NEW, "w", tensor_digest(F), F.numel() * 4, "F32", tuple(F.shape))
    assert shared_blob(NEW) == "blobs/new.shared.safetensors"
