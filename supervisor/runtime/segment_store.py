"""The checkpoint store of one segment, opened when the segment starts: rank 0's manager, or a reader; with a
sharded model (FSDP2), every rank's `ShardedCheckpoints`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from supervisor.checkpoint import CheckpointInfo, CheckpointManager, CheckpointOptions
from supervisor.checkpoint.options import parse_id
from supervisor.checkpoint.restorer import Which
from supervisor.checkpoint.retention import policy_from_settings
from supervisor.errors import (
    BackgroundSaveError,
    CheckpointError,
    CheckpointNotFound,
    UnsupportedStateError,
    UserError,
)
from supervisor.runtime.distributed import ReadOnlyCheckpoints
from supervisor.runtime.plan import LaunchPlan, RestoreSpec
from supervisor.runtime.seams import CheckpointReader, CheckpointStore, Collective
from supervisor.state import TrainingState

if TYPE_CHECKING:  # imported when a sharded model is registered: DCP costs a plain Session ~0.2 s to import
    from supervisor.sharded_state import SessionShardedState

log = logging.getLogger("rollback_supervisor.session")

#: The checkpoint group's bound on one collective when there is no Session group to use (one process): a
#: save's gather waits for the slowest rank's writes, so it is generous; a hung peer turns into RankLost.
SHARDED_COLLECTIVE_TIMEOUT_S = 300.0


#: Under DDP, `checkpoint.sharded: auto` shards a model from this many parameters: below it rank 0's writer
#: commits and restores faster (DCP's planning costs ~0.05-0.1 s per operation), above it the ranks' shared
#: writes do (2.2x at 100M; benchmarks/results/checkpoint-ddp-paths-*.json).
SHARDED_DDP_MIN_PARAMS = 50_000_000


def shards(mode: str, *, dtensor: bool, distributed: bool, params: int) -> bool:
    """Whether a registered model goes through sharded checkpoints (pure): always with DTensor parameters
    (FSDP2); in a multi-process job by the policy's `checkpoint.sharded`."""
    if dtensor:
        return True
    if not distributed or mode == "never":
        return False
    return mode == "always" or params >= SHARDED_DDP_MIN_PARAMS


@dataclass(frozen=True)
class ShardedModel:
    """The sharded model a Session registered, and the parts saved per rank (the data loader)."""

    name: str
    rank_parts: Sequence[str]


class StoreNotOpen(UserError):
    """The store was used before the segment started."""


class SegmentStore:
    """Opens the store on `start()` (the manager locks its directory), not when the segment is built.

    `options` None: this rank does not write (DDP ranks > 0) and restores read-only what rank 0 names.
    """

    def __init__(self, options: CheckpointOptions | None, verify: str):
        self._options, self._verify = options, verify
        self.writer: CheckpointStore | None = None
        self.reader: CheckpointReader | None = None
        self.sharded: ShardedModel | None = None
        #: The policy's `checkpoint.sharded`: which models of a multi-process job go through sharded checkpoints.
        self.sharded_mode = "auto"
        #: The segment's collective under torchrun (None alone): a sharded store's rank 0 names its choices with it.
        self.dist: Collective | None = None

    def shards(self, obj: Any, *, dtensor: bool) -> bool:
        """Whether registering `obj` makes it the model sharded checkpoints go through (the first that qualifies)."""
        if self.sharded is not None or not hasattr(obj, "parameters"):
            return False
        import torch

        if not isinstance(obj, torch.nn.Module):
            return False
        return shards(
            self.sharded_mode,
            dtensor=dtensor,
            distributed=self.dist is not None,
            params=sum(p.numel() for p in obj.parameters()),
        )

    def use_sharded(self, model: ShardedModel) -> None:
        """Save and restore through every rank's shards (a model with DTensor parameters was registered)."""
        if self.reader is not None:
            raise UserError(
                f"register({model.name!r}): a sharded model must be registered before the segment starts"
            )
        if self.sharded is not None and self.sharded.name != model.name:
            raise UserError(
                f"register({model.name!r}): {self.sharded.name!r} is already the sharded model; one sharded "
                "model per Session"
            )
        self.sharded = model

    @property
    def started(self) -> bool:
        return self.reader is not None

    def start(self, plan: LaunchPlan, state: TrainingState) -> None:
        if self.sharded is not None:
            from supervisor.sharded_state import SessionShardedState

            store = ShardedStore(
                plan.checkpoint_dir,
                SessionShardedState(state, self.sharded.name, self.sharded.rank_parts),
                self._options,
                self._verify,
                dist=self.dist,
            )
            self.writer = store if store.commits else None
            self.reader = store
        elif self._options is not None:
            manager = CheckpointManager(self._options, state)
            self.writer = manager
            self.reader = manager
        else:
            self.reader = ReadOnlyCheckpoints(plan.checkpoint_dir, state, self._verify)

    def need(self) -> CheckpointReader:
        """This rank's store; raises if the segment has not started."""
        if self.reader is None:
            raise StoreNotOpen(
                "the checkpoint store is not open yet: call Session.restore() (or TrainingCore.start()) first"
            )
        return self.reader

    def need_writer(self) -> CheckpointStore:
        """Rank 0's manager; raises on another rank or before the start."""
        if self.writer is None:
            raise StoreNotOpen(
                "only rank 0 writes and rolls back checkpoints, once TrainingCore.start() opened the store"
            )
        return self.writer


