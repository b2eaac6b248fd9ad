"""The restore path lists the tiers once per call: each manifest is read at most once by restore/latest/best/abandon."""

from __future__ import annotations

from collections import Counter

import pytest

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.manifest import CKPT_PREFIX, STATE
from supervisor.errors import CheckpointNotFound
from tests.ckpt_scripts.tiny import Tiny


@pytest.fixture
def reads(monkeypatch):
    """Counts Catalog.manifest() calls (each one reads manifest.json and the marker) by checkpoint id."""
    counted: Counter[str] = Counter()
    original = Catalog.manifest

    def manifest(self, checkpoint_id):
        counted[checkpoint_id] += 1
        return original(self, checkpoint_id)

    monkeypatch.setattr(Catalog, "manifest", manifest)
    return counted


def saved_store(tmp_path, n=3):
    t = Tiny()
    options = CheckpointOptions(tmp_path / "store", memory_slots=0, async_save=False)
    mgr = CheckpointManager(options, t.state)
    infos = []
    for step in range(1, n + 1):
        t.step()
        infos.append(mgr.save(step, metrics={"loss": 1.0 / step}))
    return t, mgr, infos


def test_restore_latest_on_a_local_store_reads_each_manifest_at_most_once(tmp_path, reads):
    t, mgr, infos = saved_store(tmp_path)
    reads.clear()
    with mgr:
        restored = mgr.restore("latest")
    assert restored.id == infos[-1].id
    assert reads[infos[-1].id] == 1
    assert max(reads.values()) == 1 and set(reads) <= {i.id for i in infos}


def test_restore_latest_falling_back_past_a_corrupt_one_still_reads_each_manifest_once(tmp_path, reads):
    t, mgr, infos = saved_store(tmp_path)
    state = tmp_path / "store" / f"{CKPT_PREFIX}{infos[-1].id}" / STATE
    state.write_bytes(state.read_bytes()[:-2])  # truncated: the fast check fails
    reads.clear()
    with mgr:
        assert mgr.restore("latest").id == infos[-2].id
    assert reads == Counter({i.id: 1 for i in infos})


@pytest.mark.parametrize("verb", ["latest", "best", "abandon_after", "restore_id"])
def test_each_read_verb_lists_once(tmp_path, reads, verb):
    t, mgr, infos = saved_store(tmp_path)
    reads.clear()
    with mgr:
        if verb == "latest":
            assert mgr.latest().id == infos[-1].id
        elif verb == "best":
            assert mgr.best("loss").id == infos[-1].id
        elif verb == "abandon_after":
            assert [i.id for i in mgr.abandon_after(infos[0])] == [i.id for i in infos[1:]]
        else:
            assert mgr.restore(infos[1].id).id == infos[1].id
    assert reads and max(reads.values()) == 1


def test_restore_memory_reads_no_manifest(tmp_path, reads):
    t = Tiny()
    with CheckpointManager(CheckpointOptions(tmp_path / "store", memory_slots=1), t.state) as mgr:
        info = mgr.save(1)
        mgr.wait()
        reads.clear()
        assert mgr.restore_memory().id == info.id
        assert reads == Counter()
        reads.clear()
        with pytest.raises(CheckpointNotFound, match="0000000009-000009 is not in the memory ring"):
            mgr.restore_memory("0000000009-000009")
        assert reads == Counter()
