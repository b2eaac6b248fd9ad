"""Storage faults during a save (issue 14, 6.1): a full disk (ENOSPC), a dying one (EIO) and a read-only one,
on real filesystems mounted for the test, and a remote store whose Nth write fails.

Whatever fails and wherever in the save it fails, nothing is committed half-way and nothing of the failed
save stays on disk; every earlier checkpoint verifies and restores bit for bit; a failing periodic save is
reported (log, metric, events.jsonl) and training goes on. The emergency save is in test_storage_faults_e2e.py.
"""

from __future__ import annotations

import errno
import json
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import CKPT_PREFIX
from supervisor.checkpoint.remote import RemoteTier
from supervisor.runtime import Session
from supervisor.runtime.faults import FAULTS_ENV
from supervisor.runtime.plan import LaunchPlan
from supervisor.state import TrainingState
from tests.faulty_fs import PAGE, FaultyFileSystem, LoopDisk, SmallDisk, mount_refused

EVERY = 5
STEPS = 40
BREAK_AT, HEAL_AT = 12, 27  # the saves at steps 15, 20 and 25 meet the fault


@pytest.fixture(scope="module")
def can_mount(tmp_path_factory: pytest.TempPathFactory) -> None:
    reason = mount_refused(tmp_path_factory.mktemp("probe") / "mnt")
    if reason:
        pytest.skip(reason)


@pytest.fixture
def small_disk(can_mount, tmp_path: Path) -> Iterator[SmallDisk]:
    disk = SmallDisk(tmp_path / "disk", 1 << 20)
    try:
        yield disk
    finally:
        disk.unmount()


@pytest.fixture
def loop_disk(can_mount, tmp_path: Path) -> Iterator[LoopDisk]:
    try:
        disk = LoopDisk(tmp_path / "disk", tmp_path / "disk.img")
    except Exception as exc:  # a machine that mounts a tmpfs but has no free loop device
        pytest.skip(f"cannot set up an ext4 loop device here ({exc})")
    try:
        yield disk
    finally:
        disk.unmount()


class Model:
    """A real model and AdamW state (about `width`^2 x 12 bytes), registered in a TrainingState."""

    def __init__(self, width: int = 64, seed: int = 0):
        torch.manual_seed(seed)
        self.net = torch.nn.Linear(width, width)
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        self.state = TrainingState()
        self.state.register("model", self.net)
        self.state.register("optimizer", self.opt)
        self.width = width

    def step(self) -> None:
        self.opt.zero_grad()
        self.net(torch.randn(4, self.width)).pow(2).mean().backward()
        self.opt.step()

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.state.live_tensors().items()}


