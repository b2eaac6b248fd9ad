"""Remote tier on any fsspec URL: uploads with tenacity retries, marker last; downloads into the local store."""

from __future__ import annotations

import logging
import os
import posixpath
import shutil
from collections.abc import Callable
from typing import Any

import fsspec
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.local import LocalStore, fsync_dir, write_file
from supervisor.checkpoint.manifest import ABANDONED, BLOBS, CKPT_PREFIX, MANIFEST, MARKER, STATE, Manifest
from supervisor.checkpoint.retention import RetentionPolicy, apply_retention

log = logging.getLogger("rollback_supervisor.checkpoint")
_PERMANENT = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)


def transient(exc: BaseException) -> bool:
    """Worth retrying: network and I/O failures, not a missing file or a refused permission."""
    return isinstance(exc, OSError | TimeoutError | ConnectionError) and not isinstance(exc, _PERMANENT)


class RemoteTier:
    """A store mirror at an fsspec URL; every network call is retried with exponential backoff.

    Only the manager's upload thread writes to it. A checkpoint counts remotely once its marker is there.
    """

    def __init__(self, url: str, *, attempts: int = 5, sleep: Callable[[float], None] | None = None):
        fs, root = fsspec.core.url_to_fs(url)
        self.url = url
        self.catalog = Catalog(fs, root, tier="remote", url=url)
        kwargs: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
        self._retrying = Retrying(
            stop=stop_after_attempt(attempts),
            wait=wait_exponential(multiplier=0.5, max=30),
            retry=retry_if_exception(transient),
            reraise=True,
            before_sleep=lambda rs: log.warning(
                "Retrying remote %s (attempt %d): %s", url, rs.attempt_number, rs.outcome.exception()
            ),
            **kwargs,
        )

    @property
    def fs(self) -> Any:
        return self.catalog.fs

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self._retrying(fn, *args)

    def _put(self, local: str, rel: str) -> None:
        remote = self.catalog.path(rel)
        self._call(self.fs.makedirs, posixpath.dirname(remote), True)
        self._call(self.fs.put_file, local, remote)

    def upload(self, store: LocalStore, manifest: Manifest) -> None:
        """Upload a committed local checkpoint: blobs not yet there, state and manifest, then the marker."""
        cid = manifest.id
        for entry in manifest.files:
            if entry.path.startswith(BLOBS + "/") and self._size(self.catalog.path(entry.path)) == entry.size:
                continue
            self._put(store.path(entry.path), entry.path)
        ckpt = f"{CKPT_PREFIX}{cid}"
        self._put(store.path(ckpt, MANIFEST), f"{ckpt}/{MANIFEST}")
        if os.path.exists(store.path(ckpt, ABANDONED)):
            self._put(store.path(ckpt, ABANDONED), f"{ckpt}/{ABANDONED}")
        self._put(store.path(ckpt, MARKER), f"{ckpt}/{MARKER}")

    def _size(self, remote: str) -> int | None:
        try:
            return self._call(self.fs.size, remote)
        except FileNotFoundError:
            return None

    def download(self, store: LocalStore, checkpoint_id: str) -> None:
        """Copy a remote checkpoint into the local store (replacing a bad local copy), marker last.

        LeavesStore (a ValueError) when a name it lists, or a symlink on a file:// remote, leads out of it.
        """
        manifest = self.catalog.manifest(checkpoint_id)
        ckpt = f"{CKPT_PREFIX}{checkpoint_id}"
        staged = store.stage(checkpoint_id)
        try:
            for rel in [
                f"{ckpt}/{STATE}",
                f"{ckpt}/{MANIFEST}",
                *sorted(manifest.rank_files.values()),  # a sharded save's per-rank RNG and data position
                f"{ckpt}/{MARKER}",
                *sorted(manifest.blobs()),
            ]:
                self._call(
                    self.fs.get_file,
                    self.catalog.confined(rel),
                    os.path.join(staged, posixpath.basename(rel)),
                )
            marker = open(os.path.join(staged, MARKER), "rb").read()
            os.remove(os.path.join(staged, MARKER))
            for rel in sorted(manifest.blobs()):
                os.replace(os.path.join(staged, posixpath.basename(rel)), store.path(rel))
            fsync_dir(store.path(BLOBS))
            if os.path.exists(store.path(ckpt)):
                store.delete(checkpoint_id)
            os.rename(staged, store.path(ckpt))
            fsync_dir(store.root)
            write_file(store.path(ckpt, MARKER), marker, exclusive=True)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        log.info("Downloaded checkpoint %s from %s", checkpoint_id, self.url)

    def mark_abandoned(self, checkpoint_id: str, reason: str) -> None:
        self._call(
            self.fs.pipe_file, self.catalog.path(f"{CKPT_PREFIX}{checkpoint_id}/{ABANDONED}"), reason.encode()
        )

    def apply_retention(self, policy: RetentionPolicy | None, busy: str | None = None) -> None:
        """Delete what `policy` drops, half-uploaded checkpoints and unreferenced blobs, logging why."""
        for cid in self.catalog.ids():
            if cid != busy and not self.catalog.committed(cid):
                log.info("Deleting checkpoint %s from %s (upload never finished)", cid, self.url)
                self._call(self.catalog.delete, cid)
        result = apply_retention(policy, self.catalog.list())
        for info, reason in result.delete:
            log.info("Deleting checkpoint %s from %s (%s)", info.id, self.url, reason)
            self._call(self.catalog.delete, info.id)
        self.catalog.gc_blobs()
