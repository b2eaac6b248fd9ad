"""No pickle anywhere: planted pickles are never loaded, foreign files load only with weights_only=True."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.checkpoint.importer import import_file
from supervisor.cli import main
from supervisor.errors import CheckpointError
from tests.ckpt_scripts.tiny import Tiny

REPO = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this creates a file: the proof that something ran code from a checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant(path: Path, marker: Path) -> None:
    torch.save({"model": Payload(marker)}, path)
    assert not marker.exists()


def test_restore_never_loads_a_planted_pickle(tmp_path):
    root, marker = tmp_path / "store", tmp_path / "PWNED"
    t = Tiny()
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t.state) as mgr:
        info = mgr.save(1)
    saved = t.snapshot()
    ckpt = root / f"ckpt-{info.id}"
    for name in ("model.pt", "optimizer.pt", "checkpoint.pt", "state.pt"):
        plant(ckpt / name, marker)
    t2 = Tiny(seed=3)
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t2.state) as mgr:
        mgr.restore(info.id)
    assert t2.equals(saved)
    assert not marker.exists()


def test_a_pickle_in_place_of_a_blob_is_refused_without_running(tmp_path):
    root, marker = tmp_path / "store", tmp_path / "PWNED"
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), Tiny().state) as mgr:
        info = mgr.save(1)
    plant(root / "blobs" / f"{info.id}.safetensors", marker)
    with CheckpointManager(CheckpointOptions(root, memory_slots=0, verify="none"), Tiny().state) as mgr:
        with pytest.raises(CheckpointError):
            mgr.restore(info.id)
    assert not marker.exists()


def test_import_refuses_a_malicious_pt_and_never_runs_it(tmp_path):
    evil, marker = tmp_path / "evil.pt", tmp_path / "PWNED"
    plant(evil, marker)
    with pytest.raises(CheckpointError, match="weights_only=True"):
        import_file(evil, tmp_path / "store")
    assert main(["checkpoints", "import", str(evil), str(tmp_path / "store")]) != 0
    assert not marker.exists()


def test_import_of_a_plain_pt_restores_through_the_store(tmp_path):
    t = Tiny()
    torch.save(
        {"model": t.model.state_dict(), "optimizer": t.opt.state_dict(), "iter_num": 42}, tmp_path / "ok.pt"
    )
    info = import_file(tmp_path / "ok.pt", tmp_path / "store")
    assert info.step == 42
    t2 = Tiny(seed=9)
    with CheckpointManager(CheckpointOptions(tmp_path / "store"), t2.state) as mgr:
        mgr.restore(info.id, prefixes=["model", "optimizer"])
    assert torch.equal(t2.model[0].weight, t.model[0].weight)
    assert t2.opt.state_dict()["param_groups"] == t.opt.state_dict()["param_groups"]


def test_shipped_code_has_no_pickle_and_no_unsafe_torch_load():
    files = [REPO / "supervisor" / "state.py", REPO / "supervisor" / "data.py"]
    files += sorted((REPO / "supervisor" / "checkpoint").glob("*.py"))
    for path in files:
        text = path.read_text()
        assert not re.search(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle)\b", text, re.M), path
        for call in re.findall(r"torch\.load\((.*)$", text, re.M):
            assert "weights_only=True" in call, f"{path}: torch.load({call})"
    assert os.path.exists(files[-1])
