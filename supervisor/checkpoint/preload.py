"""A parked standby's preload (policy `relaunch.preload`): the lineage's newest checkpoint, held in host memory.

A standby parked at its plan (`relaunch.park: plan`) has built the model and optimizer; what a relaunch still
pays is reading the checkpoint and the first step. While it waits, a `Preloader` thread reads the newest
healthy, live commit of the lineage's local store into fresh host memory, verified in full as a restore
verifies it (`read_local`, on one thread: the segment beside it is training), and reads again whenever a newer
one commits or the one held is abandoned (it looks every `POLL_SECONDS`; the old copy is dropped before the new
one is read, so it holds at most one state's worth of memory, and it reads nothing that would leave less than
`MEMORY_MARGIN` of the machine's memory free). The standby reports ready once the first read is done, or after
`FIRST_READ_WAIT_SECONDS` with the read still going on.

When the segment's plan arrives the preloader stops: a read of the plan's target in progress is finished, a
read of anything else is cancelled, and a copy of another checkpoint than the target is dropped at once; what
is left is published here. The segment's first restore takes it (`take`) if, and only if, it restores that
very checkpoint from this store: the bytes then go into the built model and the optimizer adopts the rest
(`restore_snapshot(adopt=True)`), with no disk read. Any other target is read from disk as without a preload,
and the copy is dropped (`discard`).

A checkpoint is immutable once committed, so a copy verified when read is that checkpoint; the restore still
decides from a fresh listing (abandoned or deleted since: not restored, so the copy is not used).
Sharded (DCP) checkpoints are not preloaded: each rank's shards are its own.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import psutil

from supervisor.cgroup import memory_headroom
from supervisor.checkpoint.catalog import Catalog, open_store
from supervisor.checkpoint.manifest import ABANDONED, CKPT_PREFIX
from supervisor.checkpoint.memory import Snapshot
from supervisor.checkpoint.options import CheckpointInfo
from supervisor.checkpoint.restore import ReadCancelled, read_local, restore_snapshot
from supervisor.errors import CheckpointError
from supervisor.stateful import CheckpointableState

log = logging.getLogger("rollback_supervisor.checkpoint")

#: How often a preloader looks for a newer commit: a directory listing and two small file checks.
POLL_SECONDS = 0.1
#: How long a standby waits for its first read before it reports ready anyway (the read goes on).
FIRST_READ_WAIT_SECONDS = 30.0
#: A read that would leave less than this much of the machine's memory available is not made.
MEMORY_MARGIN = 1 << 30
#: How long the plan's arrival waits for a read of its target to finish; past that it is cancelled and the
#: restore reads the disk (a stalled file system must not hold the relaunch).
FINISH_WAIT_SECONDS = 30.0

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


def restore_preloaded(
    root: str, checkpoint_id: str, state: CheckpointableState, prefixes: list[str] | None
) -> bool:
    """Restore `checkpoint_id` of the store at `root` from the preloaded copy, if one is held: the copy is
    handed over (`restore_snapshot(adopt=True)`), so nothing is read and no buffer is copied twice. False (and
    nothing done) if none is held."""
    snap = take(root, checkpoint_id)
    if snap is None:
        return False
    restore_snapshot(snap, state, prefixes, adopt=True)
    return True


def discard() -> None:
    """Drop every preloaded copy (the segment's first restore is done: it is of no further use)."""
    with _published_lock:
        dropped = list(_published.values())
        _published.clear()
    for snap in dropped:
        log.info("preloaded checkpoint %s was not the one restored; its copy is dropped", snap.id)


def available_memory() -> int:
    """Bytes of memory this process may still allocate: the machine's available memory, or less where its
    cgroup (a container, a SLURM job) limits it."""
    available = psutil.virtual_memory().available
    headroom = memory_headroom()
    return available if headroom is None else min(available, headroom)


class Preloader:
    """Follows the newest commit of one local store and keeps it read (see the module docstring)."""

    def __init__(self, root: str, *, poll_seconds: float = POLL_SECONDS, threads: int = 1):
        self.root = os.path.realpath(root)
        self.poll_seconds = poll_seconds
        self.threads = threads
        self._catalog: Catalog | None = None
        self._held: Snapshot | None = None
        self._reading: str | None = None  # the id being read now, if any
        self._refused: set[str] = set()  # failed verification, or sharded: never read again
        self._short: set[str] = set()  # not read for want of memory (said once each)
        self._said: set[str] = set()  # failures logged (once each)
        self._seen: tuple[object, ...] | None = None  # what the store looked like at the last complete look
        self._first = threading.Event()  # the first look (and its read) is done
        self._stop = threading.Event()  # no further look
        self._cancel = threading.Event()  # the read in progress is of no use: stop it
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> str | None:
        """The id of the checkpoint held now, or None."""
        snap = self._held
        return snap.id if snap is not None else None

    def start(self, first_wait: float = FIRST_READ_WAIT_SECONDS) -> Preloader:
        """Follow the store on a thread; return once its first look is done, or after `first_wait` seconds."""
        self._thread = threading.Thread(target=self._follow, name="standby-preload", daemon=True)
        self._thread.start()
        if not self._first.wait(first_wait):
            log.info(
                "standby preload: still reading %s after %.0fs; parked meanwhile", self._reading, first_wait
            )
        return self

    def finish(self, wanted: str | None = None) -> str | None:
        """Stop following and publish the copy for the segment's restore; the id published, or None.

        `wanted`: the plan's target id, or None for "the latest" (whatever is held or being read may be it). A
        read in progress of anything else is cancelled, and a copy of anything else is dropped, not published.
        """
        self._stop.set()
        reading = self._reading
        if wanted is not None and reading is not None and reading != wanted:
            self._cancel.set()
        if self._thread is not None:
            self._thread.join(FINISH_WAIT_SECONDS)
            if self._thread.is_alive():  # its result, if it ever comes, is dropped (`_read` sees the cancel)
                self._cancel.set()
                log.warning(
                    "standby preload: the read of %s is not done after %.0fs; it is dropped",
                    reading,
                    FINISH_WAIT_SECONDS,
                )
                self._held = None
                return None
        snap, self._held = self._held, None
        if snap is None:
            return None
        if wanted is not None and snap.id != wanted:
            log.info("standby preload: held %s, the plan restores %s; the copy is dropped", snap.id, wanted)
            return None
        with _published_lock:
            _published[self.root] = snap
        return snap.id

    def _follow(self) -> None:
        try:
            self.poll()
        finally:
            self._first.set()
        while not self._stop.wait(self.poll_seconds):
            self.poll()

    def poll(self) -> None:
        """One look at the store: read its newest usable commit if it is not the one held. Never raises: a
        preload is an optimisation, and a failed one leaves the restore to read the disk. Each distinct
        failure is logged once."""
        try:
            info = self._newest()
            if info is not None:
                self._read(info)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            if why not in self._said:
                self._said.add(why)
                log.warning("standby preload from %s failed (%s); a relaunch reads the disk", self.root, why)

    def _newest(self) -> CheckpointInfo | None:
        """The newest live, healthy commit, when the store changed since the last look and it is not held."""
        if not os.path.isdir(self.root):
            return None
        if self._catalog is None:
            self._catalog = open_store(self.root)
        catalog = self._catalog
        ids = catalog.ids()
        if not ids:
            return None
        held = self.held
        abandoned = held is not None and os.path.exists(
            os.path.join(self.root, CKPT_PREFIX + held, ABANDONED)
        )
        seen = (ids[-1], catalog.committed(ids[-1]), len(ids), abandoned)
        if seen == self._seen:
            return None
        found = None
        for cid in reversed(ids):  # newest first, reading manifests only until the first usable commit
            if cid in self._refused:
                continue
            info = catalog.info(cid)
            if info is not None and not info.abandoned and info.healthy:
                found = info
                break
        self._seen = seen  # only after a complete look: one that failed is made again
        if found is None:
            self._held = None  # what was held is abandoned, and nothing else is usable
            return None
        return None if found.id == held else found

    def _read(self, info: CheckpointInfo) -> None:
        assert self._catalog is not None
        self._reading = info.id
        if self._stop.is_set():  # the plan came meanwhile: what is held stays, the restore reads the rest
            self._reading = None
            return
        self._held = None  # one state's worth of memory at most: the older copy goes before the newer is read
        # Every parked rank of a torchrun agent reads its own copy, at about the same moment.
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        available = available_memory()
        if available < info.nbytes * ranks + MEMORY_MARGIN:
            self._reading = None
            self._seen = None  # looked at again: memory may be freed
            if info.id not in self._short:
                self._short.add(info.id)
                log.warning(
                    "standby preload: not preloading checkpoint %s (%.0f MB, %d rank(s)): %.0f MB of memory "
                    "available",
                    info.id,
                    info.nbytes / 1e6,
                    ranks,
                    available / 1e6,
                )
            return
        started = time.monotonic()
        try:
            manifest = self._catalog.manifest(info.id)
            if manifest.sharded:  # each rank's shards are its own: this store is not preloaded at all
                self._stop.set()
                log.info("standby preload: %s holds sharded (DCP) checkpoints; not preloading", self.root)
                return
            snap = read_local(self._catalog, manifest, "full", threads=self.threads, cancel=self._cancel)
        except ReadCancelled:
            log.info("standby preload: the read of %s was cancelled (the plan restores another)", info.id)
            return
        except (CheckpointError, ValueError) as exc:  # ValueError: a name that leads out of the store
            self._refused.add(info.id)
            self._seen = None  # the next look takes the newest one still usable
            log.warning("standby preload: not preloading checkpoint %s (%s)", info.id, exc)
            return
        finally:
            self._reading = None
        if self._cancel.is_set():  # given up on by finish() while it read
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


__all__ = [
    "FINISH_WAIT_SECONDS",
    "FIRST_READ_WAIT_SECONDS",
    "MEMORY_MARGIN",
    "POLL_SECONDS",
    "Preloader",
    "available_memory",
    "discard",
    "restore_preloaded",
    "take",
]
