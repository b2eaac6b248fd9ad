"""Sharded checkpoints of FSDP2 (fully_shard, gloo, CPU) through DCP into our store: every rank writes its own
shards, and a checkpoint saved at one world size restores at another bit-identically (torch.equal on every
gathered model and optimizer tensor). Real torchrun processes; the reference is gathered by the child."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from supervisor.checkpoint import open_store
from supervisor.checkpoint.sharded import ShardedCheckpoints
from supervisor.cli import main
from supervisor.sharded_state import ShardedTrainingState
from tests.sharded_workers import fsdp_child

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "fsdp_child.py"
pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # real multi-process runs


def _torchrun(nproc: int, *args: object) -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(CHILD),
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _same(out: Path, tag: str, ref: Path) -> None:
    """Every gathered tensor of `tag` equals the reference bit for bit, and so does the JSON skeleton."""
    want, got = load_file(ref / "ref.safetensors"), load_file(out / f"{tag}.safetensors")
    assert got.keys() == want.keys() and len(want) == 20
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert json.loads((out / f"{tag}.json").read_text()) == json.loads((ref / "ref.json").read_text())


@pytest.fixture(scope="module")
def saved2(tmp_path_factory) -> Path:
    """One 2-rank torchrun (~7-14 s): FSDP2 saves and restores at once at 2 ranks, then DDP does the same."""
    out = tmp_path_factory.mktemp("fsdp2")
    _torchrun(2, "save", out, out / "store")
    return out


def test_fsdp2_save_at_2_restores_at_2_and_at_1_bit_identically(saved2):
    _same(saved2, "got2", saved2)
    for rank in (0, 1):  # at the saving world size each rank gets its own RNG stream back
        assert json.loads((saved2 / f"save2.rank{rank}.json").read_text())["rng_back"] is True
    catalog = open_store(saved2 / "store")
    (info,) = catalog.list()
    manifest = catalog.manifest(info.id)
    assert (manifest.format_version, manifest.world_size) == (2, 2)
    assert catalog.verify(info.id, "full") is None
    # Every rank wrote its own blob with its own shards; no chunk of a sharded weight is the whole tensor.
    assert manifest.blobs() == {f"blobs/{info.id}.r{r}.safetensors" for r in (0, 1)}
    embedding = manifest.sharded["model.0.weight"]
    assert [(c.offsets, c.sizes) for c in embedding.chunks] == [((0, 0), (6, 6)), ((6, 0), (5, 6))]
    assert {manifest.tensors[c.key].blob for c in embedding.chunks} == manifest.blobs()
    assert set(manifest.rank_files) == {"0", "1"}
    # World 1, in this process: a plain module, no process group.
    model, opt = fsdp_child.build(1, 1)
    with ShardedCheckpoints(saved2 / "store") as ckpts:
        assert ckpts.restore(ShardedTrainingState(model, opt)) == info.id
    fsdp_child.gather(model, opt, str(saved2), "got1", 0)
    _same(saved2, "got1", saved2)


def test_ddp_takes_the_same_path_and_each_rank_writes_about_half(saved2):
    """DDP's parameters are replicated: DCP's planner gives each replicated tensor to one rank."""
    for rank in (0, 1):
        assert json.loads((saved2 / f"save2.rank{rank}.json").read_text())["ddp_equal"] is True
    catalog = open_store(saved2 / "store-ddp")
    (info,) = catalog.list()
    manifest = catalog.manifest(info.id)
    per_blob: dict[str, int] = {}
    for ref in manifest.tensors.values():
        per_blob[ref.blob] = per_blob.get(ref.blob, 0) + ref.nbytes
    assert sorted(per_blob) == [f"blobs/{info.id}.r{r}.safetensors" for r in (0, 1)]
    assert all(0.3 < n / manifest.nbytes < 0.7 for n in per_blob.values()), per_blob
    assert "model.0.weight" in manifest.sharded  # DDP's "module." prefix is not part of the names


def test_fsdp2_restores_a_2_rank_save_at_4_and_a_4_rank_save_at_2(saved2, tmp_path):
    """The only 4-process test: it restores the 2-rank checkpoint and saves again at 4; 2 ranks restore that."""
    _torchrun(4, "load", tmp_path, saved2 / "store", tmp_path / "store4")
    _same(tmp_path, "got4", saved2)
    catalog = open_store(tmp_path / "store4")
    (info,) = catalog.list()
    manifest = catalog.manifest(info.id)
    assert manifest.world_size == 4 and len(manifest.blobs()) == 4
    assert len(manifest.sharded["model.0.weight"].chunks) == 4
    back = tmp_path / "back"
    back.mkdir()
    _torchrun(2, "load", back, tmp_path / "store4")
    _same(back, "got2", saved2)


def test_checkpoints_verify_checks_every_rank_s_shards(saved2, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(saved2 / "store", store)
    assert main(["checkpoints", "verify", str(store)]) == 0
    (info,) = open_store(store).list()
    blob = store / "blobs" / f"{info.id}.r1.safetensors"
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF  # the last byte of rank 1's shard data
    blob.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["checkpoints", "verify", str(store)]) == 1
    assert f"INVALID  {info.id}: blobs/{info.id}.r1.safetensors checksum mismatch" in capsys.readouterr().out
