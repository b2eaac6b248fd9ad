"""A standby's preload: the newest commit read into memory ahead, then restored as the disk restore would be.

Real checkpoints written by the CheckpointManager of a real model (AdamW, scheduler, GradScaler); the
preloader reads them from another "process" (a second TrainingState with a fresh optimizer, as a parked
standby has). Its polls are called by hand: the thread that calls them in a standby is not under test here.
"""

from __future__ import annotations

import logging
import random
import re
import time

import numpy as np
import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, preload
from supervisor.checkpoint.preload import Preloader
from tests.ckpt_scripts.tiny import Tiny
from tests.test_checkpoint_corruption import flip_byte

LOGGER = "rollback_supervisor.checkpoint"
NEVER = 3600.0  # the follower thread's poll interval: the tests poll by hand


@pytest.fixture(autouse=True)
def nothing_published():
    preload.discard()
    yield
    preload.discard()


def saved_run(tmp_path, steps=(1, 2)) -> tuple[Tiny, list]:
    """A trained Tiny and the checkpoints it committed, one per step in `steps` (no memory tier)."""
    t = Tiny()
    infos = []
    with CheckpointManager(CheckpointOptions(tmp_path / "ckpt", memory_slots=0), t.state) as mgr:
        for _ in steps:
            t.step()
            infos.append(mgr.save(t.state.step))
        mgr.wait()
    return t, infos


def restored(tmp_path, cid: str, caplog) -> tuple[Tiny, str]:
    """A fresh Tiny (other seed, no optimizer state yet) restored to `cid` by its own manager; the tier used.
    The RNG streams the restore set are kept on it (`rng`)."""
    t = Tiny(seed=7)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with CheckpointManager(CheckpointOptions(tmp_path / "ckpt", memory_slots=0), t.state) as mgr:
            mgr.restore(cid)
            t.rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    tiers = [
        m.group(1) for r in caplog.records if (m := re.search(r"from the (\w+) tier in", r.getMessage()))
    ]
    assert len(tiers) == 1, tiers
    return t, tiers[0]


def assert_same(a: Tiny, b: Tiny) -> None:
    live_a, live_b = a.state.live_tensors(), b.state.live_tensors()
    assert live_a.keys() == live_b.keys() and live_a
    for key in live_a:
        assert torch.equal(live_a[key], live_b[key]), key
    assert a.sched.state_dict() == b.sched.state_dict()
    assert a.scaler.state_dict() == b.scaler.state_dict()
    assert a.state.step == b.state.step
    if hasattr(a, "rng") and hasattr(b, "rng"):
        assert torch.equal(a.rng[0], b.rng[0]) and a.rng[1] == b.rng[1]
        assert np.array_equal(a.rng[2], b.rng[2])


def test_a_preloaded_restore_is_the_disk_restore_bit_for_bit_and_trains_on_identically(tmp_path, caplog):
    _, infos = saved_run(tmp_path)
    from_disk, tier = restored(tmp_path, infos[-1].id, caplog)
    assert tier == "local"

    loader = Preloader(str(tmp_path / "ckpt"), poll_seconds=NEVER).start()
    assert loader.held == infos[-1].id  # read before start() returns: before a standby says it is ready
    assert loader.finish() == infos[-1].id
    random.seed(99)  # other streams than the checkpoint's: the restore must set them all
    torch.manual_seed(99)
    from_memory, tier = restored(tmp_path, infos[-1].id, caplog)
    assert tier == "preloaded"
    assert_same(from_disk, from_memory)
    assert preload.take(str(tmp_path / "ckpt"), infos[-1].id) is None  # handed over once
    torch.set_rng_state(from_disk.rng[0])
    disk_loss = from_disk.step()
    torch.set_rng_state(from_memory.rng[0])
    assert from_memory.step() == disk_loss
    assert_same(from_disk, from_memory)


def test_the_preloader_follows_newer_commits_and_passes_over_corrupt_and_unhealthy_ones(tmp_path, caplog):
    t = Tiny()
    root = tmp_path / "ckpt"
    loader = Preloader(str(root), poll_seconds=NEVER).start()
    assert loader.held is None  # nothing committed yet (not even the directory)
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t.state) as mgr:
        t.step()
        first = mgr.save(1)
        mgr.wait()
        loader.poll()
        assert loader.held == first.id
        t.step()
        second = mgr.save(2)
        mgr.wait()
        loader.poll()
        assert loader.held == second.id
        t.step()
        third = mgr.save(3)
        mgr.wait()
        flip_byte(root, third.id)  # fails the full verification of the read
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            loader.poll()
            assert loader.held is None and f"not preloading checkpoint {third.id}" in caplog.text
            loader.poll()  # back to the newest one still usable
            assert loader.held == second.id
        with torch.no_grad():
            t.model[0].weight[0, 0] = float("nan")
        fourth = mgr.save(4)
        mgr.wait()
        assert not mgr.get(fourth.id).healthy
        loader.poll()
        assert loader.held == second.id  # an unhealthy commit is never what `latest` resumes from
    assert loader.finish() == second.id


