"""Corruption is detected, reported with its reason, and skipped for the previous valid checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.cli import main
from supervisor.errors import CheckpointCorrupt
from tests.ckpt_scripts.tiny import Tiny


def _blob(root: Path, cid: str) -> Path:
    return root / "blobs" / f"{cid}.safetensors"


def flip_byte(root: Path, cid: str) -> None:
    path = _blob(root, cid)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(root: Path, cid: str) -> None:
    path = _blob(root, cid)
    path.write_bytes(path.read_bytes()[:-100])


def delete_blob(root: Path, cid: str) -> None:
    _blob(root, cid).unlink()


def delete_state(root: Path, cid: str) -> None:
    (root / f"ckpt-{cid}" / "state.json").unlink()


def flip_state(root: Path, cid: str) -> None:
    path = root / f"ckpt-{cid}" / "state.json"
    path.write_text(path.read_text().replace('"step":2', '"step":7'))


def tamper_manifest(root: Path, cid: str) -> None:
    path = root / f"ckpt-{cid}" / "manifest.json"
    data = json.loads(path.read_text())
    data["metrics"]["loss"] = 0.0
    path.write_text(json.dumps(data))


def torn_marker(root: Path, cid: str) -> None:
    (root / f"ckpt-{cid}" / "COMMITTED").write_text('{"id": "')


CASES = [
    ("flipped byte", flip_byte, "checksum mismatch", False),
    ("truncated file", truncate, "is truncated: expected", True),
    ("deleted blob", delete_blob, ".safetensors is missing", True),
    ("deleted state", delete_state, "state.json is missing", True),
    ("edited state", flip_state, "state.json checksum mismatch", False),
    ("tampered manifest", tamper_manifest, "manifest.json was modified after commit", True),
]


@pytest.mark.parametrize("name,corrupt,reason,fast_detects", CASES, ids=[c[0] for c in CASES])
def test_corruption_is_detected_reported_and_skipped(tmp_path, caplog, name, corrupt, reason, fast_detects):
    root = tmp_path / "store"
    t = Tiny()
    options = CheckpointOptions(root, memory_slots=0)
    with CheckpointManager(options, t.state) as mgr:
        good = mgr.save(1, metrics={"loss": 1.0})
        saved = t.snapshot()
        t.step()
        bad = mgr.save(2, metrics={"loss": 0.5})
    corrupt(root, bad.id)

    catalog = open_store(root)
    assert reason in catalog.verify(bad.id, "full")
    assert catalog.verify(good.id, "full") is None
    assert (catalog.verify(bad.id, "fast") is not None) == fast_detects
    assert main(["checkpoints", "verify", str(root)]) == 1

    t2 = Tiny(seed=5)
    with CheckpointManager(options, t2.state) as mgr:
        if fast_detects:
            assert mgr.latest().id == good.id
        with pytest.raises(CheckpointCorrupt) as err:
            mgr.restore(bad.id)
        assert err.value.checkpoint_id == bad.id and reason in err.value.reason
        with caplog.at_level(logging.WARNING, logger="rollback_supervisor.checkpoint"):
            restored = mgr.restore("latest")
        assert restored.id == good.id and t2.equals(saved)
        assert reason in caplog.text and bad.id in caplog.text


def test_torn_marker_means_never_committed(tmp_path):
    root = tmp_path / "store"
    with CheckpointManager(CheckpointOptions(root), Tiny().state) as mgr:
        good = mgr.save(1)
        bad = mgr.save(2, force=True)
    torn_marker(root, bad.id)
    catalog = open_store(root)
    assert [i.id for i in catalog.list()] == [good.id]
    assert "marker is incomplete" in catalog.verify(bad.id)
    assert catalog.latest().id == good.id
    with CheckpointManager(CheckpointOptions(root), Tiny().state):
        pass
    assert not (root / f"ckpt-{bad.id}").exists()


def test_verify_modes_and_cli_reasons(tmp_path, capsys):
    root = tmp_path / "store"
    with CheckpointManager(CheckpointOptions(root), Tiny().state) as mgr:
        info = mgr.save(1)
    assert main(["checkpoints", "verify", str(root)]) == 0
    flip_byte(root, info.id)
    assert open_store(root).verify(info.id, "none") is None
    assert open_store(root).verify(info.id, "fast") is None
    capsys.readouterr()
    assert main(["checkpoints", "verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID  {info.id}: blobs/{info.id}.safetensors checksum mismatch" in out


def test_a_tampered_blob_header_is_refused_before_live_state_changes(tmp_path):
    root = tmp_path / "store"
    t = Tiny()
    t.step()
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t.state) as mgr:
        info = mgr.save(1)
    blob = _blob(root, info.id)
    data = blob.read_bytes()
    blob.write_bytes(data.replace(b'"dtype":"F32"', b'"dtype":"I32"', 1))  # same size, other meaning
    assert "checksum mismatch" in open_store(root).verify(info.id, "full")
    t2 = Tiny(seed=8)
    t2.step()
    before = t2.snapshot()
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t2.state) as mgr:
        with pytest.raises(CheckpointCorrupt, match="the manifest records F32"):
            mgr.restore(info.id)
    assert t2.equals(before)