def assert_bit_identical(
    store: Path, checkpoint_id: str, expected: dict[str, torch.Tensor], width: int
) -> None:
    """Restore `checkpoint_id` into a fresh model from a new manager, and compare every tensor's bytes."""
    fresh = Model(width, seed=123)
    with CheckpointManager(CheckpointOptions(store), fresh.state) as mgr:
        mgr.restore(checkpoint_id)
    got = fresh.state.live_tensors()
    assert got.keys() == expected.keys()
    for key, want in expected.items():
        assert torch.equal(got[key].reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (
            f"{checkpoint_id}: {key} differs"
        )


def assert_nothing_half_done(store: Path, committed: list[str]) -> None:
    """Only the committed checkpoints are there, each valid; no temp dir, no uncommitted dir, no orphan blob."""
    catalog = open_store(store)
    assert [i.id for i in catalog.list()] == committed
    for cid in committed:
        assert catalog.verify(cid, "full") is None, cid
    entries = set(os.listdir(store)) - {".lock", ".tmp", "blobs"}
    assert entries == {CKPT_PREFIX + c for c in committed}, "an uncommitted checkpoint directory was left"
    assert os.listdir(store / ".tmp") == []
    assert set(catalog.blob_files()) == catalog.referenced_blobs(), "a blob of the failed save was left"


def _where(exc: BaseException) -> set[str]:
    """The checkpoint-store functions on the failure's stack (which write of the save failed)."""
    cause = exc.__cause__ or exc
    return {
        f.name for f in traceback.extract_tb(cause.__traceback__) if "supervisor/checkpoint" in f.filename
    }


# -- a full disk at every page of a save ----------------------------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_full_disk_at_any_point_of_a_save_commits_nothing_half_way(small_disk: SmallDisk, async_save: bool):
    """Free space from 0 pages up to what one save needs: the save fails at each of its writes in turn
    (blob, state, manifest, the commit marker) and leaves nothing; the earlier checkpoints stay valid."""
    store = small_disk.path / "store"
    model = Model()
    expected: dict[str, dict[str, torch.Tensor]] = {}
    committed: list[str] = []
    failed_in: set[str] = set()
    with CheckpointManager(
        CheckpointOptions(store, async_save=async_save, memory_slots=0), model.state
    ) as mgr:
        for step in (1, 2):
            model.step()
            committed.append(mgr.save(step).id)
            mgr.wait()
            expected[committed[-1]] = model.tensors()
        leave, step = 0, 2
        while True:
            model.step()  # new bytes: dedup cannot make the save free
            step += 1
            small_disk.fill(leave=leave * PAGE)
            try:
                info = mgr.save(step)
                mgr.wait()
            except OSError as exc:  # a synchronous save
                assert exc.errno == errno.ENOSPC
                failed_in |= _where(exc)
            except Exception as exc:  # BackgroundSaveError from the writer thread
                assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC, exc
                failed_in |= _where(exc)
            else:
                committed.append(info.id)
                expected[info.id] = model.tensors()
                break
            finally:
                small_disk.unfill()
            assert_nothing_half_done(store, committed)
            leave += 1
            assert leave < 200, "the save never fitted"
    # The sweep reached every write of the save: the tensor data, and the commit itself (manifest, marker).
    assert {"write_blob", "commit"} <= failed_in, failed_in
    assert_nothing_half_done(store, committed)
    for cid in committed:
        assert_bit_identical(store, cid, expected[cid], model.width)


# -- training meets a full, read-only or failing disk --------------------------------------------------------

POLICY = f"""\
version: 1
name: storage-faults
checkpoint: {{every_steps: {EVERY}, keep_last: 50, async: {{async}}, memory_slots: 1, storage: ./checkpoints}}
monitor: {{detectors: []}}
rules: [{{when: [preemption], action: resume, target: {{select: latest}}}}]
"""


def _session(tmp_path: Path, store: Path, async_save: bool, policy: str = POLICY) -> Session:
    work = tmp_path / "work"
    (tmp_path / "policy.yaml").write_text(policy.replace("{async}", str(async_save).lower()))
    plan = LaunchPlan(
        lineage="faults",
        workdir=str(work),
        checkpoint_dir=str(store),
        tracking_uri="sqlite:///unused.db",  # metrics go to the spool: the training side never opens MLflow
        run_id="run",
        policy_path=str(tmp_path / "policy.yaml"),
        metrics_spool=str(work / "metrics" / "0.jsonl"),
    )
    return Session(plan)


#: name: (fixture, errno the saves meet, how to break the disk, how to heal it: None for never)
FAULTS = {
    "enospc": ("small_disk", errno.ENOSPC, SmallDisk.fill, SmallDisk.unfill),
    "eio": ("loop_disk", errno.EIO, LoopDisk.cut, LoopDisk.heal),
    "read-only": ("loop_disk", errno.EROFS, LoopDisk.fail_read_only, None),
}


@pytest.mark.parametrize(
    "fault, async_save",
    [("enospc", True), ("enospc", False), ("eio", True), ("read-only", True)],
    ids=["enospc", "enospc-sync", "eio", "read-only"],
)
def test_failing_periodic_saves_are_reported_and_training_goes_on(
    request: pytest.FixtureRequest, tmp_path: Path, fault: str, async_save: bool
):
    fixture, err, break_disk, heal_disk = FAULTS[fault]
    disk = request.getfixturevalue(fixture)
    store = disk.path / "checkpoints"
    sess = _session(tmp_path, store, async_save)
    torch.manual_seed(0)
    width = (
        512 if fault == "eio" else 32
    )  # 3 MB: past the cut's margin, the blob's data lands beyond the device
    net = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    sess.register(model=net, optimizer=opt)
    saved_at: dict[int, dict[str, torch.Tensor]] = {}
    with sess:
        for step, x in sess.loop([torch.randn(4, width) for _ in range(STEPS)], max_steps=STEPS):
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
            sess.log(loss=float(step))
            if step == 10:
                saved_at[step] = {k: v.clone() for k, v in sess.state.live_tensors().items()}
            if step == BREAK_AT:
                sess.manager.wait()  # the step-10 checkpoint is committed before the disk breaks
                break_disk(disk)
            elif step == HEAL_AT and heal_disk is not None:
                while sess.manager.pending():  # the step-25 save meets the fault even when its writer lags
                    time.sleep(0.01)
                heal_disk(disk)
    # Training went on to the end. It finished normally, unless its final checkpoint could not be written.
    assert sess.step == STEPS
    failed_steps = list(range(15, HEAL_AT, EVERY)) if heal_disk else list(range(15, STEPS + 1, EVERY))
    assert sess.exit_code == (0 if heal_disk else 1)
    if fault != "enospc":
        disk.remount()  # read back from the device, not from the page cache
    catalog = open_store(store)
    steps = [i.step for i in catalog.list()]
    assert steps == [s for s in range(EVERY, STEPS + 1, EVERY) if s not in failed_steps]
    assert_nothing_half_done(store, [i.id for i in catalog.list()])
    ten = next(i for i in catalog.list() if i.step == 10)
    assert_bit_identical(store, ten.id, saved_at[10], width)
    # Each failed save is reported to the supervisor (events.jsonl) and to the metric curve (the spool).
    events = [json.loads(line) for line in Path(sess.plan.events_path).read_text().splitlines()]
    failures = [e for e in events if e.get("kind") == "save_failed"]
    assert len(failures) == len(failed_steps), failures
    for rec, step in zip(failures, failed_steps, strict=True):
        assert rec["event"]["type"] == "storage_error" and rec["event"]["evidence"]["errno"] == err
        if async_save:  # the writer thread names the checkpoint it could not write
            assert f"checkpoint {step:010d}-" in rec["event"]["reason"]
    spool = [json.loads(line) for line in Path(sess.plan.metrics_spool).read_text().splitlines()]
    counts = [p[1] for p in spool if p[0] == "checkpoint.save_failures"]
    assert counts == [float(n) for n in range(1, len(failed_steps) + 1)]


# -- a remote store that fails its Nth write (fsspec) ------------------------------------------------------------


def test_an_upload_failing_at_any_write_leaves_the_remote_copy_of_earlier_checkpoints_valid(tmp_path: Path):
    """Every write of an upload (blob, manifest, marker) fails in turn: the remote never shows the checkpoint
    committed, keeps the earlier one valid, and a machine that has only the remote restores it bit for bit."""
    model = Model()
    expected = {}
    with CheckpointManager(CheckpointOptions(tmp_path / "local", async_save=False), model.state) as mgr:
        for step in (1, 2):
            model.step()
            mgr.save(step)
            expected[step] = model.tensors()
    remote_url = f"faulty://{tmp_path / 'remote'}"
    remote = RemoteTier(remote_url, attempts=2, sleep=lambda _s: None)
    local = LocalStore(tmp_path / "local")
    try:
        first, second = (local.catalog.manifest(i.id) for i in local.catalog.list())
        remote.upload(local, first)
        FaultyFileSystem.arm(None)
        remote.upload(local, second)  # counts the writes one upload makes
        per_upload = FaultyFileSystem.writes
        remote.catalog.delete(second.id)
        assert per_upload >= 3
        for n in range(1, per_upload + 1):
            FaultyFileSystem.arm(n)  # from the nth write on, every write (and its retry) fails
            with pytest.raises(OSError, match="injected"):
                remote.upload(local, second)
            FaultyFileSystem.heal()
            catalog: Catalog = remote.catalog
            assert [i.id for i in catalog.list()] == [first.id], f"write {n}"
            assert catalog.verify(first.id, "full") is None
            remote.apply_retention(None)  # what the next upload does first: the half-upload goes
            assert catalog.ids() == [first.id]
    finally:
        FaultyFileSystem.heal()
        local.close()
    fresh = Model(seed=9)
    options = CheckpointOptions(tmp_path / "new-machine", remote=remote_url)
    with CheckpointManager(options, fresh.state) as mgr:
        info = mgr.restore("latest")
    assert info.id == first.id
    got = fresh.state.live_tensors()
    assert all(torch.equal(got[k], v) for k, v in expected[1].items())


ROLLBACK_POLICY = f"""\
version: 1
name: storage-faults-rollback
checkpoint: {{every_steps: {EVERY}, keep_last: 50, async: true, memory_slots: 1, storage: ./checkpoints}}
monitor:
  detectors:
    - {{type: non_finite, metrics: [loss]}}
rules:
  - {{when: [non_finite], action: rollback, target: {{select: latest}}}}
"""


def test_an_in_process_rollback_after_a_failed_save_reports_it_and_rolls_back_to_the_newest_committed(
    small_disk: SmallDisk, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The failure of the step-15 save is still unreported when a NaN at step 17 asks for a rollback: the
    rollback reports it and goes on to the newest committed checkpoint (step 10)."""
    monkeypatch.setenv(FAULTS_ENV, "nan@17")
    sess = _session(tmp_path, small_disk.path / "checkpoints", True, ROLLBACK_POLICY)
    torch.manual_seed(0)
    net = torch.nn.Linear(32, 1)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    sess.register(model=net, optimizer=opt)
    with sess:
        for step, x in sess.loop([torch.randn(4, 32) for _ in range(STEPS)], max_steps=STEPS):
            opt.zero_grad()
            loss = net(x).pow(2).mean()
            loss.backward()
            opt.step()
            sess.log(loss=loss.item())
            if step == BREAK_AT and not sess.rollbacks_in_process:
                sess.manager.wait()
                small_disk.fill()
            elif sess.rollbacks_in_process and small_disk.free() == 0:
                small_disk.unfill()  # room again on the new branch
    assert sess.step == STEPS and sess.exit_code == 0 and sess.rollbacks_in_process == 1
    events = [json.loads(line) for line in Path(sess.plan.events_path).read_text().splitlines()]
    assert [e.get("kind") or e["event"]["type"] for e in events] == ["save_failed", "non_finite"]
    assert "checkpoint 0000000015-" in events[0]["event"]["reason"]
    target = events[1]["decision"]["target_id"]
    assert target.startswith("0000000010-")
    live = [i for i in open_store(small_disk.path / "checkpoints").list() if not i.abandoned]
    assert [i.step for i in live] == [5, 10, 15, 20, 25, 30, 35, 40]