def test_a_restore_of_another_checkpoint_reads_the_disk_and_the_copy_is_dropped(tmp_path, caplog):
    _, infos = saved_run(tmp_path)
    loader = Preloader(str(tmp_path / "ckpt"), poll_seconds=NEVER).start()
    assert loader.finish() == infos[-1].id
    assert preload.take(str(tmp_path / "elsewhere"), infos[-1].id) is None  # another store's: not this copy
    older, tier = restored(tmp_path, infos[0].id, caplog)  # a rollback's target: older than the copy
    assert tier == "local"
    from_disk, _ = restored(tmp_path, infos[0].id, caplog)
    assert_same(older, from_disk)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        preload.discard()
    assert f"preloaded checkpoint {infos[-1].id} was not the one restored" in caplog.text
    assert preload.take(str(tmp_path / "ckpt"), infos[-1].id) is None


def test_a_commit_made_while_parked_is_read_by_the_follower_thread(tmp_path):
    t = Tiny()
    root = tmp_path / "ckpt"
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t.state) as mgr:
        t.step()
        mgr.save(1)
        mgr.wait()
        loader = Preloader(str(root), poll_seconds=0.01).start()
        t.step()
        newer = mgr.save(2)
        mgr.wait()
        deadline = time.monotonic() + 30
        while loader.held != newer.id and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loader.finish() == newer.id


