"""ShardWriter / ShardReader in one process (DCP's no_dist): our format in our store, restored by the normal path."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.blobs import BlobReader
from supervisor.checkpoint.dcp_reader import ShardReader, restore_chunks
from supervisor.checkpoint.dcp_writer import CommitJob
from supervisor.checkpoint.local import TMP, LocalStore, write_file
from supervisor.checkpoint.manifest import CKPT_PREFIX, MANIFEST, MARKER, Manifest, marker_bytes
from supervisor.checkpoint.options import make_id
from supervisor.checkpoint.retention import KeepLast
from supervisor.checkpoint.sharded import ShardedCheckpoints, write_sharded
from supervisor.checkpoint.writer import CheckpointMeta
from supervisor.cli import main
from supervisor.errors import CheckpointCorrupt, CheckpointError
from supervisor.sharded_state import ShardedTrainingState
from tests.ckpt_scripts.tiny import Tiny


def _save_sharded(root, t: Tiny, step: int, seq: int = 1) -> Manifest:
    """A sharded save of a plain TrainingState through ShardWriter (world 1, no process group)."""
    skeleton, flat = t.state.snapshot(step)
    store = LocalStore(root)
    try:
        meta = CheckpointMeta(make_id(step, seq), seq, step, 1.0, {"loss": 1.0}, None, {}, None, None)
        job = CommitJob(store, meta, json.dumps(skeleton, allow_nan=False).encode())
        assert write_sharded(store.root, flat, b"{}", job, no_dist=True) == meta.id
    finally:
        store.close()
    assert job.manifest is not None
    return job.manifest


def test_a_sharded_checkpoint_restores_through_the_normal_restore_path(tmp_path):
    root = tmp_path / "store"
    t = Tiny()
    t.step()
    manifest = _save_sharded(root, t, 1)
    saved, rng = t.snapshot(), torch.get_rng_state()
    assert (manifest.format_version, manifest.world_size) == (2, 1)
    assert manifest.blobs() == {f"blobs/{manifest.id}.r0.safetensors"}
    assert manifest.rank_files == {"0": f"{CKPT_PREFIX}{manifest.id}/ranks.0.json"}
    assert open_store(root).verify(manifest.id, "full") is None
    losses = [t.step() for _ in range(3)]
    with CheckpointManager(CheckpointOptions(root), t.state) as mgr:
        assert mgr.restore(manifest.id, tier="local").id == manifest.id
    assert t.state.step == 1 and t.equals(saved) and torch.equal(torch.get_rng_state(), rng)
    assert [t.step() for _ in range(3)] == losses


def test_a_v1_checkpoint_reads_through_the_shard_reader_as_restore_local_reads_it(tmp_path):
    t = Tiny()
    t.step()
    with CheckpointManager(CheckpointOptions(tmp_path / "store"), t.state) as mgr:
        info = mgr.save(1)
        mgr.wait()
    saved = t.snapshot()
    catalog = open_store(tmp_path / "store")
    manifest = catalog.manifest(info.id)
    assert manifest.format_version == 1 and not manifest.sharded
    got = restore_chunks(catalog, manifest, list(manifest.tensors), {}, "full")
    assert got.keys() == manifest.tensors.keys() and saved.keys() <= got.keys()
    assert all(torch.equal(got[name], saved[name]) for name in saved)


def test_a_corrupted_chunk_is_named_by_restore_and_by_checkpoints_verify(tmp_path, capsys):
    root = tmp_path / "store"
    t = Tiny()
    t.step()
    manifest = _save_sharded(root, t, 1)
    key = "model.0.weight@0,0"
    ref = manifest.tensors[key]
    reader = BlobReader(str(root / ref.blob))
    at = reader.base + reader.entries[ref.key].start + 5
    reader.close()
    with open(root / ref.blob, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))
    with CheckpointManager(CheckpointOptions(root), Tiny().state) as mgr:
        with pytest.raises(CheckpointCorrupt, match=rf"{ref.blob}: tensor '{key}' checksum mismatch"):
            mgr.restore(manifest.id, tier="local")
    assert main(["checkpoints", "verify", str(root)]) == 1
    assert f"INVALID  {manifest.id}: {ref.blob} checksum mismatch" in capsys.readouterr().out


def test_verify_refuses_chunks_that_do_not_tile_a_tensor(tmp_path, capsys):
    """A manifest that lost a chunk (re-pinned by its marker, so only coverage can tell) is invalid."""
    root = tmp_path / "store"
    t = Tiny()
    t.step()
    manifest = _save_sharded(root, t, 1)
    ckpt = root / f"{CKPT_PREFIX}{manifest.id}"
    data = json.loads((ckpt / MANIFEST).read_bytes())
    data["sharded"]["model.0.weight"]["chunks"] = []
    raw = json.dumps(data).encode()
    (ckpt / MANIFEST).write_bytes(raw)
    (ckpt / MARKER).unlink()
    write_file(str(ckpt / MARKER), marker_bytes(raw, manifest.id))
    assert main(["checkpoints", "verify", str(root), "--mode", "fast"]) == 1
    out = capsys.readouterr().out
    assert f"INVALID  {manifest.id}: {MANIFEST}: sharded['model.0.weight']: chunks cover 0 of" in out


def test_a_non_tensor_value_never_reaches_disk(tmp_path):
    """DCP would torch.save a non-tensor leaf (a pickle); the writer refuses it before anything is staged."""
    store = LocalStore(tmp_path / "store")
    meta = CheckpointMeta(make_id(1, 1), 1, 1, 1.0, {}, None, {}, None, None)
    job = CommitJob(store, meta, b"{}")
    flat = {"model.w": torch.ones(3), "extras.note": "hello"}
    with pytest.raises(CheckpointError, match="extras.note: a non-tensor value .* would need pickle"):
        write_sharded(store.root, flat, b"{}", job, no_dist=True)
    assert os.listdir(store.path(TMP)) == [] and store.catalog.ids() == []
    store.close()


def _frozen_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2))
    model[0].requires_grad_(False)
    return model, torch.optim.Adam(model[1].parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(4, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_dedup_writes_a_frozen_layer_once_over_three_saves(tmp_path):
    model, opt = _frozen_model()
    state = ShardedTrainingState(model, opt)
    with ShardedCheckpoints(tmp_path / "store") as ckpts:
        ids = []
        for step in (1, 2, 3):
            _train(model, opt, 1)
            ids.append(ckpts.save(step, state))
        manifests = [ckpts.catalog.manifest(i) for i in ids]
    first = f"blobs/{ids[0]}.r0.safetensors"
    assert [m.tensors["model.0.weight@0,0"].blob for m in manifests] == [first] * 3
    assert manifests[1].written_bytes < manifests[0].written_bytes / 10
    assert manifests[2].written_bytes < manifests[0].written_bytes / 10
    assert all(first in {f.path for f in m.files} for m in manifests)


def test_sharded_state_of_a_plain_module_round_trips_with_param_groups_and_rng(tmp_path):
    model, opt = _frozen_model()
    _train(model, opt, 2)
    state = ShardedTrainingState(model, opt)
    saved = {k: v.clone() for k, v in state.snapshot()[1].items()}
    rng = torch.get_rng_state()
    with ShardedCheckpoints(tmp_path / "store") as ckpts:
        cid = ckpts.save(2, state)
        torch.manual_seed(123)
        model2, opt2 = _frozen_model()
        for g in opt2.param_groups:
            g["lr"] = 0.5
        state2 = ShardedTrainingState(model2, opt2)
        assert ckpts.restore(state2) == cid
    got = state2.snapshot()[1]
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert opt2.param_groups[0]["lr"] == 1e-2 and torch.equal(torch.get_rng_state(), rng)


def test_latest_falls_back_past_a_checkpoint_whose_chunk_is_corrupt(tmp_path):
    model, opt = _frozen_model()
    state = ShardedTrainingState(model, opt)
    with ShardedCheckpoints(tmp_path / "store") as ckpts:
        _train(model, opt, 1)
        first = ckpts.save(1, state)
        saved = {k: v.clone() for k, v in state.snapshot()[1].items()}
        _train(model, opt, 1)
        second = ckpts.save(2, state)
        ref = ckpts.catalog.manifest(second).tensors["model.1.weight@0,0"]
        assert ref.blob == f"blobs/{second}.r0.safetensors"  # the changed layer went into the new blob
        reader = BlobReader(str(tmp_path / "store" / ref.blob))
        at = reader.base + reader.entries[ref.key].start
        reader.close()
        with open(tmp_path / "store" / ref.blob, "r+b") as f:
            f.seek(at)
            f.write(b"\xff\xff\xff\xff")
        with pytest.raises(CheckpointCorrupt, match="model.1.weight@0,0' checksum mismatch"):
            ckpts.restore(state, second)
        assert ckpts.restore(state) == first
    got = state.snapshot()[1]
    assert all(torch.equal(got[k], saved[k]) for k in saved)


class _Payload:
    """Unpickling this creates a file: the proof that something ran code from a checkpoint."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_sharded_store_holds_only_json_and_safetensors_and_a_planted_dcp_pickle_is_never_loaded(tmp_path):
    model, opt = _frozen_model()
    _train(model, opt, 1)
    state = ShardedTrainingState(model, opt)
    root, pwned = tmp_path / "store", tmp_path / "PWNED"
    with ShardedCheckpoints(root) as ckpts:
        cid = ckpts.save(1, state)
    for path in root.rglob("*"):
        if path.is_file() and path.name != ".lock":
            raw = path.read_bytes()
            if path.suffix == ".safetensors":
                BlobReader(str(path)).close()
            else:
                json.loads(raw)  # manifest, state, rank files, marker: all JSON
    for where in (
        root / f"{CKPT_PREFIX}{cid}" / ".metadata",
        root / ".metadata",
    ):  # FileSystemReader's pickle
        where.write_bytes(pickle.dumps(_Payload(str(pwned))))
    with ShardedCheckpoints(root) as ckpts:
        assert ckpts.restore(state) == cid
    assert not pwned.exists()


