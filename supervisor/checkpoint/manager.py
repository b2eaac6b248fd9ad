"""CheckpointManager: save and restore a training state through memory, local and remote tiers."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from supervisor.checkpoint.abandon import abandon_after
from supervisor.checkpoint.asyncwriter import AsyncWriter, BackgroundErrors
from supervisor.checkpoint.branch import Branch
from supervisor.checkpoint.holds import Holds
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import CKPT_PREFIX, config_hash, git_commit, library_versions
from supervisor.checkpoint.memory import Snapshot, SnapshotRing
from supervisor.checkpoint.options import CheckpointInfo, CheckpointOptions, parse_id
from supervisor.checkpoint.overlap import OverlappedCopy
from supervisor.checkpoint.pipeline import WritePipeline
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.restorer import Restorer, Which, snapshot_info
from supervisor.checkpoint.tickets import TicketBook
from supervisor.checkpoint.tiers import Tiers
from supervisor.checkpoint.upload import Uploader
from supervisor.checkpoint.writer import host_tensors
from supervisor.errors import BackgroundSaveError, CheckpointError
from supervisor.stateful import CheckpointableState

log = logging.getLogger("rollback_supervisor.checkpoint")


class CheckpointManager:
    """Saves and restores one training state; orbax-style verbs, three tiers, retention after each commit.

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

    It is a facade: the state talks through `CheckpointableState`; each save is a ticket (`TicketBook`)
    moved by the `WritePipeline` on an `AsyncWriter`; reads go through the `Restorer` and `Tiers`.
    """

    def __init__(
        self,
        options: CheckpointOptions,
        state: CheckpointableState,
        *,
        clock: Callable[[], float] = time.time,
    ):
        self.options, self.state = options, state
        self._closed = False
        self._errors = BackgroundErrors()
        self._tickets = TicketBook()
        self._writer: AsyncWriter | None = None
        self._uploader: Uploader | None = None
        self._store = LocalStore(options.directory)
        try:
            self._open(options, clock)
        except BaseException:  # the store lock and the threads would outlive a manager nobody can close
            self._release()
            raise

    def _open(self, options: CheckpointOptions, clock: Callable[[], float]) -> None:
        """Everything __init__ does once it holds the store lock."""
        remote = RemoteTier(options.remote) if options.remote else None
        ring = SnapshotRing(max(options.memory_slots, options.max_in_flight if options.async_save else 0))
        self._tiers = Tiers(self._store, remote, ring)
        holds = Holds()
        if remote is not None:
            self._uploader = Uploader(remote, self._store, holds, lambda: holds.policy(options), self._errors)
        self._pipeline = WritePipeline(options, self._store, ring, self._tickets, holds, self._uploader)
        self._pipeline.reindex()
        self._restorer = Restorer(options, self._tiers, self._tickets, self._pipeline.reindex)
        seqs = [parse_id(i)[1] for i in self._store.catalog.ids()]
        if remote is not None:
            seqs += [parse_id(i)[1] for i in remote.catalog.ids()]
        provenance = (library_versions(), git_commit(), config_hash(options.config))
        self._branch = Branch(clock, provenance, seqs)
        if options.async_save:
            self._writer = AsyncWriter("ckpt-writer", self._errors, max_in_flight=options.max_in_flight)
        #: With `overlap`, the copy of what only an optimizer step changes runs beside the next step.
        self._copier = OverlappedCopy(threads=1) if options.overlap and options.async_save else None

    # ---- saving -------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        extras: dict[str, Any] | None = None,
        before_commit: Callable[[], Any] | None = None,
        rank_states: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Snapshot the state as checkpoint `step` and write it (in the background with async_save).

        A step this branch already saved is not saved again (its info is returned) unless `force`. With
        async_save the returned info describes the pending commit; get(id) after wait() has the final one (and
        pending() the health mark, which the writer reads from the copy so that training does not wait for it).
        `before_commit` runs after the files are written and before they are committed (on the writer thread
        with async_save); if it raises, the checkpoint is not committed. `rank_states` (every rank's own share,
        {"<rank>": {...}}, under DDP) is stored under "ranks". Taking the snapshot sets the state's step counter
        to `step` (TrainingState owns the counter).
        """
        self._check()
        last = self._branch.already_saved(step)
        if not force and last is not None:
            log.info("Checkpoint for step %d already taken (%s); not saving again", step, last.id)
            return last
        started = time.monotonic()
        skeleton, live = self.state.snapshot(step, extras, rank_states)
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        meta = self._branch.next_meta(step, metrics)
        path = self._store.path(CKPT_PREFIX + meta.id)
        info = CheckpointInfo(
            meta.id, step, meta.wall_time, metrics, meta.parent_id, path, meta.seq, ("memory",)
        )
        checked = self.state.checked()
        ring = self._tiers.ring
        if self._writer is not None:
            self._writer.reserve()
            try:
                copier, late = self._overlap()
                snap = ring.capture(
                    meta.id, skeleton, live, {"info": info}, checked, copier=copier, late=late
                )
            except BaseException:
                self._writer.unreserve()
                raise
            self._tickets.open(replace(info, nbytes=snap.nbytes))
            write = self._writer.submit(meta.id, self._pipeline.write, meta, snap, before_commit)
            self._tickets.attach(meta.id, write)
            held = True
        else:
            held = bool(len(ring))
            if held:
                snap = ring.capture(meta.id, skeleton, live, {"info": info}, checked)
            else:
                host = host_tensors(live)
                nbytes = sum(t.numel() * t.element_size() for t in host.values())
                snap = Snapshot(meta.id, skeleton, host, nbytes, {"info": info}, checked)
            self._tickets.open(replace(info, nbytes=snap.nbytes))
            self._pipeline.write(meta, snap, before_commit, ring=held)
            info = replace(info, nonfinite=snap.nonfinite())
        tiers = ("memory",) if held else ()
        if self._writer is None:
            tiers += ("local",)
        info = replace(info, tiers=tiers, nbytes=snap.nbytes)
        self._branch.moved_to(info)
        log.info("Saved checkpoint %s: training blocked %.3fs", meta.id, time.monotonic() - started)
        return info

    def _overlap(self) -> tuple[OverlappedCopy | None, Callable[[str], bool] | None]:
        """The copier and the names it may copy late, or (None, None) when saves are not overlapped."""
        parts = getattr(self.state, "overlap_parts", None)
        if self._copier is None or not callable(parts):
            return None, None
        optimizers, late = parts()
        self._copier.guard(optimizers)  # each optimizer's step waits for the copy in flight
        return self._copier, late

    def wait_capture(self) -> float:
        """Block until an overlapped snapshot copy is done; the seconds waited (0 when none is in flight)."""
        return self._copier.wait() if self._copier is not None else 0.0

    def _before_restore(self) -> None:
        """The live tensors are about to change: a copy still reading them must be done first."""
        self.wait_capture()

    def writing(self) -> bool:
        """Whether save() would now block on earlier background writes (`max_in_flight` of them pending)."""
        return self._writer is not None and self._writer.busy()

    def candidates(self) -> list[CheckpointInfo]:
        """Committed checkpoints, then the saves still being written (`pending()`): all restorable right now."""
        pending = self.pending()  # first: a save that commits meanwhile is then listed as committed
        committed = self.list()
        seen = {i.id for i in committed}
        return committed + [p for p in pending if p.id not in seen]

    def pending(self) -> list[CheckpointInfo]:
        """Saves still being written, oldest first, that the memory ring holds: restorable now, committed soon."""
        infos = self._tickets.pending_infos()
        held = {s.id: s for s in self._tiers.ring.snapshots()}
        # The health mark is read from the copy once, usually by the writer already; if not, here and now.
        marked = [replace(i, nonfinite=held[i.id].nonfinite()) for i in infos if i.id in held]
        return sorted(marked, key=lambda i: i.seq)

    # ---- waiting and errors --------------------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise CheckpointError(f"CheckpointManager for {self._store.root} is closed")
        if self._writer is not None:
            self._writer.prune()
        if self._uploader is not None:
            self._uploader.prune()
        self._errors.raise_first()

    @property
    def _pending(self) -> list[Future[None]]:
        """Background writes and uploads not known to be finished, oldest first (a hook for tests)."""
        return [*(self._writer.futures() if self._writer else []), *self._uploads()]

    @property
    def _ring(self) -> SnapshotRing:
        """The memory ring (a hook for tests: tests/test_cuda.py reads the snapshots it holds)."""
        return self._tiers.ring

    def _uploads(self) -> list[Future[None]]:
        return self._uploader.futures() if self._uploader is not None else []

    def _drain(self) -> None:
        """Wait for every background write, then every upload they handed on."""
        if self._writer is not None:
            self._writer.drain()
        if self._uploader is not None:
            self._uploader.drain()

    def wait(self) -> None:
        """Block until every pending save and upload is done; raise the first background failure."""
        self._drain()
        self._errors.raise_first()

    def close(self) -> None:
        """Finish pending work, release the store; raises a background failure after releasing."""
        if self._closed:
            return
        try:
            self._drain()
        finally:
            self._release()
        self._errors.raise_first()

    def _release(self) -> None:
        if getattr(self, "_copier", None) is not None:
            self._copier.close()
        if self._writer is not None:
            self._writer.close()
        if self._uploader is not None:
            self._uploader.close()
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
        return self._restorer.latest()

    def best(self, metric: str, mode: str = "min") -> CheckpointInfo | None:
        """The live, healthy checkpoint with the best `metric` that passes a fast check; ties go to the newest."""
        self._check()
        return self._restorer.best(metric, mode)

    # ---- restoring -----------------------------------------------------------------------------------
    def restore(
        self, which: Which = "latest", *, prefixes: Iterable[str] | None = None, tier: str | None = None
    ) -> CheckpointInfo:
        """Restore into the registered objects from the fastest tier with a valid copy.

        "latest" falls back to older commits, logging why each newer one was skipped; a specific id or
        info raises CheckpointCorrupt or CheckpointNotFound instead.
        """
        self.wait()
        self._before_restore()
        info = self._restorer.restore(self.state, which, None if prefixes is None else list(prefixes), tier)
        self._branch.moved_to(info)
        return info

    def restore_memory(
        self, which: Which = "latest", *, prefixes: Iterable[str] | None = None, wait: bool = True
    ) -> CheckpointInfo:
        """Restore from the host-memory ring only (fast in-process rollback); CheckpointNotFound if absent.

        `wait=False` does not wait for writes in flight: their snapshots are restorable already.
        """
        self._settle(wait)
        self._before_restore()
        info = self._restorer.restore_memory(self.state, which, None if prefixes is None else list(prefixes))
        self._branch.moved_to(info)
        return info

    # ---- protection and rollback bookkeeping ---------------------------------------------------------
    def protect(self, ids: Iterable[str]) -> None:
        """Never delete these checkpoints (targets of a pending rollback) until unprotect()."""
        self._pipeline.holds.protect(ids)

    def unprotect(self, ids: Iterable[str]) -> None:
        self._pipeline.holds.unprotect(ids)

    def abandon_after(self, which: Which, *, wait: bool = True) -> list[CheckpointInfo]:
        """After rolling back to `which`, mark every later commit abandoned (persistently); returns them.

        `wait=False` does not wait for writes in flight: a later one is refused its commit instead (or, if it
        is committing at this moment, waited for and then marked), and `which` may itself be in flight.
        """
        self._settle(wait)
        target, gone = abandon_after(which, tickets=self._tickets, tiers=self._tiers, waited=wait)
        self._branch.moved_to(target)
        return gone

    def _settle(self, wait: bool) -> None:
        """wait() when asked to, else only the checks every call makes."""
        if wait:
            self.wait()
        else:
            self._check()


__all__ = ["CheckpointManager", "snapshot_info"]
