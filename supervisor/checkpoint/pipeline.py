"""The write pipeline after the copy: health mark, write and checksum, commit gate, commit, retention, upload.

It runs on the writer thread with async_save (on the training thread without). Each save moves its ticket:
the gate refuses one a rollback went past, a commit or a failure ends it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from supervisor.checkpoint.dedup import DedupIndex
from supervisor.checkpoint.holds import Holds
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import Manifest
from supervisor.checkpoint.memory import Snapshot, SnapshotRing
from supervisor.checkpoint.options import CheckpointOptions
from supervisor.checkpoint.retention import apply_retention
from supervisor.checkpoint.tickets import Refused, TicketBook
from supervisor.checkpoint.upload import Uploader
from supervisor.checkpoint.writer import CheckpointMeta, write_checkpoint
from supervisor.errors import CheckpointError

log = logging.getLogger("rollback_supervisor.checkpoint")


class WritePipeline:
    """Writes snapshots into the local store and keeps the store's dedup index and retention up to date."""

    def __init__(
        self,
        options: CheckpointOptions,
        store: LocalStore,
        ring: SnapshotRing,
        tickets: TicketBook,
        holds: Holds,
        uploader: Uploader | None,
    ):
        self._options = options
        self._store = store
        self._ring = ring
        self._tickets = tickets
        self.holds = holds
        self.uploader = uploader
        self._index = DedupIndex() if options.dedup else None
        self._manifests: dict[str, Manifest] = {}

    def write(
        self,
        meta: CheckpointMeta,
        snap: Snapshot,
        before_commit: Callable[[], Any] | None = None,
        *,
        ring: bool = True,
    ) -> None:
        """Write `snap` (held in the ring, or host tensors of a synchronous save that has no ring)."""
        started = time.monotonic()
        refused = False
        try:
            if self._tickets.refused(meta.id):  # rolled back past before its write began: skip it
                raise Refused(meta.id)
            snap.ready()  # an overlapped capture: its copy must be complete before anything reads it
            meta = self._health(meta, snap)
            manifest = write_checkpoint(
                self._store,
                meta,
                snap.skeleton,
                snap.tensors,
                self._index,
                lambda: self._gate(meta.id, before_commit),
            )
            self._tickets.committed(meta.id)
            self._manifests[meta.id] = manifest
            if self._index is not None:
                self._index.add(manifest)
            log.info(
                "Committed checkpoint %s (step %d, %.1f MB written of %.1f MB) in %.3fs",
                meta.id,
                meta.step,
                manifest.written_bytes / 1e6,
                manifest.nbytes / 1e6,
                time.monotonic() - started,
            )
            if self.uploader is not None:
                self.uploader.submit(manifest)
            self.retain()
        except Refused:
            refused = True
            log.info("Checkpoint %s not committed: a rollback went past it", meta.id)
        except BaseException:
            self._tickets.failed(meta.id)
            raise
        finally:
            if ring:
                self._ring.release(snap)
                if refused or not self._options.memory_slots:
                    self._ring.drop(meta.id)
            # After the drop: until here a refused id stays flagged, so nothing picks it.
            self._tickets.close(meta.id)

    def _health(self, meta: CheckpointMeta, snap: Snapshot) -> CheckpointMeta:
        """Read the snapshot's health before writing it: an unhealthy one is written, marked and logged."""
        nonfinite = snap.nonfinite()
        if not nonfinite:
            return meta
        shown = ", ".join(nonfinite[:3])
        if len(nonfinite) > 3:
            shown += f" and {len(nonfinite) - 3} more"
        if self._options.allow_nonfinite:
            allowed = "checkpoint.allow_nonfinite is true, so it may still be"
        else:
            allowed = "it is never"
        log.warning(
            "Checkpoint %s (step %d) is unhealthy: NaN or infinity in %d tensor(s) (%s); %s a rollback target or "
            "the latest to resume from",
            meta.id,
            meta.step,
            len(nonfinite),
            shown,
            allowed,
        )
        snap.meta["info"] = replace(snap.meta["info"], nonfinite=nonfinite)
        self._tickets.mark(meta.id, lambda info: replace(info, nonfinite=nonfinite))
        return replace(meta, nonfinite=nonfinite)

    def _gate(self, checkpoint_id: str, before_commit: Callable[[], Any] | None) -> None:
        """Just before the commit: the caller's hook, then refuse if rolled back past."""
        if before_commit is not None:
            before_commit()
        self._tickets.gate(checkpoint_id)

    def retain(self) -> None:
        """Apply retention to the local store (logging each deletion's reason), then drop unreferenced blobs."""
        catalog = self._store.catalog
        result = apply_retention(self.holds.policy(self._options), catalog.list())
        for info, reason in result.delete:
            log.info("Deleting checkpoint %s (%s)", info.id, reason)
            self._store.delete(info.id)
            self._manifests.pop(info.id, None)
        if result.delete:
            catalog.gc_blobs()
            self.reindex()

    def reindex(self) -> None:
        """Rebuild the dedup index from the committed checkpoints (manifests already parsed are reused)."""
        kept: dict[str, Manifest] = {}
        for info in self._store.catalog.list():
            try:
                kept[info.id] = self._manifests.get(info.id) or self._store.catalog.manifest(info.id)
            except CheckpointError:
                continue
        self._manifests = kept
        if self._index is not None:
            self._index.rebuild(kept.values())


__all__ = ["WritePipeline"]
