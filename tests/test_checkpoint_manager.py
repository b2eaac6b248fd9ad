"""CheckpointManager: save/restore, no aliasing, background errors, bounded saves, ids, rollback bookkeeping."""

from __future__ import annotations

import json
import logging
import os
import threading

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.manifest import FORMAT_VERSION
from supervisor.errors import BackgroundSaveError, CheckpointError, CheckpointNotFound, UnsupportedStateError
from tests.ckpt_scripts.tiny import Tiny

LOGGER = "rollback_supervisor.checkpoint"


def opts(tmp_path, **kw) -> CheckpointOptions:
    return CheckpointOptions(tmp_path / "store", **kw)


@pytest.mark.parametrize("async_save,memory_slots", [(True, 1), (True, 0), (False, 1), (False, 0)])
def test_restore_from_disk_gives_back_the_saved_state_and_training_repeats(
    tmp_path, async_save, memory_slots
):
    t = Tiny()
    t.step()
    with CheckpointManager(opts(tmp_path, async_save=async_save, memory_slots=memory_slots), t.state) as mgr:
        info = mgr.save(1, metrics={"loss": 0.5})
        saved = t.snapshot()
        rng = torch.get_rng_state()
        losses = [t.step() for _ in range(3)]
        mgr.wait()
        restored = mgr.restore(info, tier="local")
        assert restored.id == info.id and t.state.step == 1
        assert t.equals(saved) and torch.equal(torch.get_rng_state(), rng)
        assert [t.step() for _ in range(3)] == losses


def test_snapshot_never_aliases_live_tensors(tmp_path):
    """PyTorch #144657: an async snapshot must not change when training mutates tensors in place."""
    t = Tiny()
    t.step()
    with CheckpointManager(opts(tmp_path, memory_slots=1), t.state) as mgr:
        saved = t.snapshot()
        info = mgr.save(1)
        with torch.no_grad():
            for tensor in t.state.live_tensors().values():
                tensor.add_(1000)
        mgr.restore_memory(info)
        assert t.equals(saved)
        t.step()  # training after an in-memory restore must not write into the ring's buffers
        mgr.restore_memory(info)
        assert t.equals(saved)
        mgr.restore(info, tier="local")
        assert t.equals(saved)


def test_background_failure_is_raised_on_wait_next_call_and_close(tmp_path):
    t = Tiny()
    mgr = CheckpointManager(opts(tmp_path), t.state)
    tmp = tmp_path / "store" / ".tmp"
    os.rmdir(tmp)
    tmp.write_text("not a directory")  # every stage() now fails in the writer thread
    mgr.save(1)
    with pytest.raises(BackgroundSaveError, match="checkpoint 0000000001-000001"):
        mgr.wait()
    mgr.save(2)
    mgr._pending[0].exception()  # test-only: let the writer fail without raising here
    with pytest.raises(BackgroundSaveError, match="0000000002-000002"):
        mgr.save(3)
    mgr.save(4)
    with pytest.raises(BackgroundSaveError, match="0000000004-000003"):
        mgr.close()
    mgr.close()  # closing twice is harmless


def test_a_save_beyond_max_in_flight_waits_for_the_previous_commit(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path, max_in_flight=1, memory_slots=1), t.state) as mgr:
        first = mgr.save(1)
        t.step()
        mgr.save(2)
        # save(2) could only take the single slot once save(1) had committed.
        assert open_store(tmp_path / "store").get(first.id).id == first.id


def test_before_commit_runs_on_the_writer_before_the_commit_and_writing_says_a_save_would_block(tmp_path):
    import threading

    t = Tiny()
    release, seen = threading.Event(), []
    with CheckpointManager(opts(tmp_path, max_in_flight=1, memory_slots=1), t.state) as mgr:

        def hook():
            seen.append((threading.current_thread().name, open_store(tmp_path / "store").ids()))
            assert release.wait(30)

        info = mgr.save(1, before_commit=hook)  # returns while the hook holds the commit back
        assert mgr.writing()  # a second save now would block until the first commits
        release.set()
        mgr.wait()
        assert not mgr.writing()
        assert seen == [(seen[0][0], [])] and seen[0][0].startswith("ckpt-writer")  # not yet committed
        assert open_store(tmp_path / "store").ids() == [info.id]


