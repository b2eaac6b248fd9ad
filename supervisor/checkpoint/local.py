"""Writer side of a local store: one writer at a time, atomic directory commits, cleanup after crashes.

A commit: files are written and fsynced in `.tmp/<id>/`, the directory is fsynced, new blobs are renamed into
`blobs/`, the directory is renamed to `ckpt-<id>/`, and the COMMITTED marker is written last. A checkpoint
without a whole marker never counts; open() deletes it, leftover temp dirs and blobs nothing references.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid

import fsspec

from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.lock import take_lock
from supervisor.checkpoint.manifest import ABANDONED, BLOBS, CKPT_PREFIX, MANIFEST, MARKER, marker_bytes
from supervisor.checkpoint.paths import resolves_outside
from supervisor.errors import CheckpointError

log = logging.getLogger("rollback_supervisor.checkpoint")
TMP = ".tmp"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: str, data: bytes, *, exclusive: bool = False) -> None:
    """Write and fsync `data` to `path`."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    """Delete a directory tree, or only the link when `path` is a symlink (never what it points to)."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


class LocalStore:
    """The one writer of a local store directory (an exclusive lock guards it until close())."""

    def __init__(self, directory: str | os.PathLike[str]):
        self.root = os.path.abspath(os.fspath(directory))
        for sub in ("", BLOBS, TMP):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
        for sub in (BLOBS, TMP):  # the writer renames into them and deletes from them: they must be ours
            if why := resolves_outside(self.root, self.path(sub)):
                raise CheckpointError(f"{self.path(sub)} is {why}; replace it with a directory")
        self._lock_fd: int | None = take_lock(self.root)
        self.catalog = Catalog(fsspec.filesystem("file"), self.root, tier="local")
        self.cleanup()

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def cleanup(self) -> list[str]:
        """Remove temp dirs, uncommitted checkpoint dirs and unreferenced blobs; returns what went."""
        removed = []
        for name in sorted(os.listdir(self.path(TMP))):
            _remove(self.path(TMP, name))
            removed.append(f"{TMP}/{name}")
        for cid in self.catalog.ids():
            if not self.catalog.committed(cid):
                shutil.rmtree(self.path(CKPT_PREFIX + cid), ignore_errors=True)
                removed.append(CKPT_PREFIX + cid)
        removed += self.catalog.gc_blobs()
        for what in removed:
            log.info("Removed %s from %s (left by an unfinished save)", what, self.root)
        return removed

    def stage(self, checkpoint_id: str) -> str:
        """A fresh temp directory to write checkpoint `checkpoint_id` into."""
        staged = self.path(TMP, f"{checkpoint_id}.{uuid.uuid4().hex[:8]}")
        os.makedirs(staged)
        return staged

    def commit(
        self,
        checkpoint_id: str,
        staged: str,
        manifest_raw: bytes,
        blobs: list[str],
        marker: bytes | None = None,
    ) -> str:
        """Make `staged` checkpoint `checkpoint_id`, atomically; `blobs` are its new blob file names.

        `marker` replaces the default marker content (a sharded commit pins its world size and files too).

        Nothing that exists is ever replaced or removed: an existing checkpoint or blob of the same name refuses
        the commit before anything moves. A failure before the marker is written undoes what this commit
        moved (a full disk: left there, it would hold its space until open()); once the marker is written the
        checkpoint is committed and readers may have seen it, so a later failure (the final directory fsync)
        leaves it in place.
        """
        final = self.path(CKPT_PREFIX + checkpoint_id)
        if os.path.lexists(final):
            raise CheckpointError(f"{final} already exists; checkpoint ids must be unique")
        for blob in blobs:
            if os.path.lexists(self.path(blob)):
                raise CheckpointError(f"{self.path(blob)} already exists; blob names must be unique")
        moved: list[str] = []
        renamed = marked = False
        try:
            write_file(os.path.join(staged, MANIFEST), manifest_raw)
            fsync_dir(staged)
            for blob in blobs:
                os.rename(os.path.join(staged, os.path.basename(blob)), self.path(blob))
                moved.append(blob)
            if blobs:
                fsync_dir(self.path(BLOBS))
            os.rename(staged, final)
            renamed = True
            fsync_dir(self.root)
            marker = marker or marker_bytes(manifest_raw, checkpoint_id)
            write_file(os.path.join(final, MARKER), marker, exclusive=True)
            marked = True
            fsync_dir(final)
        except BaseException:
            if not marked:
                with contextlib.suppress(OSError):  # best effort on a failing disk; open() removes what stays
                    if renamed:
                        self.delete(checkpoint_id)
                    for blob in moved:
                        os.remove(self.path(blob))
            raise
        return final

    def mark_abandoned(self, checkpoint_id: str, reason: str) -> None:
        """Persistently exclude a checkpoint from latest()/best() (a rollback went past it)."""
        target = self.path(CKPT_PREFIX + checkpoint_id, ABANDONED)
        write_file(target, reason.encode())
        fsync_dir(os.path.dirname(target))

    def delete(self, checkpoint_id: str) -> None:
        """Remove a checkpoint: it vanishes at once (rename into .tmp), then its files go."""
        src = self.path(CKPT_PREFIX + checkpoint_id)
        dst = self.path(TMP, f"deleted-{checkpoint_id}.{uuid.uuid4().hex[:8]}")
        os.rename(src, dst)
        fsync_dir(self.root)
        _remove(dst)

    def close(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None
