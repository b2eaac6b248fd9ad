"""`rollback-supervisor checkpoints ...` and `bench checkpoint`, through supervisor.cli.main and once for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.cli import main
from tests.ckpt_scripts.tiny import Tiny

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "policies" / "presets" / "conservative.yaml"


def _store(tmp_path: Path, steps: int = 4) -> Path:
    root = tmp_path / "store"
    t = Tiny()
    with CheckpointManager(CheckpointOptions(root), t.state) as mgr:
        for step in range(1, steps + 1):
            t.step()
            mgr.save(step * 100, metrics={"loss": float(10 - step)})
    return root


def test_list_prints_a_table(tmp_path, capsys):
    root = _store(tmp_path)
    assert main(["checkpoints", "list", str(root)]) == 0
    out = capsys.readouterr().out
    assert "4 checkpoint(s)" in out and "0000000400-000004" in out and "loss=6" in out


def test_verify_exit_codes(tmp_path, capsys):
    root = _store(tmp_path, steps=2)
    assert main(["checkpoints", "verify", str(root)]) == 0
    (root / "blobs" / "0000000200-000002.safetensors").unlink()
    assert main(["checkpoints", "verify", str(root), "--mode", "fast"]) == 1
    assert (
        "INVALID  0000000200-000002: blobs/0000000200-000002.safetensors is missing"
        in capsys.readouterr().out
    )


def test_gc_applies_the_policy_checkpoint_section(tmp_path, capsys):
    root = _store(tmp_path)
    policy = tmp_path / "policy.yaml"
    policy.write_text(PRESET.read_text().replace("keep_last: 5", "keep_last: 2"))
    assert main(["checkpoints", "gc", str(root), "--policy", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "deleted  0000000100-000001: not among the last 2" in out and "kept 2, deleted 2" in out
    assert [i.step for i in open_store(root).list()] == [300, 400]
    assert sorted(os.listdir(root / "blobs")) == [
        "0000000300-000003.safetensors",
        "0000000400-000004.safetensors",
    ]


def test_gc_with_a_bad_policy_is_a_user_error(tmp_path, capsys):
    root = _store(tmp_path, steps=1)
    policy = tmp_path / "bad.yaml"
    policy.write_text("version: 1\ncheckpoint: {keep_last: 0}\n")
    assert main(["checkpoints", "gc", str(root), "--policy", str(policy)]) == 2
    assert "keep_last" in capsys.readouterr().err


def test_import_a_foreign_file(tmp_path, capsys):
    t = Tiny()
    torch.save(t.model.state_dict(), tmp_path / "weights.pt")
    assert (
        main(["checkpoints", "import", str(tmp_path / "weights.pt"), str(tmp_path / "store"), "--step", "7"])
        == 0
    )
    assert "as checkpoint 0000000007-000001" in capsys.readouterr().out
    assert open_store(tmp_path / "store").verify("0000000007-000001") is None


@pytest.mark.e2e
def test_real_command_line(tmp_path):
    root = _store(tmp_path, steps=1)
    exe = Path(sys.executable).parent / "rollback-supervisor"
    done = subprocess.run(
        [str(exe), "checkpoints", "verify", str(root)], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0 and "ok       0000000100-000001" in done.stdout


@pytest.mark.slow
def test_bench_smoke_writes_every_key(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["bench", "checkpoint", "--params", "10M", "--reps", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    keys = {
        "state_bytes",
        "torch_save_s",
        "blocking_save_s",
        "blocking_save_overlap_s",
        "fwd_bwd_s",
        "overlapped_fwd_bwd_s",
        "write_s",
        "restore_memory_s",
        "restore_disk_s",
        "torch_load_s",
        "torch_load_mmap_s",
        "memcpy_s",
        "dedup_bytes_ratio",
    }
    assert keys <= result.keys() and all(result[k] > 0 for k in keys)
    assert set(result["targets"]) == {
        "blocking_save_s/torch_save_s",
        "blocking_save_overlap_s/torch_save_s",
        "restore_memory_s/memcpy_s",
        "restore_disk_s/torch_load_s",
        "restore_disk_s/torch_load_mmap_s",
        "dedup_bytes_ratio",
    }


def test_bench_rejects_a_bad_size(capsys):
    assert main(["bench", "checkpoint", "--params", "lots"]) == 2
    assert "--params" in capsys.readouterr().err
