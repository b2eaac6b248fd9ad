"""Page-cache warm-up: the target checkpoint's files are read ahead on a thread while the new process starts.

Once the decision names a checkpoint, the relaunched process spends seconds starting before it reads it. A
daemon thread asks the kernel to read that checkpoint's blobs (`posix_fadvise(WILLNEED)`, or plain reads where
there is no fadvise) meanwhile, so the restore reads from memory. The launch never waits for it: `start()`
only starts the thread, and everything (listing the store, reading the manifest) happens on it. A checkpoint
that is not in the local store (remote only) is skipped: the training side downloads it, and reading ahead
here would compete with that download for nothing. A failure is logged and otherwise ignored: the restore
reads the files itself either way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("rollback_supervisor.launcher")

#: Read size where the platform has no posix_fadvise.
CHUNK = 8 << 20


def advise(path: str) -> int:
    """Ask the kernel to read `path` into the page cache; returns its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        else:  # pragma: no cover - Linux has fadvise
            while os.read(fd, CHUNK):
                pass
        return size
    finally:
        os.close(fd)


@dataclass
class Warmup:
    """One warm-up of one checkpoint's files; `join()` waits for it (tests, benchmarks)."""

    checkpoint_dir: Path
    checkpoint_id: str | None
    read: Callable[[str], int] = advise
    files: list[str] = field(default_factory=list)
    bytes: int = 0
    skipped: str | None = None  #: why nothing was read (not local, no checkpoint named), else None
    seconds: float = 0.0
    _thread: threading.Thread | None = None

    def start(self) -> Warmup:
        """Start reading ahead on a daemon thread; returns at once."""
        self._thread = threading.Thread(target=self._run, name="checkpoint-warmup", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the warm-up to end; whether it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            paths = self._local_files()
            for path in paths:
                self.bytes += self.read(path)
                self.files.append(path)
        except Exception as exc:  # the restore reads the files itself; a warm-up must never fail a relaunch
            log.warning("page-cache warm-up of checkpoint %s failed: %s", self.checkpoint_id, exc)
        self.seconds = time.monotonic() - t0
        if self.skipped:
            log.info("page-cache warm-up skipped: %s", self.skipped)
        else:
            log.info(
                "page-cache warm-up of checkpoint %s: %d files, %.0f MiB asked for in %.2fs",
                self.checkpoint_id,
                len(self.files),
                self.bytes / 2**20,
                self.seconds,
            )

    def _local_files(self) -> list[str]:
        """The blob and state files of the checkpoint in the local store; [] (and `skipped`) if it is not there."""
        from supervisor.checkpoint.catalog import open_store

        if self.checkpoint_id is None:
            self.skipped = "the plan names no checkpoint"
            return []
        if not self.checkpoint_dir.is_dir():
            self.skipped = f"no local store at {self.checkpoint_dir} (the checkpoint is remote only)"
            return []
        catalog = open_store(self.checkpoint_dir)
        if self.checkpoint_id not in catalog.ids() or not catalog.committed(self.checkpoint_id):
            self.skipped = f"checkpoint {self.checkpoint_id} is not in the local store (remote only)"
            return []
        manifest = catalog.manifest(self.checkpoint_id)
        rels = sorted(manifest.blobs()) + [f.path for f in manifest.files]
        return [catalog.confined(rel) for rel in dict.fromkeys(rels)]


def warm_checkpoint(
    checkpoint_dir: Path, checkpoint_id: str | None, read: Callable[[str], int] = advise
) -> Warmup:
    """Start warming the page cache for `checkpoint_id` of the local store at `checkpoint_dir`; returns at once."""
    return Warmup(Path(checkpoint_dir), checkpoint_id, read).start()