def test_retention_runs_before_each_save_is_planned_and_leaves_no_unreferenced_blob(tmp_path):
    model, opt = _frozen_model()
    state = ShardedTrainingState(model, opt)
    with ShardedCheckpoints(tmp_path / "store", retention=KeepLast(2)) as ckpts:
        ids = []
        for step in range(1, 5):
            _train(model, opt, 1)
            ids.append(ckpts.save(step, state))
        # Retention runs inside the save's global plan, before its write: the newest 2 plus the new one stay.
        assert [i.id for i in ckpts.catalog.list()] == ids[1:]
        assert set(ckpts.catalog.blob_files()) == ckpts.catalog.referenced_blobs()
        assert all(ckpts.catalog.verify(i, "full") is None for i in ids[1:])
        assert ckpts.restore(state) == ids[-1]


def test_a_misspelt_verify_mode_is_refused_by_checkpoints_and_reader(tmp_path):
    root = tmp_path / "store"
    t = Tiny()
    t.step()
    manifest = _save_sharded(root, t, 1)
    expected = "verify: expected one of full, fast, none, got 'ful'"
    with pytest.raises(CheckpointError, match=expected):
        ShardedCheckpoints(root, verify="ful")
    with pytest.raises(CheckpointError, match=expected):
        ShardReader(open_store(root), manifest, "ful")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("world_size", 2, f"{MARKER} records world_size 2, but {MANIFEST} says 1"),
        ("files_xxh3", "0" * 16, f"{MARKER} pins files_xxh3 '{'0' * 16}', but {MANIFEST}'s files digest to"),
    ],
)
def test_a_marker_whose_world_size_or_files_digest_disagrees_with_its_manifest_is_invalid(
    tmp_path, capsys, field, value, reason
):
    """The manifest checksum still matches: only the marker's own sharded fields can tell."""
    root = tmp_path / "store"
    t = Tiny()
    t.step()
    manifest = _save_sharded(root, t, 1)
    marker_path = root / f"{CKPT_PREFIX}{manifest.id}" / MARKER
    marker = json.loads(marker_path.read_bytes())
    assert marker["world_size"] == 1 and len(marker["files_xxh3"]) == 16  # what the commit wrote
    assert open_store(root).verify(manifest.id, "fast") is None
    marker[field] = value
    marker_path.unlink()
    write_file(str(marker_path), json.dumps(marker).encode())
    assert reason in (open_store(root).verify(manifest.id, "none") or "")
    assert main(["checkpoints", "verify", str(root), "--mode", "fast"]) == 1
    assert f"INVALID  {manifest.id}: {reason}" in capsys.readouterr().out


