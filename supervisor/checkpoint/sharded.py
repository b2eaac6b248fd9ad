"""`ShardedCheckpoints`: every rank's save and restore of a sharded state through DCP, in our store.

Every rank writes its own shards; rank 0 owns the store (its lock, retention, the commit). The local store must
be one directory that every rank sees. Calls are collective: every rank of `process_group` makes the same
calls in the same order. Not thread-safe; use from the training thread.

Asynchronous saves (`blocking=False`): each rank copies its local shards into its own reused host buffers (the
`SnapshotRing`) and returns; its writer thread (`AsyncWriter`, one job at a time, in submission order) runs the
same DCP save over `process_group`, which nothing else uses meanwhile: a synchronous save, a restore from disk
and `close()` first wait for the writer. The ring keeps the last snapshots after they are written, so
`restore_memory` at the same world size copies them back with no DCP and no disk.

Two kinds of failure, told apart because they call for different actions:
- `CheckpointError`: the save failed on some rank (disk full, a bad tensor) and every rank knows it in
  lockstep; nothing was committed, and training may go on.
- `RankLost`: a collective of the checkpoint group failed (a peer died, or hung past the group's timeout). The
  group is unusable from then on: the process should exit and be relaunched from the last commit.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import fsspec
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from supervisor.checkpoint.asyncwriter import AsyncWriter, BackgroundErrors
from supervisor.checkpoint.catalog import Catalog
from supervisor.checkpoint.dcp_reader import check_verify, load_tensors, read_skeleton, unwrap
from supervisor.checkpoint.dcp_writer import CommitJob, SaveRefused, ShardWriter, discard, rank_file
from supervisor.checkpoint.fastcopy import copy_tensors
from supervisor.checkpoint.holds import Holds
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import Manifest, library_versions
from supervisor.checkpoint.memory import Snapshot, SnapshotRing, local_shards
from supervisor.checkpoint.options import MEMORY_SLOTS, make_id, parse_id
from supervisor.checkpoint.overlap import OverlappedCopy
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.retention import AnyOf, KeepProtected, RetentionPolicy
from supervisor.checkpoint.upload import Uploader
from supervisor.checkpoint.writer import CheckpointMeta
from supervisor.errors import (
    BackgroundSaveError,
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    SupervisorError,
    UserError,
)
from supervisor.flatten import unflatten

log = logging.getLogger("rollback_supervisor.checkpoint")


class RankLost(SupervisorError):
    """A peer of the checkpoint group died or timed out in a collective; relaunch from the last commit."""


def checkpoint_group(timeout_s: float) -> Any:
    """A gloo group of every rank for checkpoint collectives, with a bounded timeout (collective: call on
    every rank in the same order). Keeping it off the training group avoids racing the training collectives,
    and the bound turns a hung peer into RankLost instead of a hang."""
    if not timeout_s > 0:
        raise CheckpointError(
            f"checkpoint collective timeout: expected a number of seconds > 0, got {timeout_s!r}"
        )
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def _lost(what: str, exc: BaseException) -> RankLost:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RankLost(f"{what}: a rank of the checkpoint group was lost or timed out ({reason}); relaunch")


class ShardedState(Protocol):
    """What `ShardedCheckpoints` asks of a sharded training state (see `supervisor.sharded_state`)."""

    def snapshot(self) -> tuple[Any, dict[str, Any]]:
        """(JSON skeleton, {name: Tensor | DTensor}) aliasing live memory."""
        ...

    def load(self, nested: dict[str, Any]) -> None: ...

    def rank_state(self) -> Any:
        """This rank's own JSON-able state (RNG streams)."""
        ...

    def load_rank_state(self, saved: Any) -> None: ...


def _as_data(exc: BaseException) -> tuple[str, ...]:
    """Rank 0's failure as plain data (only that crosses the wire), for `_from_data` on every rank."""
    if isinstance(exc, CheckpointCorrupt):
        return ("corrupt", exc.checkpoint_id, exc.reason)
    if isinstance(exc, CheckpointNotFound):
        return ("not_found", str(exc))
    if isinstance(exc, CheckpointError):
        return ("error", str(exc))
    return ("error", f"rank 0: {type(exc).__name__}: {exc}")


