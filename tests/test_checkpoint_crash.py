"""Crash consistency: processes SIGKILLed at random instants while saving never leave a bad "latest"."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.options import parse_id
from supervisor.state import TrainingState

REPO = Path(__file__).resolve().parents[1]
RUNS = 30


@pytest.mark.slow
@pytest.mark.e2e
def test_sigkill_at_random_instants_never_exposes_a_partial_checkpoint(tmp_path):
    store = tmp_path / "store"
    rng = random.Random(20261121)
    zygote = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "ckpt_scripts" / "crash_zygote.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    last_committed: str | None = None
    killed_mid_save = 0
    try:
        for run in range(RUNS):
            progress = tmp_path / f"progress-{run}"
            cmd = {"store": str(store), "progress": str(progress), "seed": run, "async": run % 2 == 0}
            zygote.stdin.write(json.dumps(cmd) + "\n")
            zygote.stdin.flush()
            pid = json.loads(zygote.stdout.readline())["pid"]
            time.sleep(rng.uniform(0.02, 0.5))  # the kill instant itself is what is random
            os.kill(pid, signal.SIGKILL)
            status = json.loads(zygote.stdout.readline())["status"]
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
                f"run {run}: child exited early"
            )
            lines = progress.read_text().splitlines() if progress.exists() else []
            committed = [line.split()[1] for line in lines if line.startswith("committed ")]
            last_committed = committed[-1] if committed else last_committed
            killed_mid_save += bool(committed)

            catalog = open_store(store)  # always opens, read-only, whatever the kill left
            for info in catalog.list():
                assert catalog.verify(info.id, "full") is None, f"run {run}: committed {info.id} is invalid"
            latest = catalog.latest()
            if last_committed is None:
                continue
            assert latest is not None, f"run {run}: {last_committed} was committed but latest() is None"
            assert catalog.verify(latest.id, "full") is None
            assert latest.seq >= parse_id(last_committed)[1], (
                f"run {run}: latest {latest.id} older than {last_committed}"
            )
            last_committed = latest.id
    finally:
        zygote.stdin.close()
        zygote.wait(timeout=30)
    assert killed_mid_save >= RUNS // 4, "too few runs got as far as saving: the kills test nothing"
    with CheckpointManager(CheckpointOptions(store), TrainingState()) as mgr:
        assert mgr.latest() is not None
    assert os.listdir(store / ".tmp") == []
    assert all((p / "COMMITTED").exists() for p in store.glob("ckpt-*"))


def test_a_commit_under_an_existing_name_touches_nothing_committed(tmp_path):
    """A commit that collides with a committed checkpoint refuses before anything moves (it used to rename its
    blob over the committed one's, then delete it while undoing)."""
    import os

    import pytest

    from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
    from supervisor.checkpoint.local import LocalStore
    from supervisor.errors import CheckpointError
    from tests.ckpt_scripts.tiny import Tiny

    t = Tiny()
    with CheckpointManager(CheckpointOptions(tmp_path, async_save=False), t.state) as mgr:
        info = mgr.save(1)
    blobs = sorted(os.listdir(tmp_path / "blobs"))
    before = {name: (tmp_path / "blobs" / name).read_bytes() for name in blobs}
    store = LocalStore(tmp_path)
    try:
        staged = store.stage(info.id)
        for name in blobs:
            (open(os.path.join(staged, name), "wb")).close()  # an empty impostor of the committed blob
        with pytest.raises(CheckpointError, match="already exists"):
            store.commit(info.id, staged, b"{}", [f"blobs/{name}" for name in blobs])
    finally:
        store.close()
    assert {name: (tmp_path / "blobs" / name).read_bytes() for name in blobs} == before
    assert open_store(tmp_path).verify(info.id, "full") is None