def test_the_staging_directory_goes_to_every_rank_relative_to_the_store_root(tmp_path):
    """A rank on another node may mount the shared store at another path: only a relative path works there."""
    from torch.distributed.checkpoint.planner import SavePlan

    from supervisor.checkpoint.dcp_writer import ShardWriter

    store = LocalStore(tmp_path / "store")
    try:
        meta = CheckpointMeta(make_id(1, 1), 1, 1, 1.0, {}, None, {}, None, None)
        writer = ShardWriter(store.root, b"{}", CommitJob(store, meta, b"{}"))
        plans = writer.prepare_global_plan([SavePlan([]), SavePlan([])])
    finally:
        store.close()
    staged = [p.storage_data["staged"] for p in plans]
    assert staged[0] == staged[1] and not os.path.isabs(staged[0]) and staged[0].startswith(TMP)
    assert os.path.isdir(os.path.join(store.root, staged[0]))


def test_an_unexpected_error_inside_a_save_is_logged_with_its_traceback(tmp_path, caplog):
    """DCP replaces a rank's exception by a summary; the CheckpointError raised instead must not lose where."""
    t = Tiny()
    t.step()
    skeleton, flat = t.state.snapshot(1)
    store = LocalStore(tmp_path / "store")

    def explode() -> None:
        raise ZeroDivisionError("boom in before_commit")

    try:
        meta = CheckpointMeta(make_id(1, 1), 1, 1, 1.0, {}, None, {}, None, None)
        job = CommitJob(store, meta, json.dumps(skeleton).encode(), before_commit=explode)
        with caplog.at_level("WARNING", logger="rollback_supervisor.checkpoint"):
            with pytest.raises(CheckpointError, match="rank 0: ZeroDivisionError: boom in before_commit"):
                write_sharded(store.root, flat, b"{}", job, no_dist=True)
    finally:
        store.close()
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "failed with ZeroDivisionError: boom in before_commit" in logged
    assert "in explode" in logged and "test_dcp_storage.py" in logged  # the frame that raised
    assert open_store(tmp_path / "store").list() == []


def test_a_state_the_store_cannot_keep_is_refused_at_an_async_save_and_the_save_fails_in_step(tmp_path):
    """A user's mistake is raised at once (exit 2 through the Session), while the save itself still runs its
    collectives as a failed save, so that other ranks are never left waiting in it."""
    from supervisor.errors import BackgroundSaveError, UnsupportedStateError

    class Unkeepable(ShardedTrainingState):
        def rank_state(self):
            raise UnsupportedStateError("ranks.data.sampler", lambda: None)

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with ShardedCheckpoints(tmp_path / "store") as ckpts:
        with pytest.raises(UnsupportedStateError, match="ranks.data.sampler: expected a tensor"):
            ckpts.save(1, Unkeepable(model, opt), blocking=False)
        with pytest.raises(BackgroundSaveError, match="could not be prepared: UnsupportedStateError"):
            ckpts.wait()
        assert ckpts.save(2, ShardedTrainingState(model, opt), blocking=False) is not None
        ckpts.wait()
        assert [i.step for i in ckpts.catalog.list()] == [2]