@pytest.mark.parametrize("async_save", [True, False])
def test_a_failing_before_commit_commits_nothing_and_keeps_the_good_checkpoint(tmp_path, async_save):
    t = Tiny()
    with CheckpointManager(opts(tmp_path, async_save=async_save), t.state) as mgr:
        good = mgr.save(1)
        mgr.wait()
        t.step()

        def hook():
            raise OSError("metrics not sent")

        if async_save:
            mgr.save(2, before_commit=hook)
            with pytest.raises(BackgroundSaveError, match="metrics not sent"):
                mgr.wait()
        else:
            with pytest.raises(OSError, match="metrics not sent"):
                mgr.save(2, before_commit=hook)
        store = open_store(tmp_path / "store")
        assert store.ids() == [good.id]
        assert not list((tmp_path / "store" / ".tmp").iterdir())  # the staged files are gone too


def test_ids_stay_unique_when_a_step_is_saved_again_after_rollback(tmp_path, caplog):
    t = Tiny()
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        a = mgr.save(10, metrics={"loss": 3.0})
        t.step()
        b = mgr.save(20, metrics={"loss": 0.1})
        mgr.restore(a)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            gone = mgr.abandon_after(a)
        assert [g.id for g in gone] == [b.id] and "Abandoned checkpoint" in caplog.text
        t.step()
        c = mgr.save(20, metrics={"loss": 1.0})
        mgr.wait()
        assert c.id != b.id and c.parent_id == a.id and c.seq > b.seq
        assert mgr.latest().id == c.id
        assert mgr.best("loss").id == c.id  # the abandoned, better one is excluded
    with CheckpointManager(opts(tmp_path), Tiny().state) as mgr:
        assert [(i.id, i.abandoned) for i in mgr.list()] == [(a.id, False), (b.id, True), (c.id, False)]
        assert mgr.latest().id == c.id


def test_retention_deletes_abandoned_checkpoints_first_with_the_reason(tmp_path, caplog):
    t = Tiny()
    with CheckpointManager(opts(tmp_path, keep_last=3), t.state) as mgr:
        a = mgr.save(1)
        b = mgr.save(2, force=True)
        mgr.restore(a)
        mgr.abandon_after(a)
        with caplog.at_level(logging.INFO, logger=LOGGER):
            c = mgr.save(3)
            mgr.wait()
        assert [i.id for i in mgr.list()] == [a.id, c.id]
    assert f"Deleting checkpoint {b.id} (abandoned: on a branch that was rolled back)" in caplog.text


def test_unsupported_state_fails_the_save_at_once_naming_the_key(tmp_path):
    t = Tiny()
    t.state.extras = {"callback": print}
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        with pytest.raises(UnsupportedStateError, match="extras.callback"):
            mgr.save(1)
        t.state.extras = {}
        assert mgr.save(1).id == "0000000001-000001"


