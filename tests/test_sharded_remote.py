"""Sharded checkpoints with a remote tier (a local S3 server): rank 0 uploads each commit, and a new machine
with an empty local store restores the latest one bit for bit from the remote (2 FSDP2 ranks, torchrun)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from supervisor.checkpoint.remote import RemoteTier
from tests.s3_server import POLICY_BUCKET, forget_s3_clients, s3_server  # noqa: F401 (fixture)

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "remote_child.py"
ENV = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _torchrun(*args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(CHILD)]
    done = subprocess.run(
        [*cmd, *args], cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]


def test_a_new_machine_restores_the_latest_sharded_checkpoint_from_the_remote_tier(tmp_path, s3_server):  # noqa: F811
    remote = f"s3://{POLICY_BUCKET}/sharded-{tmp_path.name}"
    store = tmp_path / "store"
    _torchrun("save", str(store), remote, str(tmp_path))
    with safe_open(str(tmp_path / "ref.rank0.safetensors"), "pt") as f:
        last = f.metadata()["id"]
    forget_s3_clients()
    uploaded = RemoteTier(remote).catalog.list()
    assert [i.id for i in uploaded][-1] == last and len(uploaded) == 3  # every commit, marker last
    assert RemoteTier(remote).catalog.verify(last, "full") is None  # every rank's shards are there
    shutil.rmtree(store)  # the machine is gone; a new one starts with an empty disk
    _torchrun("restore", str(tmp_path / "new-store"), remote, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"restore.rank{rank}.json").read_text())
        assert got == {"id": last, "equal": True}
    assert (tmp_path / "new-store" / f"ckpt-{last}" / "COMMITTED").exists()  # fetched into the local store