def _from_data(data: tuple[str, ...]) -> CheckpointError:
    """The same typed error on every rank from `_as_data`'s tuple."""
    if data[0] == "corrupt":
        return CheckpointCorrupt(data[1], data[2])
    return (CheckpointNotFound if data[0] == "not_found" else CheckpointError)(data[1])


def _mismatch(snap: Snapshot, local: Mapping[str, Any]) -> str | None:
    """Why the snapshot cannot be copied into these live local shards (None: it can)."""
    if set(snap.tensors) != set(local):
        return f"its ring snapshot {snap.id} holds other tensors than the live state"
    for name, t in local.items():
        buf = snap.tensors[name]
        if buf.shape != t.shape or buf.dtype != t.dtype:
            return f"{name}: snapshot {tuple(buf.shape)} {buf.dtype}, live {tuple(t.shape)} {t.dtype}"
    return None


class _LoggedErrors(BackgroundErrors):
    """An upload's failure, logged (the remote copy is a spare; the local commit stands)."""

    def record(self, checkpoint_id: str, exc: BaseException) -> None:
        log.error("Upload of sharded checkpoint %s failed: %s: %s", checkpoint_id, type(exc).__name__, exc)


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def write_sharded(
    root: str,
    flat: Mapping[str, Any],
    rank_raw: bytes,
    job: CommitJob | Callable[[], CommitJob] | None,
    *,
    process_group: Any = None,
    no_dist: bool = False,
    phase_hook: Callable[[str, int], None] | None = None,
    failure: BaseException | None = None,
    expect_id: str | None = None,
) -> str:
    """One sharded save of `flat` ({name: Tensor | DTensor}) through DCP into the store at `root`, from every
    rank (rank 0 passes the `job`, or a function DCP's planning step calls to build it, and commits); returns
    the checkpoint id. A failure on any rank raises CheckpointError on every rank, a lost peer RankLost;
    either way rank 0 removes what was staged."""
    writer = ShardWriter(root, rank_raw, job, phase_hook, failure=failure, expect_id=expect_id)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist says so
            dcp.save(
                dict(flat),
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                process_group=process_group,
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise unwrap(
            exc, writer.job.meta.id if writer.job else writer.saved_id or "(being planned)"
        ) from None
    except RuntimeError as exc:  # a collective failed (gloo's error, or DistError): not the save's own fault
        if no_dist or isinstance(exc, CheckpointError):
            raise
        cid = writer.job.meta.id if writer.job else writer.saved_id or "(being planned)"
        raise _lost(f"save {cid}", exc) from exc
    finally:
        if writer.job is not None:
            discard(writer.job)
    assert writer.saved_id is not None
    return writer.saved_id


class ShardedCheckpoints:
    """Sharded checkpoints of one store, on every rank of `process_group`.

    Without a `process_group`, a distributed run gets a gloo group of its own with `collective_timeout_s`
    (`checkpoint_group`). `phase_hook(phase, rank)` is called at each step of the save protocol
    (`dcp_writer.PHASES`): crash tests kill a rank there with a real signal.

    Asynchronous saves: at most `max_in_flight` pending per rank; the ring holds max(`memory_slots`,
    `max_in_flight`) snapshots. `control_group`, a group only the training thread uses (the Session's), lets
    `restore_memory` agree without waiting for the writer; without one it waits, then agrees on
    `process_group`. A save that failed (CheckpointError, on every rank in lockstep) is raised as
    BackgroundSaveError by the first `save()` that finds it finished on every rank, or by `wait()`; a lost
    peer is RankLost there. Training may go on after the first, never after the second.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        process_group: Any = None,
        collective_timeout_s: float = 60.0,
        retention: RetentionPolicy | Callable[[], RetentionPolicy | None] | None = None,
        gate: Callable[[str], str | None] | None = None,
        verify: str = "full",
        phase_hook: Callable[[str, int], None] | None = None,
        clock: Callable[[], float] = time.time,
        control_group: Any = None,
        memory_slots: int = MEMORY_SLOTS,
        max_in_flight: int = 1,
        overlap: bool | OverlappedCopy = False,
        remote: str | None = None,
    ):
        check_verify(verify)  # before any collective: every rank passes the same value, so all raise alike
        self.root = os.path.abspath(os.fspath(directory))
        self.distributed = dist.is_available() and dist.is_initialized()
        if process_group is None and self.distributed:
            process_group = checkpoint_group(collective_timeout_s)
        self.group = process_group
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.world_size = dist.get_world_size(process_group) if self.distributed else 1
        self.retention, self.verify, self._clock = retention, verify, clock
        #: Called at each phase of every later save (a seam for crash and failure tests; may be set at any time).
        self.phase_hook = phase_hook
        self.gate = gate
        self.control = control_group
        if type(max_in_flight) is not int or max_in_flight < 1:
            raise CheckpointError(f"max_in_flight: expected an integer >= 1, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self.ring = SnapshotRing(max(memory_slots, max_in_flight))
        #: With `overlap`, an async save copies what only an optimizer step changes (parameters, optimizer
        #: state) beside the next forward and backward; the optimizers' step waits for the copy.
        self._copier = (
            overlap if isinstance(overlap, OverlappedCopy) else OverlappedCopy(threads=1) if overlap else None
        )
        self._overlap_default = bool(overlap)  # what save(overlap=None) does, whatever a save asked before
        self._writer = AsyncWriter(
            f"ckpt-shards-r{self.rank}", BackgroundErrors(), max_in_flight=max_in_flight
        )
        #: Failed background saves not raised yet, oldest first: (save number, id, error).
        self._failed: list[tuple[int, str, BaseException]] = []
        self._lost: RankLost | None = None
        self._count = 0  # saves submitted: the same number on every rank, since saves are collective
        self._stale: set[str] = set()  # ring snapshots newer than what was restored: never "latest" again
        self.store = None
        failure: tuple[str, ...] | None = None
        cause: BaseException | None = None
        seq = 0
        #: Rank 0's remote tier: each commit is uploaded in the background; a restore fetches what the local
        #: store lacks (a new machine after a preemption starts with an empty one).
        self.remote: RemoteTier | None = None
        self._uploader: Uploader | None = None
        self._holds = Holds()
        if self.rank == 0:
            try:
                self.store = LocalStore(self.root)
                ids = self.store.catalog.ids()
                if remote:
                    self._open_remote(remote)
                    ids += self.remote.catalog.ids()  # type: ignore[union-attr]
                seq = max((parse_id(i)[1] for i in ids), default=0)
            except Exception as exc:  # sent to every rank, which would otherwise wait for the timeout
                failure, cause = _as_data(exc), exc
        if self.distributed:
            sent: list[Any] = [failure, seq]
            try:  # also the barrier: the store directory exists before any other rank reads it
                dist.broadcast_object_list(sent, group=process_group, group_src=0)
            except RuntimeError as exc:
                raise _lost(f"opening {self.root}", exc) from exc
            failure, seq = sent
        if failure is not None:
            raise _from_data(failure) from cause
        # Every rank names each save alike without a collective (the writer thread owns the group): the id is
        # known when the save is submitted, so every rank's ring holds it under the same id.
        self._seq = int(seq)
        self.catalog = self.store.catalog if self.store else Catalog(fsspec.filesystem("file"), self.root)

    def save(
        self,
        step: int,
        state: ShardedState,
        metrics: Mapping[str, float] | None = None,
        *,
        before_commit: Callable[[], Any] | None = None,
        blocking: bool = True,
        overlap: bool | None = None,
    ) -> str | None:
        """Save checkpoint `step` from every rank; returns its id.

        `blocking`: written and committed before it returns; None when rank 0's `gate` refused it (on every rank
        alike); CheckpointError on any failure, on every rank together (nothing committed); RankLost when a
        peer is gone. `blocking=False`: returns once this rank's shards are copied into its ring; the write
        follows on the writer thread, after the saves before it (see the class for how failures come back).
        `overlap` (None: as the instance was built) copies the parameters and optimizer state beside the next
        forward and backward instead, the optimizers' next step waiting for the copy (`OverlappedCopy`).
        `before_commit` runs on rank 0 once every rank's files are durable, before the marker (a raise there
        commits nothing). A state with `checked()` names the tensors whose non-finite values mark the
        checkpoint unhealthy (module buffers are left out).
        """
        t0 = time.monotonic()
        if blocking:
            self._writer.drain()  # in submission order; and the group is this thread's while it writes
            self._raise_failures(self._count)
        else:
            self._writer.reserve()  # blocks while max_in_flight saves are pending
            try:  # saves up to count - max_in_flight + 1 are finished now on every rank: their failures agree
                self._raise_failures(self._count + 1 - self.max_in_flight)
            except BaseException:
                self._writer.unreserve()
                raise
        self._count += 1
        self._seq += 1
        cid = make_id(step, self._seq)
        job: Callable[[], CommitJob] | None = None
        try:
            skeleton, flat = state.snapshot()
            skeleton_raw, rank_raw = _dumps(skeleton), _dumps(state.rank_state())
            checks = getattr(state, "checked", None)
            checked = checks() if callable(checks) else None
            job = self._job_maker(cid, self._seq, step, skeleton_raw, metrics, before_commit, checked)
            if not blocking:
                self._writer.prune()
                copier, late = self._overlap(state, overlap)
                snap = self.ring.capture(
                    cid,
                    skeleton_raw,
                    flat,
                    {"step": step, "rank_raw": rank_raw},
                    checked,
                    copier=copier,
                    late=late,
                )
        except Exception as exc:
            # This rank cannot take part in save `cid`, but its peers will: it joins the save's collectives
            # with a local plan that fails, so that every rank fails this one save together (a lone rank that
            # skipped it would pair its next save with the peers' current one).
            log.error("Sharded checkpoint %s: rank %d could not capture its share: %s", cid, self.rank, exc)
            job = job or self._failed_job_maker(cid, exc)
            if blocking:
                try:
                    self._write(cid, step, {}, b"{}", job, t0, failure=exc)
                except CheckpointError:
                    pass  # every rank has it now; this rank raises its own cause
                raise
            self._writer.submit(cid, self._write_failure, cid, step, job, exc, self._count)
            if isinstance(exc, UserError):  # the script's mistake (a state the store cannot keep): say so now
                raise
            return cid
        except BaseException:
            if not blocking:
                self._writer.unreserve()
            raise
        if blocking:  # outside the try: a failed write already reached every rank, in step
            return self._write(cid, step, flat, rank_raw, job, t0)
        self._writer.submit(cid, self._write_snapshot, snap, job, self._count)
        log.info(
            "Captured sharded checkpoint %s on rank %d (%.1f MB): training blocked %.3f s; written in the background",
            cid,
            self.rank,
            snap.nbytes / 1e6,
            time.monotonic() - t0,
        )
        return cid

    def _job_maker(
        self,
        cid: str,
        seq: int,
        step: int,
        skeleton_raw: bytes,
        metrics: Mapping[str, float] | None,
        before_commit: Callable[[], Any] | None,
        checked: Callable[[str], bool] | None,
    ) -> Callable[[], CommitJob] | None:
        """Rank 0: the commit job, built by DCP's planning step, so that a failure reaches every rank at once."""
        if self.rank != 0:
            return None

        def job() -> CommitJob:
            made = self._job(cid, seq, step, skeleton_raw, metrics)
            made.before_commit = before_commit
            made.checked = checked
            return made

        return job

    def _failed_job_maker(self, cid: str, exc: BaseException) -> Callable[[], CommitJob] | None:
        """Rank 0's job for a save its own capture failed: never built (the local plan fails first)."""
        if self.rank != 0:
            return None

        def job() -> CommitJob:
            raise CheckpointError(f"save {cid}: rank 0 could not capture its share ({exc})")

        return job

    def _write_failure(
        self, cid: str, step: int, job: Callable[[], CommitJob] | None, exc: BaseException, number: int
    ) -> None:
        """The writer's job for a save this rank could not capture: fail it on every rank, in step."""
        try:
            if self._lost is not None:
                raise self._lost
            self._write(cid, step, {}, b"{}", job, time.monotonic(), failure=exc)
        except RankLost as lost:
            self._lost = lost
        except BaseException as failed:  # the expected outcome: CheckpointError on every rank alike
            self._failed.append((number, cid, failed))

    def _write(
        self,
        cid: str,
        step: int,
        flat: Mapping[str, Any],
        rank_raw: bytes,
        job: Callable[[], CommitJob] | None,
        t0: float,
        failure: BaseException | None = None,
    ) -> str | None:
        """One save through DCP (the training thread's, or the writer's); None when the gate refused it."""
        try:
            write_sharded(
                self.root,
                flat,
                rank_raw,
                job,
                process_group=self.group,
                no_dist=not self.distributed,
                phase_hook=self.phase_hook,
                failure=failure,
                expect_id=cid,
            )
        except SaveRefused as exc:
            log.info("Not committing checkpoint %s of step %d (%s)", cid, step, exc)
            return None
        log.info("Saved sharded checkpoint %s on rank %d in %.3f s", cid, self.rank, time.monotonic() - t0)
        if self._uploader is not None:
            self._uploader.submit(self.catalog.manifest(cid))
        return cid

    def _open_remote(self, url: str) -> None:
        """Rank 0: the remote tier and its upload thread. An upload failure is logged, and never raised: only
        rank 0 uploads, and a raise on one rank would leave the others' next collective waiting."""
        self.remote = RemoteTier(url)
        self._uploader = Uploader(
            self.remote,
            self.store,
            self._holds,
            self._policy,
            _LoggedErrors(),  # type: ignore[arg-type]
        )

    def _policy(self) -> RetentionPolicy | None:
        """The retention asked for now, keeping the checkpoints being uploaded."""
        policy = self.retention() if callable(self.retention) else self.retention
        held = self._holds.held()
        if policy is None or not held:
            return policy
        return AnyOf(policy, KeepProtected(held))

    def _write_snapshot(self, snap: Snapshot, job: Callable[[], CommitJob] | None, number: int) -> None:
        """The writer thread's job: one ring snapshot through DCP; a failure is kept for `save()`/`wait()`."""
        t0 = time.monotonic()
        kept = False
        try:
            if self._lost is not None:  # the group is unusable: no collective can succeed any more
                raise self._lost
            failure: BaseException | None = None
            try:
                flat = snap.staged()  # waits for an overlapped copy, and raises if it failed
            except Exception as exc:  # failed here alone: fail the save on every rank, in step
                flat, failure = {}, exc
            kept = (
                self._write(snap.id, snap.meta["step"], flat, snap.meta["rank_raw"], job, t0, failure=failure)
                is not None
            )
            snap.meta["committed"] = kept
        except RankLost as exc:
            log.error("Background save %s on rank %d: %s", snap.id, self.rank, exc)
            self._lost = exc
        except (
            BaseException
        ) as exc:  # CheckpointError on every rank alike: this save is lost, training goes on
            log.error("Background save %s failed on rank %d: %s", snap.id, self.rank, exc)
            self._failed.append((number, snap.id, exc))
        finally:
            self.ring.release(snap)
            if not kept:  # never committed: not a checkpoint to restore
                self.ring.drop(snap.id)

    def _raise_failures(self, upto: int) -> None:
        """Raise RankLost, else the oldest failure among saves number <= `upto` (each failure once)."""
        if self._lost is not None:
            raise self._lost
        if self._failed and self._failed[0][0] <= upto:
            _, cid, exc = self._failed.pop(0)
            raise BackgroundSaveError(
                f"background save of sharded checkpoint {cid} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def writing(self) -> bool:
        """Whether a save on this rank is still being written (each rank has its own writer)."""
        return any(not f.done() for f in self._writer.futures())

    def _overlap(
        self, state: ShardedState, overlap: bool | None = None
    ) -> tuple[OverlappedCopy | None, Callable[[str], bool] | None]:
        """The copier and the late-copy names for this save, or (None, None) when it is not overlapped (no
        `overlap`, or a state that cannot name its optimizers and what only their step changes)."""
        parts = getattr(state, "overlap_parts", None)
        if overlap is None:
            overlap = self._overlap_default
        if not overlap or not callable(parts):
            return None, None
        if self._copier is None:
            self._copier = OverlappedCopy(threads=1)
        optimizers, late = parts()
        self._copier.guard(optimizers)  # each optimizer's step waits for the copy in flight
        return self._copier, late

    def wait_capture(self) -> float:
        """Block until this rank's overlapped snapshot copy is done; the seconds waited (0 when none is)."""
        return self._copier.wait() if self._copier is not None else 0.0

    def drain(self) -> None:
        """Block until no save of this rank is pending, raising nothing (failures wait for `wait()`/`save()`)."""
        self._writer.drain()

    def wait(self) -> None:
        """Block until no save of this rank is pending; then RankLost if a peer was lost, else the oldest failed
        save as BackgroundSaveError (one per call: call again for the next)."""
        self._writer.drain()
        self._raise_failures(self._count)

    def _job(
        self,
        cid: str,
        seq: int,
        step: int,
        skeleton_raw: bytes,
        metrics: Mapping[str, float] | None,
    ) -> CommitJob:
        assert self.store is not None
        latest = self.catalog.latest("none")
        meta = CheckpointMeta(
            cid,
            seq,
            step,
            self._clock(),
            dict(metrics or {}),
            latest.id if latest else None,
            library_versions(),
            None,
            None,
        )
        return CommitJob(self.store, meta, skeleton_raw, prepare=self._prepare, gate=self.gate)

    def _prepare(self) -> list[str]:
        """Retention before the save is planned (rank 0), then the checkpoints whose blobs it may reuse."""
        policy = self._policy()
        if policy is not None:
            self.catalog.gc(policy)
        listing = self.catalog.listing()
        return [
            i.id for i in listing.infos if not i.abandoned and isinstance(listing.manifest(i.id), Manifest)
        ]

    def restore(self, state: ShardedState, which: str = "latest") -> str:
        """Load checkpoint `which` ("latest" or an id) into `state` on every rank; returns its id.

        Rank 0 chooses and reads the manifest once, and every rank gets its bytes. At the saving world size each
        rank also gets its own rank state back; at another one the rank states are left as they are. "latest"
        falls back to the next older commit, on every rank together, when a rank finds the newest corrupt; a
        specific id raises CheckpointCorrupt instead.
        """
        self._writer.drain()  # DCP's collectives need the group: the writer's pending saves first
        self.wait_capture()  # the live tensors are about to change: an overlapped copy reading them must be done
        skipped: list[str] = []
        while True:
            manifest = self._agree_on(which, skipped)
            try:
                skeleton, saved = self._read_json(manifest)
                self._load(manifest, state, skeleton)
                break
            except CheckpointCorrupt as exc:  # raised on every rank alike (DCP, or _read_json, gathers)
                if which != "latest":
                    raise
                log.warning("Skipping checkpoint %s (%s)", manifest.id, exc.reason)
                skipped.append(manifest.id)
        self._forget_after(manifest.id)
        if manifest.world_size == self.world_size:
            if saved is not None:
                state.load_rank_state(saved)
            log.info("Restored sharded checkpoint %s from disk on rank %d", manifest.id, self.rank)
            return manifest.id
        reshard = getattr(state, "load_rank_states_resharded", None)
        if callable(reshard):  # every saving rank's own state, re-split for this world size (pure per rank)
            reshard(saved, manifest.world_size, self.rank, self.world_size, manifest.step)
        elif self.rank == 0:
            log.warning(
                "Checkpoint %s was saved by %d ranks and is restored on %d: tensors are resharded, each rank "
                "keeps its current RNG streams",
                manifest.id,
                manifest.world_size,
                self.world_size,
            )
        return manifest.id

    def _read_json(self, manifest: Manifest) -> tuple[Any, Any]:
        """(state.json, the rank state), read and checked on every rank before anything is loaded; a bad file
        on any rank is CheckpointCorrupt on every rank together (so all fall back).

        The rank state is this rank's own (or None) at the saving world size; at another one it is the list of
        every saving rank's state, by saved rank (None where a rank wrote none), for the state to re-split."""
        skeleton = saved = None
        problem: tuple[str, str] | None = None
        try:
            skeleton = read_skeleton(self.catalog, manifest)
            if manifest.world_size == self.world_size:
                if str(self.rank) in manifest.rank_files:
                    saved = read_skeleton(self.catalog, manifest, rank_file(manifest.id, self.rank))
            else:
                saved = [
                    read_skeleton(self.catalog, manifest, rank_file(manifest.id, r))
                    if str(r) in manifest.rank_files
                    else None
                    for r in range(manifest.world_size)
                ]
        except CheckpointCorrupt as exc:
            problem = ("corrupt", exc.reason)
        except Exception as exc:  # anything else still reaches every rank, not this one alone
            problem = ("error", f"{type(exc).__name__}: {exc}")
        problems: list[Any] = [problem]
        if self.distributed:
            problems = [None] * self.world_size
            try:
                dist.all_gather_object(problems, problem, group=self.group)
            except RuntimeError as exc:
                raise _lost(f"checking the state files of {manifest.id}", exc) from exc
        for r, found in enumerate(problems):
            if found is not None:
                kind, reason = found
                if kind == "corrupt":
                    raise CheckpointCorrupt(manifest.id, f"rank {r}: {reason}")
                raise CheckpointError(f"checkpoint {manifest.id}: rank {r}: {reason}")
        return skeleton, saved

    def _load(self, manifest: Manifest, state: ShardedState, skeleton: Any) -> None:
        _, targets = state.snapshot()
        try:
            load_tensors(
                self.catalog,
                manifest,
                targets,
                self.verify,
                process_group=self.group,
                no_dist=not self.distributed,
            )
        except RuntimeError as exc:
            if not self.distributed or isinstance(exc, CheckpointError):
                raise
            raise _lost(f"restore of {manifest.id}", exc) from exc
        state.load(unflatten(skeleton, targets))

    def _choose(self, which: str, skipped: list[str]) -> str:
        """Rank 0: the id to restore; "latest" is the newest healthy, live commit that passes a fast check."""
        if self.remote is not None:
            self._fetch(which, skipped)
        if which != "latest":
            return self.catalog.get(which).id
        listing = self.catalog.listing()
        for info in reversed(listing.infos):
            if info.abandoned or not info.healthy or info.id in skipped:
                continue
            reason = self.catalog.verify(info.id, "fast", read=listing.manifest(info.id))
            if reason is None:
                return info.id
            log.warning("Skipping checkpoint %s (%s)", info.id, reason)
        raise CheckpointNotFound(f"no valid committed checkpoint in {self.root}")

    def _fetch(self, which: str, skipped: list[str]) -> None:
        """Rank 0: download `which` ("latest": the newest remote commit newer than every valid local one) from
        the remote tier when the local store lacks a valid copy; the local store is the one every rank reads."""
        assert self.remote is not None and self.store is not None
        local = self.catalog.listing()
        valid_local = {
            i.id: i.seq
            for i in local.infos
            if not i.abandoned and self.catalog.verify(i.id, "fast", read=local.manifest(i.id)) is None
        }
        if which != "latest":
            wanted = [which] if which not in valid_local else []
        else:
            newest = max((s for c, s in valid_local.items() if c not in skipped), default=0)
            remote = self.remote.catalog.listing()
            wanted = [
                i.id
                for i in reversed(remote.infos)
                if i.seq > newest and i.healthy and not i.abandoned and i.id not in skipped
            ]
        for cid in wanted:
            if self.remote.catalog.verify(cid, "fast") is not None:
                log.warning(
                    "Not fetching checkpoint %s from %s: its remote copy is invalid", cid, self.remote.url
                )
                continue
            try:
                self.remote.download(self.store, cid)
            except (OSError, ValueError) as exc:
                log.warning("Fetching checkpoint %s from %s failed (%s)", cid, self.remote.url, exc)
                continue
            log.info("Fetched sharded checkpoint %s from %s into %s", cid, self.remote.url, self.root)
            return

    def _agree_on(self, which: str, skipped: list[str]) -> Manifest:
        """The manifest rank 0 picked, on every rank (an error on rank 0 is raised on every rank)."""
        found: list[Any] = [None]
        cause: BaseException | None = None
        if self.rank == 0:
            try:
                found = [self.catalog.manifest(self._choose(which, skipped)).to_bytes()]
            except Exception as exc:  # sent as plain data (kind, ...): every rank raises the same type
                found, cause = [_as_data(exc)], exc
        if self.distributed:
            try:
                dist.broadcast_object_list(found, group=self.group, group_src=0)
            except RuntimeError as exc:
                raise _lost("choosing the checkpoint to restore", exc) from exc
        if isinstance(found[0], tuple):
            raise _from_data(found[0]) from cause
        return Manifest.from_bytes(found[0])

    def restore_memory(self, state: ShardedState, which: str = "latest") -> str:
        """Restore `which` ("latest": the newest healthy snapshot) from every rank's own ring, at the same world
        size, with no DCP; from disk (`restore`) unless every rank holds it. Collective; returns the id.

        Each rank copies its snapshot back into the local shards of the live state (`to_local()` of the
        aliases), then loads the state and its own rank state, as a restore from disk does.
        """
        t0 = time.monotonic()
        _, live = state.snapshot()
        local, _ = local_shards(live)
        self.wait_capture()  # the live tensors are about to change: the copy reading them must be done
        snap = self._held(which)
        problem = None if snap is not None else f"not in rank {self.rank}'s memory ring"
        if snap is not None:
            problem = _mismatch(snap, local)
        mine = snap.id if problem is None and snap is not None else None
        found: list[Any] = [(mine, problem)]
        if self.distributed:
            group = self.control
            if group is None:  # the group is the writer's: it must be idle first
                self._writer.drain()
                group = self.group
            found = [None] * self.world_size
            try:
                dist.all_gather_object(found, (mine, problem), group=group)
            except RuntimeError as exc:
                raise _lost(f"agreeing on the memory restore of {which}", exc) from exc
        ids = {f[0] for f in found}
        if mine is None or ids != {mine}:
            reasons = "; ".join(f"rank {r}: {f[1] or 'holds ' + str(f[0])}" for r, f in enumerate(found))
            log.info("Restoring %s from disk, not memory (%s)", which, reasons)
            return self.restore(state, which)
        assert snap is not None
        snap.ready()
        copy_tensors([(local[name], snap.tensors[name]) for name in local])
        state.load(unflatten(json.loads(snap.skeleton), dict(live)))
        state.load_rank_state(json.loads(snap.meta["rank_raw"]))
        self._forget_after(snap.id)
        log.info(
            "Restored sharded checkpoint %s from memory on rank %d in %.3f s",
            snap.id,
            self.rank,
            time.monotonic() - t0,
        )
        return snap.id

    def holds(self, checkpoint_id: str) -> bool:
        """Whether this rank's ring holds checkpoint `checkpoint_id` (restorable from memory)."""
        return self.ring.get(checkpoint_id) is not None

    def _held(self, which: str) -> Snapshot | None:
        """This rank's snapshot of `which`; "latest": the newest committed one not gone past and all finite
        here (a save still being written may yet fail or be refused)."""
        if which != "latest":  # an explicit id, even one a restore went back past: its bytes are the same
            return self.ring.get(which)
        for snap in reversed(self.ring.snapshots()):
            if snap.meta.get("committed") and snap.id not in self._stale and not snap.nonfinite():
                return snap
        return None

    def _forget_after(self, checkpoint_id: str) -> None:
        """A restore went back to `checkpoint_id`: later snapshots are never the memory's "latest" again."""
        seq = parse_id(checkpoint_id)[1]
        self._stale |= {s.id for s in self.ring.snapshots() if parse_id(s.id)[1] > seq}

    def close(self) -> None:
        """Finish this rank's pending saves, stop its writer thread, release the store (rank 0); then raise
        what `wait()` would."""
        try:
            self._writer.close()
        finally:
            if self._copier is not None:
                self._copier.close()
            if self._uploader is not None:
                self._uploader.close()  # finishes the uploads under way
                self._uploader = None
            if self.store is not None:
                self.store.close()
                self.store = None
        self._raise_failures(self._count)

    def __enter__(self) -> ShardedCheckpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