def _write_mode(options: CheckpointOptions | None, dist: Collective | None) -> dict[str, Any]:
    """Rank 0's choice of asynchronous saves, memory slots and saves in flight, on every rank (only rank 0
    has the options; a rank that wrote alone would leave the others in its collective)."""
    mine = None
    if options is not None:
        mine = json.dumps(
            {
                "async": options.async_save,
                "memory_slots": options.memory_slots,
                "max_in_flight": options.max_in_flight,
                "overlap": options.overlap,
            }
        )
    if dist is not None:
        mine = dist.broadcast_outcome(mine if dist.is_writer else None)
    if not mine:
        return {"async": False, "memory_slots": 0, "max_in_flight": 1, "overlap": False}
    return json.loads(mine)


def sharded_target(store: ShardedStore, spec: RestoreSpec, where: str) -> str | None:
    """Rank 0: what the plan restores ("latest" or an id), or None for a start from scratch (as
    `choose_and_restore` decides, refusing to start over when checkpoints exist but none is valid)."""
    if spec.from_scratch:
        return None
    if not spec.checkpoint_id and store.latest() is None:
        if spec.checkpoint_id is None and store.list():
            raise CheckpointNotFound(
                f"no valid checkpoint among {len(store.list())} in {where}; "
                "run `rollback-supervisor checkpoints verify` on it, or restart from scratch on purpose"
            )
        return None
    return spec.checkpoint_id or "latest"


class SaveFailedError(OSError):
    """A sharded save failed on some rank; nothing was committed (the saver reports it, training goes on)."""