def test_a_store_of_sharded_checkpoints_is_not_preloaded_and_the_preloader_stops(tmp_path, caplog):
    from tests.test_dcp_storage import _save_sharded

    t = Tiny()
    t.step()
    _save_sharded(tmp_path / "ckpt", t, 1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        loader = Preloader(str(tmp_path / "ckpt"), poll_seconds=0.01).start()
        assert loader.held is None and "holds sharded (DCP) checkpoints; not preloading" in caplog.text
        assert loader._thread is not None
        loader._thread.join(timeout=30)  # stopped itself: nothing more to follow
        assert not loader._thread.is_alive()
    assert loader.finish() is None


def test_a_non_zero_ddp_rank_restores_its_own_preloaded_copy(tmp_path, caplog):
    from supervisor.runtime.distributed import ReadOnlyCheckpoints

    _, infos = saved_run(tmp_path)
    from_disk, _ = restored(tmp_path, infos[-1].id, caplog)
    assert Preloader(str(tmp_path / "ckpt"), poll_seconds=NEVER).start().finish() == infos[-1].id
    rank = Tiny(seed=7)
    with caplog.at_level(logging.INFO):
        ReadOnlyCheckpoints(tmp_path / "ckpt", rank.state).restore(infos[-1].id)
    assert f"rank restored checkpoint {infos[-1].id} (read-only, preloaded)" in caplog.text
    assert preload.take(str(tmp_path / "ckpt"), infos[-1].id) is None
    assert_same(from_disk, rank)


def test_the_plans_target_decides_what_is_published(tmp_path):
    _, infos = saved_run(tmp_path)
    root = str(tmp_path / "ckpt")
    assert (
        Preloader(root, poll_seconds=NEVER).start().finish(infos[0].id) is None
    )  # a rollback's older target
    assert preload.take(root, infos[-1].id) is None  # dropped at once, not published beside the disk read
    assert Preloader(root, poll_seconds=NEVER).start().finish("") is None  # from scratch
    assert Preloader(root, poll_seconds=NEVER).start().finish(infos[-1].id) == infos[-1].id
    assert preload.take(root, infos[-1].id) is not None


def test_an_abandoned_copy_is_replaced_by_the_newest_live_commit(tmp_path):
    t = Tiny()
    root = tmp_path / "ckpt"
    with CheckpointManager(CheckpointOptions(root, memory_slots=0), t.state) as mgr:
        for step in (1, 2):
            t.step()
            mgr.save(step)
        mgr.wait()
        first, second = mgr.list()
        loader = Preloader(str(root), poll_seconds=NEVER).start()
        assert loader.held == second.id
        mgr.abandon_after(first)  # an in-process rollback to the first: the second is a dead branch
        loader.poll()
        assert loader.held == first.id
    assert loader.finish() == first.id


@pytest.mark.parametrize("short", ["margin", "ranks"])
def test_a_read_that_would_leave_too_little_memory_is_not_made(tmp_path, caplog, monkeypatch, short):
    _, infos = saved_run(tmp_path)
    if short == "margin":
        monkeypatch.setattr(
            "supervisor.checkpoint.preload.MEMORY_MARGIN", 1 << 62
        )  # more than any machine has
    else:  # every parked rank of a torchrun agent reads its own copy: all of them must fit
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str((1 << 62) // max(1, infos[-1].nbytes)))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        loader = Preloader(str(tmp_path / "ckpt"), poll_seconds=NEVER).start()
    assert loader.held is None
    assert f"not preloading checkpoint {infos[-1].id}" in caplog.text and "of memory available" in caplog.text
    assert loader.finish() is None


def test_a_cancelled_read_stops_before_the_next_tensor(tmp_path, monkeypatch):
    import threading

    from supervisor.checkpoint import open_store
    from supervisor.checkpoint import restore as restore_module
    from supervisor.checkpoint.restore import ReadCancelled, read_local

    _, infos = saved_run(tmp_path)
    catalog = open_store(tmp_path / "ckpt")
    manifest = catalog.manifest(infos[-1].id)
    assert read_local(catalog, manifest, threads=1).id == infos[-1].id
    cancel, reads = threading.Event(), []
    real = restore_module._read

    def read_then_cancel(r, check):
        reads.append(r)
        real(r, check)
        cancel.set()  # after the first tensor

    with monkeypatch.context() as m:
        m.setattr(restore_module, "_read", read_then_cancel)
        with pytest.raises(ReadCancelled):
            read_local(catalog, manifest, threads=1, cancel=cancel)
    assert len(reads) == 1 and len(manifest.tensors) > 1


def test_the_plan_cancels_a_read_in_progress_of_another_checkpoint(tmp_path, caplog, monkeypatch):
    """The newest commit is being read when the plan arrives for an older one (a rollback): the read stops at
    its next tensor, nothing is published, and the preloader's thread is gone."""
    import threading

    from supervisor.checkpoint import preload as preload_module

    _, infos = saved_run(tmp_path)
    started = threading.Event()
    real = preload_module.read_local

    def slow_read(catalog, manifest, verify, *, threads, cancel):
        started.set()
        assert cancel.wait(30), "finish() never cancelled the read"
        return real(catalog, manifest, verify, threads=threads, cancel=cancel)

    monkeypatch.setattr(preload_module, "read_local", slow_read)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        loader = Preloader(str(tmp_path / "ckpt"), poll_seconds=NEVER).start(first_wait=0)
        assert started.wait(30) and loader.held is None  # start() returned with the read going on
        assert loader.finish(infos[0].id) is None
    assert f"the read of {infos[-1].id} was cancelled" in caplog.text
    assert loader._thread is not None and not loader._thread.is_alive()
    assert preload.take(str(tmp_path / "ckpt"), infos[-1].id) is None


def test_the_first_read_never_takes_more_than_half_the_park_time_left(tmp_path, monkeypatch):
    """A standby that does not reach its park point in time is killed and later ones park at their imports: the
    park point waits for the first read at most half the time the supervisor still gives it."""
    import sys
    import types

    from supervisor.runtime import plan

    _, infos = saved_run(tmp_path)
    waits, reports = [], []
    real_start = Preloader.start

    def start(self, first_wait=preload.FIRST_READ_WAIT_SECONDS):
        waits.append(first_wait)
        return real_start(self, first_wait)

    monkeypatch.setattr(Preloader, "start", start)
    monkeypatch.delenv(plan.PLAN_ENV, raising=False)
    for left, expected in ((7.0, 3.5), (600.0, preload.FIRST_READ_WAIT_SECONDS), (-1.0, 0.0)):
        park = types.ModuleType(plan.PARK_MODULE)
        park.wait = reports.append
        park.preload = str(tmp_path / "ckpt")
        park.park_seconds_left = lambda left=left: left
        monkeypatch.setitem(sys.modules, plan.PARK_MODULE, park)
        plan.park_point()
        assert waits[-1] == expected
        assert plan.PARK_MODULE not in sys.modules  # parked once: later calls return at once
        preload.discard()
    # A small checkpoint is read well within those waits: the standby reports it ready with the copy held.
    assert [r["preloaded"] for r in reports[:2]] == [infos[-1].id, infos[-1].id]
