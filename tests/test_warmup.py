"""Page-cache warm-up of the target checkpoint: on a thread, never in the launch's way, remote-only skipped."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.launcher.warmup import advise, warm_checkpoint
from tests.ckpt_scripts.tiny import Tiny


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, list[str]]:
    """A local store with two committed checkpoints of a real training state; their ids."""
    t = Tiny(width=64)
    directory = tmp_path / "checkpoints"
    with CheckpointManager(CheckpointOptions(directory=directory, async_save=False), t.state) as mgr:
        ids = []
        for _ in range(2):
            t.step()
            ids.append(mgr.save(t.state.step).id)
    return directory, ids


def files_of(directory: Path, checkpoint_id: str) -> list[str]:
    catalog = open_store(directory)
    manifest = catalog.manifest(checkpoint_id)
    return sorted({catalog.path(rel) for rel in [*manifest.blobs(), *(f.path for f in manifest.files)]})


def test_every_file_of_the_target_is_read_ahead(store):
    directory, ids = store
    warm = warm_checkpoint(directory, ids[-1])
    assert warm.join(30)
    assert warm.skipped is None and sorted(warm.files) == files_of(directory, ids[-1])
    assert warm.bytes == sum(Path(p).stat().st_size for p in warm.files) > 0


def test_the_launch_never_waits_for_the_reads(store):
    """start() returns while the read-ahead is still blocked on its first file."""
    directory, ids = store
    reading, release = threading.Event(), threading.Event()

    def slow_read(path: str) -> int:
        reading.set()
        release.wait(30)
        return advise(path)

    warm = warm_checkpoint(directory, ids[0], read=slow_read)  # returns at once
    assert reading.wait(30) and not warm.join(0) and warm.files == []  # still reading, and we went on
    release.set()
    assert warm.join(30) and sorted(warm.files) == files_of(directory, ids[0])


@pytest.mark.parametrize("where", ["not in the local store", "no local store"])
def test_a_remote_only_checkpoint_is_skipped_without_a_read(store, where):
    directory, ids = store
    reads: list[str] = []

    def read(path: str) -> int:
        reads.append(path)
        return 0

    if where == "no local store":
        directory = directory.parent / "fresh-machine"
    target = "0000000099-" + ids[0].split("-", 1)[1]  # a well-formed id this store does not hold
    warm = warm_checkpoint(directory, target, read=read)
    assert warm.join(30)
    assert reads == [] and warm.files == [] and "remote only" in (warm.skipped or "")


def test_no_named_checkpoint_and_a_broken_store_read_nothing(store, caplog):
    directory, ids = store
    assert warm_checkpoint(directory, None).join(30)
    (directory / ("ckpt-" + ids[0]) / "manifest.json").write_text("{")  # damaged: the restore will say so
    warm = warm_checkpoint(directory, ids[0])
    assert warm.join(30) and warm.files == []
    assert "page-cache warm-up of checkpoint" in caplog.text and "failed" in caplog.text