class ShardedStore:
    """`ShardedCheckpoints` behind the store seams, on every rank: each rank saves and restores its own shards.

    With the policy's `checkpoint.async` (rank 0's options, sent to every rank at the start), `save()` returns
    once each rank's shards are copied into its ring and each rank's writer thread writes them over the
    checkpoint group (`Distributed.checkpoint_group`); `writing()` is this rank's own writer (the Session's
    agreement takes the maximum over ranks). A failed background save comes back from the next `save()` or
    `wait()` on every rank: rank 0 raises it for the saver to report, the others log it. A restore, from disk
    or from memory, goes through the ring first: every rank copies back its own snapshot when every rank holds
    it, else every rank reads its shards from disk. Every call but the catalog's reads is collective. Rank 0
    (`commits`) owns the store: the listing, retention, abandoning; the other ranks' rank-0-only verbs do
    nothing, as `ReadOnlyCheckpoints`' do.
    """

    def __init__(
        self,
        directory: str,
        state: SessionShardedState,
        options: CheckpointOptions | None,
        verify: str,
        *,
        dist: Collective | None = None,
        collective_timeout_s: float = SHARDED_COLLECTIVE_TIMEOUT_S,
    ):
        from supervisor.checkpoint.sharded import ShardedCheckpoints

        self.state, self._options, self.dist = state, options, dist
        self._held: set[str] = set()
        mode = _write_mode(options, dist)
        self.blocking = not mode["async"]
        # The writers' own gloo group, made on every rank here and torn down in order by `Distributed.finish`
        # (a third gloo group left to the final `destroy_process_group` made a rank abort at exit now and then).
        # Restores agree on the Session's group, which only the training thread uses.
        make_group = getattr(dist, "checkpoint_group", None)
        self.checkpoints = ShardedCheckpoints(
            directory,
            process_group=make_group(collective_timeout_s) if make_group is not None else None,
            collective_timeout_s=collective_timeout_s,
            retention=None,
            verify=verify,
            control_group=getattr(dist, "group", None),
            memory_slots=mode["memory_slots"],
            max_in_flight=mode["max_in_flight"],
            overlap=bool(mode.get("overlap")) and bool(mode["async"]),
            remote=options.remote if options is not None else None,  # rank 0 alone uploads and fetches
        )
        self.commits = self.checkpoints.rank == 0
        if self.commits:
            log.info(
                "sharded checkpoints %s: %s",
                directory,
                "synchronous (checkpoint.async is off)"
                if self.blocking
                else f"asynchronous, each rank's writer thread; {len(self.checkpoints.ring)} memory slots per rank",
            )
        if self.commits and options is not None and options.remote:
            log.info("sharded checkpoints are uploaded to %s from rank 0", options.remote)
        self._last: CheckpointInfo | None = None
        #: Told the id just before rank 0 restores it: an in-process rollback names its target to the other
        #: ranks there, so that they enter the collective restore with it.
        self.announce: Callable[[str], None] | None = None

    def save(
        self,
        step: int,
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        before_commit: Callable[[], Any] | None = None,
        rank_states: dict[str, Any] | None = None,
    ) -> CheckpointInfo | None:
        """Checkpoint `step` from every rank (collective); a step just saved is not saved again unless `force`."""
        if rank_states is not None:
            raise CheckpointError("a sharded save takes each rank's own state, not rank 0's gathered copy")
        if not force and self._last is not None and self._last.step == step:
            log.info("Checkpoint for step %d already taken (%s); not saving again", step, self._last.id)
            return self._last
        self.state.state.step = int(step)
        if self.commits and self._options is not None:
            o = self._options
            # Built when the save's retention runs (on the writer thread for an async save), so it keeps the
            # ids held then: a rollback's protect() after this save was submitted still counts.
            self.checkpoints.retention = lambda: policy_from_settings(
                o.keep_last, o.keep_best, o.keep_every_steps, protected=set(self._held)
            )
        while True:
            try:
                cid = self.checkpoints.save(
                    step, self.state, metrics, before_commit=before_commit, blocking=self.blocking
                )
                break
            except BackgroundSaveError as exc:
                if self.commits:  # the saver reports it (log, MLflow, events) and calls again
                    raise
                self._reported(exc)
            except CheckpointError as exc:
                if isinstance(exc, UnsupportedStateError):  # the user's state, not the disk: fix the script
                    raise
                # Every rank got it in lockstep and nothing was committed. A failed save costs the checkpoint,
                # not the run: rank 0 reports it (the saver takes an OSError as a failed write), as it would alone.
                if not self.commits:
                    log.warning("sharded checkpoint of step %d not saved: %s", step, exc)
                    return None
                raise SaveFailedError(f"sharded checkpoint of step {step} not saved: {exc}") from exc
        if cid is None:
            return None
        if self.blocking:
            self._last = self._info(cid)
        else:  # pending: the catalog lists it once committed
            self._last = CheckpointInfo(
                cid, int(step), time.time(), dict(metrics or {}), seq=parse_id(cid)[1], tiers=("memory",)
            )
        return self._last

    def _reported(self, exc: BaseException) -> None:
        """A rank > 0's view of a failed background save: logged here; rank 0 reports it once for the run."""
        log.warning(
            "checkpoint not saved on rank %d, training goes on (rank 0 reports it): %s",
            self.checkpoints.rank,
            exc,
        )

    def _info(self, checkpoint_id: str) -> CheckpointInfo:
        return self.checkpoints.catalog.get(checkpoint_id)

    def restore(self, which: Which = "latest") -> CheckpointInfo:
        """Every rank loads its own shards of `which` (rank 0 chooses for "latest"); collective. From every
        rank's memory ring when every rank holds it (the same bytes as on disk), else from disk."""
        return self.restore_memory(which)

    def restore_memory(self, which: Which = "latest", *, wait: bool = True) -> CheckpointInfo:
        """From every rank's memory ring if every rank holds `which`, else from disk, on every rank together.

        It never raises CheckpointNotFound for a snapshot missing from memory: the other ranks are already in
        the collective, so the fall back to disk is taken together, inside. Writes in flight are waited for only
        on the way to disk.
        """
        which = which if isinstance(which, str) else which.id
        if self.announce is not None:
            self.announce(which)
        cid = self.checkpoints.restore_memory(self.state, which)
        self._last = self._info(cid)
        return self._last

    def writing(self) -> bool:
        """Whether this rank's writer still writes a save (the agreement takes the maximum over ranks)."""
        return self.checkpoints.writing()

    def wait(self) -> None:
        """Until no save of this rank is pending; rank 0 raises each failed one (BackgroundSaveError), the other
        ranks log them."""
        while True:
            try:
                self.checkpoints.wait()
                return
            except BackgroundSaveError as exc:
                if self.commits:
                    raise
                self._reported(exc)

    def close(self) -> None:
        """Finish this rank's writes and join its writer thread (before `Distributed.finish` tears the groups
        down), then release the store."""
        while True:
            try:
                self.checkpoints.close()
                return
            except BackgroundSaveError as exc:
                if self.commits:
                    raise
                self._reported(exc)

    # -- rank 0's catalog verbs ------------------------------------------------------------------

    def list(self) -> list[CheckpointInfo]:
        return self.checkpoints.catalog.list()

    def latest(self) -> CheckpointInfo | None:
        """The newest live commit that passes a fast check (healthy, unless the options allow non-finite)."""
        allow = self._options is not None and self._options.allow_nonfinite
        for info in reversed(self.list()):
            if info.abandoned or not (info.healthy or allow):
                continue
            if self.checkpoints.catalog.verify(info.id, "fast") is None:
                return info
        return None

    def candidates(self) -> list[CheckpointInfo]:
        """The commits, each marked "memory" when rank 0's ring holds it. Saves still being written are not
        offered: their health mark is each rank's own, and no rank sees every shard."""
        ring = self.checkpoints
        return [replace(i, tiers=("memory", *i.tiers)) if ring.holds(i.id) else i for i in self.list()]

    def protect(self, ids: Iterable[str]) -> None:
        self._held |= set(ids)

    def unprotect(self, ids: Iterable[str]) -> None:
        self._held -= set(ids)

    def abandon_after(self, which: Which, *, wait: bool = True) -> list[CheckpointInfo]:
        """Mark every later commit abandoned (rank 0); returns them. Saves still being written are waited for
        first (each rank's writer goes on without the training threads), so that none commits after the mark."""
        if not self.commits or self.checkpoints.store is None:
            return []
        if self.checkpoints.writing():
            t0 = time.monotonic()
            self.checkpoints.drain()
            log.info(
                "rollback waited %.3f s for the saves in flight, to abandon them too", time.monotonic() - t0
            )
        target = self._info(which if isinstance(which, str) else which.id)
        gone = [i for i in self.list() if i.seq > target.seq and not i.abandoned]
        remote = self.checkpoints.remote
        remote_ids = set(remote.catalog.ids()) if remote is not None else set()
        for info in gone:
            self.checkpoints.store.mark_abandoned(info.id, f"rolled back to {target.id}")
            if remote is not None and info.id in remote_ids:  # an upload still running marks it when it ends
                remote.mark_abandoned(info.id, f"rolled back to {target.id}")
        self._last = target
        return [replace(i, abandoned=True) for i in gone]
