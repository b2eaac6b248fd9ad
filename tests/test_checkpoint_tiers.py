"""Tiers: restore takes memory, then local, then remote (file:// fsspec URL here)."""

from __future__ import annotations

import logging
import shutil

import pytest

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.errors import CheckpointNotFound
from tests.ckpt_scripts.tiny import Tiny
from tests.test_checkpoint_corruption import flip_byte

LOGGER = "rollback_supervisor.checkpoint"


def test_restore_prefers_memory_then_local_then_remote(tmp_path, caplog):
    remote = f"file://{tmp_path / 'remote'}"
    t = Tiny()
    options = CheckpointOptions(tmp_path / "local", remote=remote, memory_slots=1)
    with caplog.at_level(logging.INFO, logger=LOGGER), CheckpointManager(options, t.state) as mgr:
        info = mgr.save(1)
        saved = t.snapshot()
        mgr.wait()
        assert mgr.get(info.id).tiers == ("memory", "local", "remote")
        assert open_store(remote).verify(info.id, "full") is None
        for expected in ("memory", "local", "remote"):
            t.step()
            caplog.clear()
            mgr.restore(info)
            assert f"from the {expected} tier" in caplog.text and t.equals(saved)
            if expected == "memory":
                t.step()
                mgr.save(2)  # pushes checkpoint 1 out of the single memory slot
                mgr.wait()
            elif expected == "local":
                flip_byte(tmp_path / "local", info.id)  # the local copy goes bad: remote still has it


def test_a_fresh_machine_restores_from_remote_and_continues_the_sequence(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    t = Tiny()
    with CheckpointManager(CheckpointOptions(tmp_path / "a", remote=remote), t.state) as mgr:
        mgr.save(1)
        t.step()
        last = mgr.save(2)
        saved = t.snapshot()
    shutil.rmtree(tmp_path / "a")
    t2 = Tiny(seed=4)
    with CheckpointManager(CheckpointOptions(tmp_path / "b", remote=remote), t2.state) as mgr:
        assert mgr.latest().id == last.id and mgr.latest().tiers == ("remote",)
        assert mgr.restore().id == last.id and t2.equals(saved)
        assert "local" in mgr.get(last.id).tiers
        nxt = mgr.save(3)
        assert nxt.seq == last.seq + 1


def test_remote_retention_and_tier_restriction(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    t = Tiny()
    with CheckpointManager(
        CheckpointOptions(tmp_path / "a", remote=remote, keep_last=2, memory_slots=0), t.state
    ) as mgr:
        for step in range(1, 5):
            t.step()
            mgr.save(step)
        mgr.wait()
        assert [i.step for i in open_store(remote).list()] == [3, 4]
        with pytest.raises(CheckpointNotFound, match="memory"):
            mgr.restore(mgr.latest(), tier="memory")