def test_latest_is_the_newest_commit_not_the_highest_step(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        mgr.save(500)
        mgr.restore()
        newer = mgr.save(300, force=True)
        mgr.wait()
        assert mgr.latest().id == newer.id


def test_same_step_is_saved_once_unless_forced(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        first = mgr.save(5)
        assert mgr.save(5) is first
        forced = mgr.save(5, force=True)
        mgr.wait()
        assert forced.id != first.id and len(mgr.list()) == 2


def test_retention_logs_every_deletion_with_its_reason_and_honours_protect(tmp_path, caplog):
    t = Tiny()
    with (
        caplog.at_level(logging.INFO, logger=LOGGER),
        CheckpointManager(opts(tmp_path, keep_last=1), t.state) as mgr,
    ):
        a = mgr.save(1)
        mgr.wait()
        mgr.protect([a.id])
        for step in (2, 3):
            t.step()
            mgr.save(step)
        mgr.wait()
        assert [i.step for i in mgr.list()] == [1, 3]
        mgr.unprotect([a.id])
        t.step()
        mgr.save(4)
        mgr.wait()
        assert [i.step for i in mgr.list()] == [4]
    assert f"Deleting checkpoint {a.id} (not among the last 1)" in caplog.text
    assert "Deleting checkpoint 0000000002-000002 (not among the last 1)" in caplog.text


def test_one_writer_per_store(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path), t.state):
        with pytest.raises(CheckpointError, match=f"pid {os.getpid()}.*holds the store lock"):
            CheckpointManager(opts(tmp_path), t.state)
        with pytest.raises(CheckpointError, match="holds the store lock"):
            open_store(tmp_path / "store").gc(None)
    with CheckpointManager(opts(tmp_path), t.state):
        pass


def test_not_found_errors(tmp_path):
    with CheckpointManager(opts(tmp_path), Tiny().state) as mgr:
        with pytest.raises(CheckpointNotFound, match="the store is empty"):
            mgr.restore()
        with pytest.raises(CheckpointNotFound, match="0000000001-000009"):
            mgr.restore("0000000001-000009")
        with pytest.raises(CheckpointNotFound, match="memory ring"):
            mgr.restore_memory()
        assert mgr.latest() is None and mgr.best("loss") is None


def test_manifest_records_checksums_versions_and_config(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path, config={"lr": 0.1}), t.state) as mgr:
        info = mgr.save(3, metrics={"loss": 1.5, "acc": 2})
    manifest = json.loads((tmp_path / "store" / f"ckpt-{info.id}" / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert (manifest["id"], manifest["step"], manifest["metrics"]) == (info.id, 3, {"acc": 2.0, "loss": 1.5})
    assert {"torch", "safetensors", "rollback-supervisor"} <= set(manifest["versions"])
    assert manifest["config_hash"] and "git_commit" in manifest
    for entry in manifest["files"]:
        assert (tmp_path / "store" / entry["path"]).stat().st_size == entry["size"] and len(
            entry["xxh3"]
        ) == 16
    marker = json.loads((tmp_path / "store" / f"ckpt-{info.id}" / "COMMITTED").read_text())
    assert marker["id"] == info.id


def test_open_cleans_what_a_crash_left(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        good = mgr.save(1)
    root = tmp_path / "store"
    (root / ".tmp" / "0000000002-000002.abcd").mkdir()
    (root / "ckpt-0000000003-000003").mkdir()
    (root / "ckpt-0000000003-000003" / "state.json").write_text("{}")
    (root / "blobs" / "0000000004-000004.safetensors").write_bytes(b"orphan")
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        assert [i.id for i in mgr.list()] == [good.id]
        nxt = mgr.save(2)
    assert sorted(os.listdir(root / ".tmp")) == []
    assert sorted(p.name for p in root.glob("ckpt-*")) == [f"ckpt-{good.id}", f"ckpt-{nxt.id}"]
    assert not (root / "blobs" / "0000000004-000004.safetensors").exists()


def test_partial_restore_from_disk_and_memory(tmp_path):
    t = Tiny()
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        info = mgr.save(1)
        saved = t.snapshot()
        t.step()
        after = t.snapshot()
        for tier in ("memory", "local"):
            mgr.restore(info, prefixes=["model.0."], tier=tier)
            live = t.state.live_tensors()
            assert torch.equal(live["model.0.weight"], saved["model.0.weight"])
            assert torch.equal(live["model.2.weight"], after["model.2.weight"])
            assert torch.equal(live["optimizer.state.0.exp_avg"], after["optimizer.state.0.exp_avg"])
            assert t.state.step == 2
            with torch.no_grad():
                live["model.0.weight"].copy_(after["model.0.weight"])


def test_extras_round_trip(tmp_path):
    t = Tiny()
    t.state.extras = {"note": "x"}
    with CheckpointManager(opts(tmp_path), t.state) as mgr:
        info = mgr.save(1, extras={"ema": torch.ones(3), "best": 0.25})
        t.state.extras = {}
        mgr.restore(info, tier="local")
    assert t.state.extras["note"] == "x" and t.state.extras["best"] == 0.25
    assert torch.equal(t.state.extras["ema"], torch.ones(3))


@pytest.mark.parametrize("tier", ["memory", "local"])
def test_restore_into_a_fresh_optimizer_trains_identically(tmp_path, tier):
    """A new process has no optimizer state yet; identical tensors (every 'step') must not end up shared."""
    t = Tiny()
    t.step()
    with CheckpointManager(opts(tmp_path, memory_slots=1), t.state) as mgr:
        info = mgr.save(1)
        rng = torch.get_rng_state()
        expected = [t.step() for _ in range(3)]
        fresh = Tiny(seed=11)
        mgr.state = fresh.state  # test-only: the same store, restored into objects that never trained
        mgr.restore(info, tier=tier)
        torch.set_rng_state(rng)
        steps = [s["step"] for s in fresh.opt.state.values()]
        assert len({id(s) for s in steps}) == len(steps)
        assert [fresh.step() for _ in range(3)] == expected


def test_an_in_process_rollback_does_not_wait_for_a_write_in_flight(tmp_path):
    """Rolling back to the save still being written restores its snapshot at once; it then commits as usual."""
    import threading

    t = Tiny()
    t.step()
    gate = threading.Event()
    with CheckpointManager(opts(tmp_path, memory_slots=2), t.state) as mgr:
        info = mgr.save(1, before_commit=lambda: gate.wait(30))
        saved = t.snapshot()
        t.step()
        assert [p.id for p in mgr.pending()] == [info.id] and mgr.list() == []
        assert [c.id for c in mgr.candidates()] == [info.id]
        restored = mgr.restore_memory(info, wait=False)
        assert mgr.abandon_after(restored, wait=False) == []
        assert not gate.is_set() and t.equals(saved) and t.state.step == 1  # nothing waited for the write
        gate.set()
        mgr.wait()
        assert [(i.id, i.abandoned) for i in mgr.list()] == [(info.id, False)] and mgr.pending() == []
        assert [c.id for c in mgr.candidates()] == [info.id]  # once, now as a commit


def test_a_rollback_past_a_write_in_flight_keeps_it_from_committing(tmp_path, caplog):
    import threading

    t = Tiny()
    t.step()
    gate = threading.Event()
    with CheckpointManager(opts(tmp_path, memory_slots=2), t.state) as mgr:
        good = mgr.save(1)
        mgr.wait()
        saved = t.snapshot()
        t.step()
        bad = mgr.save(2, before_commit=lambda: gate.wait(30))  # say the damage was already in this state
        restored = mgr.restore_memory(good, wait=False)
        caplog.set_level(logging.INFO, LOGGER)
        gone = mgr.abandon_after(restored, wait=False)
        assert [(i.id, i.abandoned) for i in gone] == [(bad.id, True)] and not gate.is_set()
        assert t.equals(saved) and mgr.pending() == []  # no longer a candidate for the next decision
        assert mgr.restore_memory("latest", wait=False).id == good.id  # nor the latest snapshot
        gate.set()
        mgr.wait()  # refused at its commit gate: not an error
        assert [i.id for i in mgr.list()] == [good.id]
        assert f"Checkpoint {bad.id} not committed: a rollback went past it" in caplog.text
        assert mgr.save(2).parent_id == good.id  # the new branch hangs off the rollback target
        mgr.wait()
        assert [i.step for i in mgr.list()] == [1, 2]


def test_a_rollback_target_that_retention_deleted_meanwhile_still_abandons_what_came_after(tmp_path):
    import threading

    t = Tiny()
    t.step()
    gate = threading.Event()
    with CheckpointManager(opts(tmp_path, memory_slots=2, keep_last=1), t.state) as mgr:
        target = mgr.save(1)
        mgr.wait()
        t.step()
        later = mgr.save(2, before_commit=lambda: gate.wait(30))
        restored = mgr.restore_memory(target, wait=False)
        gate.set()  # the later write commits now, and keep_last=1 deletes the target from disk
        mgr._pending[0].exception()  # test-only: let that commit land first
        assert [i.id for i in mgr.list()] == [later.id]
        gone = mgr.abandon_after(restored, wait=False)
        assert [i.id for i in gone] == [later.id]
        assert [(i.id, i.abandoned) for i in mgr.list()] == [(later.id, True)]  # never "latest" on a restart


@pytest.mark.parametrize(
    "bad",
    [
        {"remote": "file://{tmp}/a-file/store"},  # listing the remote fails: it lies below a regular file
        {"config": {"lr": 0.1, 3: "mixed key types"}},  # the config cannot be hashed (keys are not sortable)
    ],
    ids=["unreadable remote", "unhashable config"],
)
def test_a_failing_init_releases_the_store_lock_and_leaves_no_thread(tmp_path, bad):
    (tmp_path / "a-file").write_text("not a directory")
    kw = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in bad.items()}
    before = set(threading.enumerate())
    with pytest.raises((OSError, TypeError)):
        CheckpointManager(opts(tmp_path, **kw), Tiny().state)
    assert set(threading.enumerate()) == before
    with CheckpointManager(opts(tmp_path), Tiny().state) as mgr:  # the same process takes the lock again
        assert mgr.save(1).step == 1
