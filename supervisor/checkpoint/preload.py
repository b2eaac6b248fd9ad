"""A parked standby's preload (policy `relaunch.preload`): the lineage's newest checkpoint, held in host memory.

A standby parked at its plan (`relaunch.park: plan`) has built the model and optimizer; what a relaunch still
pays is reading the checkpoint and the first step. While it waits, a `Preloader` reads the newest healthy,
live commit of the lineage's local store into fresh host memory, verified in full as a restore verifies it
(`read_local`), and reads again whenever a newer one commits (it looks every `POLL_SECONDS`; the old copy is
dropped before the new one is read, so it holds at most one state's worth of memory). When the segment's plan
arrives it stops, finishing a read in progress, and publishes what it holds here. The segment's first restore
takes it (`take`) if, and only if, it restores that very checkpoint from this store and any tier: the bytes
then go into the built model and the optimizer adopts the rest (`restore_snapshot(adopt=True)`), with no disk
read. Any other target (an older checkpoint for a rollback, a commit the preloader had not seen yet) is read
from disk as without a preload, and the copy is dropped (`discard`).

A checkpoint is immutable once committed, so a copy verified when read is that checkpoint; the restore still
decides from a fresh listing (abandoned or deleted since: not restored, so the copy is not used).
Sharded (DCP) checkpoints are not preloaded: each rank's shards are its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time

from supervisor.checkpoint.catalog import Catalog, open_store
from supervisor.checkpoint.memory import Snapshot
from supervisor.checkpoint.options import CheckpointInfo
from supervisor.checkpoint.restore import read_local
from supervisor.errors import CheckpointError

log = logging.getLogger("rollback_supervisor.checkpoint")

#: How often a preloader looks for a newer commit: a directory listing, and the commit marker of the newest.
POLL_SECONDS = 0.1

#: What finished preloaders hold, by the real path of their store; a process has at most one (a standby's).
_published: dict[str, Snapshot] = {}
_published_lock = threading.Lock()


def take(root: str, checkpoint_id: str) -> Snapshot | None:
    """The preloaded copy of `checkpoint_id` from the store at `root`, handed over once; None if none is held."""
    key = os.path.realpath(root)
    with _published_lock:
        snap = _published.get(key)
        if snap is None or snap.id != checkpoint_id:
            return None
        del _published[key]
    return snap


def discard() -> None:
    """Drop every preloaded copy (the segment's first restore is done: it is of no further use)."""
    with _published_lock:
        dropped = list(_published.values())
        _published.clear()
    for snap in dropped:
        log.info("preloaded checkpoint %s was not the one restored; its copy is dropped", snap.id)


class Preloader:
    """Follows the newest commit of one local store and keeps it read (see the module docstring)."""

    def __init__(self, root: str, *, poll_seconds: float = POLL_SECONDS):
        self.root = os.path.realpath(root)
        self.poll_seconds = poll_seconds
        self._catalog: Catalog | None = None
        self._held: Snapshot | None = None
        self._refused: set[str] = set()  # failed verification, or sharded: never read again
        self._seen: tuple[str, bool, int] | None = None  # (newest id, committed, count) at the last look
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> str | None:
        """The id of the checkpoint held now, or None."""
        snap = self._held
        return snap.id if snap is not None else None

    def start(self) -> Preloader:
        """Read the newest commit now (before the standby says it is ready), then follow newer ones on a thread."""
        self.poll()
        self._thread = threading.Thread(target=self._follow, name="standby-preload", daemon=True)
        self._thread.start()
        return self

    def finish(self) -> str | None:
        """Stop following (a read in progress is completed: it is most likely of the target) and publish the
        copy for the segment's restore; the id published, or None."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        snap, self._held = self._held, None
        if snap is None:
            return None
        with _published_lock:
            _published[self.root] = snap
        return snap.id

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.poll()

    def poll(self) -> None:
        """One look at the store: read its newest usable commit if it is not the one held. Never raises: a
        preload is an optimisation, and a failed one leaves the restore to read the disk."""
        try:
            info = self._newest()
            if info is not None:
                self._read(info)
        except Exception as exc:
            log.warning("standby preload from %s failed (%s); a relaunch reads the disk", self.root, exc)

    def _newest(self) -> CheckpointInfo | None:
        """The newest live, healthy commit, when the store changed since the last look and it is not held."""
        if not os.path.isdir(self.root):
            return None
        if self._catalog is None:
            self._catalog = open_store(self.root)
        ids = self._catalog.ids()
        if not ids:
            return None
        seen = (ids[-1], self._catalog.committed(ids[-1]), len(ids))
        if seen == self._seen:
            return None
        self._seen = seen
        for info in reversed(self._catalog.listing().infos):
            if not info.abandoned and info.healthy and info.id not in self._refused:
                return None if info.id == self.held else info
        return None

    def _read(self, info: CheckpointInfo) -> None:
        assert self._catalog is not None
        self._held = None  # one state's worth of memory at most: the older copy goes before the newer is read
        started = time.monotonic()
        try:
            manifest = self._catalog.manifest(info.id)
            if manifest.sharded:  # each rank's shards are its own: this store is not preloaded at all
                self._stop.set()
                log.info("standby preload: %s holds sharded (DCP) checkpoints; not preloading", self.root)
                return
            snap = read_local(self._catalog, manifest, "full")
        except (CheckpointError, ValueError) as exc:  # ValueError: a name that leads out of the store
            self._refused.add(info.id)
            self._seen = None  # the next look takes the newest one still usable
            log.warning("standby preload: not preloading checkpoint %s (%s)", info.id, exc)
            return
        self._hold(snap)
        log.info(
            "standby preloaded checkpoint %s (step %d, %.0f MB) in %.3fs",
            info.id,
            info.step,
            snap.nbytes / 1e6,
            time.monotonic() - started,
        )

    def _hold(self, snap: Snapshot) -> None:
        self._held = snap


__all__ = ["POLL_SECONDS", "Preloader", "discard", "take"]
