"""CheckpointManager: save and restore a TrainingState through memory, local and remote tiers."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from supervisor.checkpoint.catalog import best_of
from supervisor.checkpoint.dedup import DedupIndex
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import (
    ABANDONED,
    CKPT_PREFIX,
    Manifest,
    config_hash,
    git_commit,
    library_versions,
)
from supervisor.checkpoint.memory import Snapshot, SnapshotRing
from supervisor.checkpoint.options import TIERS, CheckpointInfo, CheckpointOptions, make_id, parse_id
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.restore import restore_snapshot
from supervisor.checkpoint.retention import apply_retention, policy_from_settings
from supervisor.checkpoint.tiers import Tiers
from supervisor.checkpoint.writer import CheckpointMeta, host_tensors, write_checkpoint
from supervisor.errors import BackgroundSaveError, CheckpointCorrupt, CheckpointError, CheckpointNotFound
from supervisor.flatten import child_path, flatten

if TYPE_CHECKING:
    from supervisor.state import TrainingState

log = logging.getLogger("rollback_supervisor.checkpoint")
Which = str | CheckpointInfo


class CheckpointManager:
    """Saves and restores one TrainingState; orbax-style verbs, three tiers, retention after each commit.

    Concurrency contract:
    - Call it from one thread (the training loop); it is not thread-safe.
    - With async_save, save() blocks only while the state is copied into reused host buffers; writing,
      checksums, commit, retention and the remote upload run on background threads, in save order.
    - When `max_in_flight` saves are pending, save() blocks until the oldest finishes; `writing()` says
      whether one would (a caller free to pick its moment, like the adaptive cadence, saves later instead).
    - `before_commit` (e.g. "the metrics up to this step are sent") runs on the writer thread just before the
      commit, so a committed checkpoint implies it without training waiting for it.
    - The snapshot aliases no live tensor: training may change the state as soon as save() returns.
    - A background failure is raised as BackgroundSaveError by the next save/restore/wait/close call.
    - restore(), restore_memory() and abandon_after() first wait for pending saves. An in-process rollback
      passes `wait=False` to the last two and does not wait for a write: a save in flight is restorable from
      the ring at once (`pending()`), and one that the rollback goes past is never committed.
    - One manager per directory (an exclusive lock); other processes read with open_store().
    """

    def __init__(
        self, options: CheckpointOptions, state: TrainingState, *, clock: Callable[[], float] = time.time
    ):
        self.options, self.state, self._clock = options, state, clock
        self._store = LocalStore(options.directory)
        self._catalog = self._store.catalog
        self._closed = False
        self._writer: ThreadPoolExecutor | None = None
        self._uploader: ThreadPoolExecutor | None = None
        try:
            self._open(options)
        except BaseException:  # the store lock and the pools would outlive a manager nobody can close
            self._release()
            raise

    def _open(self, options: CheckpointOptions) -> None:
        """Everything __init__ does once it holds the store lock."""
        self._remote = RemoteTier(options.remote) if options.remote else None
        slots = max(options.memory_slots, options.max_in_flight if options.async_save else 0)
        self._ring = SnapshotRing(slots)
        self._tiers = Tiers(self._store, self._remote, self._ring)
        self._pending: deque[Future[Any]] = deque()
        self._writes: deque[Future[Any]] = deque()  # the writes among _pending, for writing()
        self._slots = threading.BoundedSemaphore(options.max_in_flight)
        self._lock = threading.Lock()
        self._errors: list[tuple[str, BaseException]] = []
        # Async saves not yet committed: id -> (info, write future). `_committing`: past the gate below, so
        # about to commit; `_abandon_on_commit`: a rollback went past them, so the gate refuses the commit.
        self._inflight: dict[str, tuple[CheckpointInfo, Future[Any] | None]] = {}
        self._committing: set[str] = set()
        self._abandon_on_commit: set[str] = set()
        self._protected: set[str] = set()
        self._uploading: set[str] = set()
        self._manifests: dict[str, Manifest] = {}
        self._index = DedupIndex() if options.dedup else None
        self._reindex()
        seqs = [parse_id(i)[1] for i in self._catalog.ids()]
        seqs += [parse_id(i)[1] for i in self._remote.catalog.ids()] if self._remote else []
        self._next_seq = max(seqs, default=0) + 1
        self._parent: str | None = None
        self._last: CheckpointInfo | None = None
        self._provenance = (library_versions(), git_commit(), config_hash(options.config))
        self._writer = ThreadPoolExecutor(1, "ckpt-writer") if options.async_save else None
        self._uploader = ThreadPoolExecutor(1, "ckpt-upload") if self._remote else None

    # ---- saving -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        extras: dict[str, Any] | None = None,
        before_commit: Callable[[], Any] | None = None,
    ) -> CheckpointInfo:
        """Snapshot the state as checkpoint `step` and write it (in the background with async_save).

        A step this branch already saved is not saved again (its info is returned) unless `force`. With
        async_save the returned info describes the pending commit; get(id) after wait() has the final one (and
        pending() the health mark, which the writer reads from the copy so that training does not wait for it).
        `before_commit` runs after the files are written and before they are committed (on the writer thread
        with async_save); if it raises, the checkpoint is not committed.
        """
        self._check()
        if not force and self._last is not None and self._last.step == step:
            log.info("Checkpoint for step %d already taken (%s); not saving again", step, self._last.id)
            return self._last
        started = time.monotonic()
        self.state.step = step
        nested = self.state.state_dict()
        if extras:
            nested["extras"] = {**nested["extras"], **extras}
        skeleton, live = flatten(nested)
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        cid, seq = make_id(step, self._next_seq), self._next_seq
        self._next_seq += 1
        meta = CheckpointMeta(cid, seq, step, self._clock(), metrics, self._parent, *self._provenance)
        path = self._store.path(CKPT_PREFIX + cid)
        info = CheckpointInfo(cid, step, meta.wall_time, metrics, self._parent, path, seq, ("memory",))
        checked = self._checked()
        if self._writer is not None:
            self._slots.acquire()
            try:
                snap = self._ring.capture(cid, skeleton, live, {"info": info}, checked)
            except BaseException:
                self._slots.release()
                raise
            with self._lock:
                self._inflight[cid] = (replace(info, nbytes=snap.nbytes), None)
            write = self._writer.submit(self._write, meta, snap, before_commit)
            with self._lock:
                if cid in self._inflight:
                    self._inflight[cid] = (self._inflight[cid][0], write)
            self._pending.append(write)
            self._writes.append(write)
            ring = True
        else:
            ring = bool(len(self._ring))
            if ring:
                snap = self._ring.capture(cid, skeleton, live, {"info": info}, checked)
            else:
                host = host_tensors(live)
                nbytes = sum(t.numel() * t.element_size() for t in host.values())
                snap = Snapshot(cid, skeleton, host, nbytes, {"info": info}, checked)
            self._write(meta, snap, before_commit, ring=ring)
            info = replace(info, nonfinite=snap.nonfinite())
        tiers = (("memory",) if ring else ()) + (("local",) if self._writer is None else ())
        info = replace(info, tiers=tiers, nbytes=snap.nbytes)
        self._parent, self._last = cid, info
        log.info("Saved checkpoint %s: training blocked %.3fs", cid, time.monotonic() - started)
        return info

    def _checked(self) -> Callable[[str], bool]:
        """Which tensors a snapshot's health covers: all of them but module buffers.

        Parameters and optimizer state must be finite; a buffer may hold an infinity on purpose (an additive
        attention mask), and a NaN in one comes with NaN parameters anyway.
        """
        buffers = set()
        for name in self.state.names:
            part = self.state[name]
            if isinstance(part, torch.nn.Module):
                buffers |= {child_path(name, b) for b, _ in part.named_buffers(remove_duplicate=False)}
        return lambda tensor: tensor not in buffers

    def _health(self, meta: CheckpointMeta, snap: Snapshot) -> CheckpointMeta:
        """Read the snapshot's health before writing it: an unhealthy one is written, marked and logged."""
        nonfinite = snap.nonfinite()
        if not nonfinite:
            return meta
        shown = ", ".join(nonfinite[:3]) + (f" and {len(nonfinite) - 3} more" if len(nonfinite) > 3 else "")
        allowed = (
            "checkpoint.allow_nonfinite is true, so it may still be"
            if self.options.allow_nonfinite
            else "it is never"
        )
        log.warning(
            "Checkpoint %s (step %d) is unhealthy: NaN or infinity in %d tensor(s) (%s); %s a rollback target or "
            "the latest to resume from",
            meta.id, meta.step, len(nonfinite), shown, allowed,
        )  # fmt: skip
        snap.meta["info"] = replace(snap.meta["info"], nonfinite=nonfinite)
        with self._lock:
            if meta.id in self._inflight:
                info, write = self._inflight[meta.id]
                self._inflight[meta.id] = (replace(info, nonfinite=nonfinite), write)
        return replace(meta, nonfinite=nonfinite)

    def _usable(self, info: CheckpointInfo, why: str) -> bool:
        """Whether `latest` may pick `info`: not abandoned, and healthy unless the options allow otherwise."""
        if info.abandoned:
            return False
        if info.healthy or self.options.allow_nonfinite:
            return True
        log.warning(
            "Not %s checkpoint %s: unhealthy (NaN or infinity in %s); set checkpoint.allow_nonfinite to allow it",
            why, info.id, ", ".join(info.nonfinite[:3]),
        )  # fmt: skip
        return False

    def writing(self) -> bool:
        """Whether save() would now block on earlier background writes (`max_in_flight` of them pending)."""
        return sum(not w.done() for w in self._writes) >= self.options.max_in_flight

    def _write(
        self,
        meta: CheckpointMeta,
        snap: Snapshot,
        before_commit: Callable[[], Any] | None = None,
        *,
        ring: bool = True,
    ) -> None:
        """Write `snap` (held in the ring, or host tensors of a synchronous save that has no ring)."""
        started = time.monotonic()
        abandoned = False
        try:
            with self._lock:
                if meta.id in self._abandon_on_commit:  # rolled back past before its write began: skip it
                    raise _Abandoned(meta.id)
            meta = self._health(meta, snap)
            gate = lambda: self._gate(meta.id, before_commit)  # noqa: E731
            manifest = write_checkpoint(self._store, meta, snap.skeleton, snap.tensors, self._index, gate)
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
            if self._uploader is not None:
                with self._lock:
                    self._uploading.add(meta.id)
                self._pending.append(self._uploader.submit(self._upload, manifest))
            self._retain()
        except _Abandoned:
            abandoned = True
            log.info("Checkpoint %s not committed: a rollback went past it", meta.id)
        except BaseException as exc:
            if self._writer is None:
                raise
            with self._lock:
                self._errors.append((meta.id, exc))
        finally:
            if ring:
                self._ring.release(snap)
                if abandoned or not self.options.memory_slots:
                    self._ring.drop(meta.id)
            with self._lock:  # after the drop: until here a refused id stays flagged, so nothing picks it
                self._inflight.pop(meta.id, None)
                self._committing.discard(meta.id)
                self._abandon_on_commit.discard(meta.id)
            if self._writer is not None:
                self._slots.release()

    def _gate(self, cid: str, before_commit: Callable[[], Any] | None) -> None:
        """Just before the commit, on the writer thread: the caller's hook, then refuse if rolled back past."""
        if before_commit is not None:
            before_commit()
        with self._lock:
            if cid in self._abandon_on_commit:
                raise _Abandoned(cid)
            self._committing.add(cid)

    def candidates(self) -> list[CheckpointInfo]:
        """Committed checkpoints, then the saves still being written (`pending()`): all restorable right now."""
        pending = self.pending()  # first: a save that commits meanwhile is then listed as committed
        committed = self.list()
        seen = {i.id for i in committed}
        return committed + [p for p in pending if p.id not in seen]

    def pending(self) -> list[CheckpointInfo]:
        """Saves still being written, oldest first, that the memory ring holds: restorable now, committed soon."""
        with self._lock:
            infos = [info for info, _ in self._inflight.values() if info.id not in self._abandon_on_commit]
        held = {s.id: s for s in self._ring.snapshots()}
        # The health mark is read from the copy once, usually by the writer already; if not, here and now.
        marked = [replace(i, nonfinite=held[i.id].nonfinite()) for i in infos if i.id in held]
        return sorted(marked, key=lambda i: i.seq)

    def _policy(self) -> Any:
        with self._lock:
            keep = set(self._protected) | self._uploading
        o = self.options
        return policy_from_settings(o.keep_last, o.keep_best, o.keep_every_steps, protected=keep)

    def _retain(self) -> None:
        result = apply_retention(self._policy(), self._catalog.list())
        for info, reason in result.delete:
            log.info("Deleting checkpoint %s (%s)", info.id, reason)
            self._store.delete(info.id)
            self._manifests.pop(info.id, None)
        if result.delete:
            self._catalog.gc_blobs()
            self._reindex()

    def _reindex(self) -> None:
        kept: dict[str, Manifest] = {}
        for info in self._catalog.list():
            try:
                kept[info.id] = self._manifests.get(info.id) or self._catalog.manifest(info.id)
            except CheckpointError:
                continue
        self._manifests = kept
        if self._index is not None:
            self._index.rebuild(kept.values())

    def _upload(self, manifest: Manifest) -> None:
        try:
            assert self._remote is not None
            self._remote.upload(self._store, manifest)
            log.info("Uploaded checkpoint %s to %s", manifest.id, self._remote.url)
            abandoned = self._store.path(CKPT_PREFIX + manifest.id, ABANDONED)
            if os.path.exists(abandoned):  # a rollback marked it while the upload ran: the remote copy too
                with open(abandoned, encoding="utf-8", errors="replace") as fh:
                    self._remote.mark_abandoned(manifest.id, fh.read())
            self._remote.apply_retention(self._policy())
        except BaseException as exc:
            with self._lock:
                self._errors.append((manifest.id, exc))
        finally:
            with self._lock:
                self._uploading.discard(manifest.id)

    # ---- waiting and errors --------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for {self._store.root} is closed")
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        while self._writes and self._writes[0].done():
            self._writes.popleft()
        self._raise_background()

    def _raise_background(self) -> None:
        with self._lock:
            if not self._errors:
                return
            (cid, exc), *rest = self._errors
            self._errors = rest
        raise BackgroundSaveError(
            f"background save of checkpoint {cid} failed: {type(exc).__name__}: {exc}"
        ) from exc

    def wait(self) -> None:
        """Block until every pending save and upload is done; raise the first background failure."""
        while self._pending:
            self._pending.popleft().exception()
        self._raise_background()

    def close(self) -> None:
        """Finish pending work, release the store; raises a background failure after releasing."""
        if self._closed:
            return
        try:
            while self._pending:
                self._pending.popleft().exception()
        finally:
            self._release()
        self._raise_background()

    def _release(self) -> None:
        for pool in (self._writer, self._uploader):
            if pool is not None:
                pool.shutdown(wait=True)
        self._store.close()
        self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except BackgroundSaveError as err:
            log.error("%s (while handling %s)", err, exc_type.__name__)

    # ---- reading -------------------------------------------------------------------------------------
    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint across tiers, oldest commit first (abandoned ones flagged)."""
        self._check()
        return self._tiers.list()

    def get(self, checkpoint_id: str) -> CheckpointInfo:
        """Info of one committed checkpoint; CheckpointNotFound if no tier holds it."""
        self._check()
        return self._tiers.get(checkpoint_id)

    def latest(self) -> CheckpointInfo | None:
        """The newest commit (by seq) that is not abandoned, is healthy and passes a fast check in some tier.

        An unhealthy one counts only with `allow_nonfinite`.
        """
        self._check()
        for info in reversed(self._tiers.list()):
            if self._usable(info, "taking as latest") and self._tiers.valid_somewhere(info):
                return info
        return None

    def best(self, metric: str, mode: str = "min") -> CheckpointInfo | None:
        """The live, healthy checkpoint with the best `metric` that passes a fast check; ties go to the newest."""
        self._check()
        infos = [i for i in self._tiers.list() if i.healthy or self.options.allow_nonfinite]
        while (found := best_of(infos, metric, mode)) is not None:
            if self._tiers.valid_somewhere(found):
                return found
            infos = [i for i in infos if i.id != found.id]
        return None

    def _resolve(self, which: Which) -> CheckpointInfo:
        return self._tiers.get(which.id if isinstance(which, CheckpointInfo) else which)

    # ---- restoring -----------------------------------------------------------------------------------
    def restore(
        self, which: Which = "latest", *, prefixes: Iterable[str] | None = None, tier: str | None = None
    ) -> CheckpointInfo:
        """Restore into the registered objects from the fastest tier with a valid copy.

        "latest" falls back to older commits, logging why each newer one was skipped; a specific id or
        info raises CheckpointCorrupt or CheckpointNotFound instead.
        """
        self.wait()
        if tier is not None and tier not in TIERS:
            raise CheckpointError(f"restore(): tier: expected one of {', '.join(TIERS)}, got {tier!r}")
        prefixes = None if prefixes is None else list(prefixes)
        if which != "latest":
            return self._restore(self._resolve(which), prefixes, tier)
        reasons = []
        for info in reversed(self._tiers.list()):
            if not self._usable(info, "restoring"):
                if not info.abandoned:
                    reasons.append(f"{info.id}: unhealthy (NaN or infinity in its state)")
                continue
            try:
                return self._restore(info, prefixes, tier)
            except (CheckpointCorrupt, CheckpointNotFound) as exc:
                log.warning("Not restoring checkpoint %s (%s); trying the previous one", info.id, exc)
                reasons.append(f"{info.id}: {exc}")
        detail = "; ".join(reasons) if reasons else "the store is empty"
        raise CheckpointNotFound(f"no valid checkpoint in {self._tiers.where()} ({detail})")

    def _restore(self, info: CheckpointInfo, prefixes: list[str] | None, tier: str | None) -> CheckpointInfo:
        started = time.monotonic()
        used = self._tiers.restore(info, self.state, prefixes, tier, self.options.verify, self._reindex)
        log.info(
            "Restored checkpoint %s from the %s tier in %.3fs", info.id, used, time.monotonic() - started
        )
        self._parent, self._last = info.id, info
        return info

    def restore_memory(
        self, which: Which = "latest", *, prefixes: Iterable[str] | None = None, wait: bool = True
    ) -> CheckpointInfo:
        """Restore from the host-memory ring only (fast in-process rollback); CheckpointNotFound if absent.

        `wait=False` does not wait for writes in flight: their snapshots are restorable already.
        """
        self.wait() if wait else self._check()
        snaps = self._ring.snapshots()
        abandoned = {i.id for i in self._catalog.list() if i.abandoned}
        with self._lock:
            abandoned |= self._abandon_on_commit
        if which == "latest":
            live = [s for s in snaps if s.id not in abandoned and self._usable(_info(s), "restoring")]
            if not live:
                held = f"only {len(snaps)} abandoned or unhealthy one(s)" if snaps else "nothing"
                raise CheckpointNotFound(
                    f"restore_memory(): no snapshot to restore in the memory ring ({held})"
                )
            snap = live[-1]
        else:
            cid = which.id if isinstance(which, CheckpointInfo) else which
            snap = next((s for s in snaps if s.id == cid), None)
            if snap is None:
                held = ", ".join(s.id for s in snaps) or "nothing"
                raise CheckpointNotFound(
                    f"restore_memory(): checkpoint {cid} is not in the memory ring (it holds {held})"
                )
        started = time.monotonic()
        restore_snapshot(snap, self.state, None if prefixes is None else list(prefixes))
        log.info("Restored checkpoint %s from the memory tier in %.3fs", snap.id, time.monotonic() - started)
        info = replace(_info(snap), tiers=("memory",), nbytes=snap.nbytes)
        self._parent, self._last = info.id, info
        return info

    # ---- protection and rollback bookkeeping ---------------------------------------------------------
    def protect(self, ids: Iterable[str]) -> None:
        """Never delete these checkpoints (targets of a pending rollback) until unprotect()."""
        with self._lock:
            self._protected |= set(ids)

    def unprotect(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._protected -= set(ids)

    def abandon_after(self, which: Which, *, wait: bool = True) -> list[CheckpointInfo]:
        """After rolling back to `which`, mark every later commit abandoned (persistently); returns them.

        `wait=False` does not wait for writes in flight: a later one is refused its commit instead (or, if it
        is committing at this moment, waited for and then marked), and `which` may itself be in flight.
        """
        self.wait() if wait else self._check()
        target = self._resolve_any(which)
        if target.abandoned:
            raise CheckpointError(f"abandon_after(): checkpoint {target.id} is itself abandoned")
        with self._lock:
            later = [(info, write) for info, write in self._inflight.values() if info.seq > target.seq]
            landing = [write for info, write in later if info.id in self._committing and write is not None]
            refused = [info for info, _ in later if info.id not in self._committing]
            self._abandon_on_commit |= {info.id for info in refused}
        for write in landing:
            write.exception()  # its commit is under way: let it land, then mark it below
        for info in refused:
            log.info("Abandoned checkpoint %s before its commit (rolled back to %s)", info.id, target.id)
        gone = [i for i in self._tiers.list() if i.seq > target.seq and not i.abandoned]
        reason = f"rolled back to {target.id}"
        for info in gone:
            if "local" in info.tiers:
                self._store.mark_abandoned(info.id, reason)
            if "remote" in info.tiers and self._remote is not None:
                self._remote.mark_abandoned(info.id, reason)
            self._ring.drop(info.id)
            log.info("Abandoned checkpoint %s (%s)", info.id, reason)
        if not wait and self._remote is not None:
            # An upload still running may have committed remotely after the listing above; one committing
            # later sees the local mark (_upload checks after its commit).
            unmarked = {i.id for i in gone if "remote" not in i.tiers}
            for info in self._remote.catalog.list():
                if info.id in unmarked and not info.abandoned:
                    self._remote.mark_abandoned(info.id, reason)
        self._parent, self._last = target.id, target
        return [replace(i, abandoned=True) for i in [*gone, *refused]]

    def _resolve_any(self, which: Which) -> CheckpointInfo:
        """A checkpoint still being written, or a committed one (a write commits before it leaves _inflight).

        An info whose checkpoint is gone from disk (retention deleted it after it was restored from the ring)
        is taken as it is: the rollback to it happened, and what came after it must still be abandoned.
        """
        cid = which.id if isinstance(which, CheckpointInfo) else which
        with self._lock:
            held = self._inflight.get(cid)
        if held is not None:
            return held[0]
        try:
            return self._resolve(cid)
        except CheckpointNotFound:
            if isinstance(which, CheckpointInfo):
                return which
            raise


def _info(snap: Snapshot) -> CheckpointInfo:
    """The info of a snapshot held in the ring, with its health mark."""
    return replace(snap.meta["info"], nonfinite=snap.nonfinite())


class _Abandoned(Exception):
    """Raised at a checkpoint's commit gate when a rollback went past it: it is not committed."""


__all__ = ["CheckpointManager"]
