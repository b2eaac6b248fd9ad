"""The checkpoint store of one segment, opened when the segment starts: rank 0's manager, or a reader; with a
sharded model (FSDP2), every rank's `ShardedCheckpoints`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from supervisor.checkpoint import CheckpointInfo, CheckpointManager, CheckpointOptions
from supervisor.checkpoint.restorer import Which
from supervisor.checkpoint.retention import policy_from_settings
from supervisor.errors import CheckpointError, CheckpointNotFound, UnsupportedStateError, UserError
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
        #: The segment's collective under torchrun (None alone): a sharded store's rank 0 names its choices with it.
        self.dist: Collective | None = None

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

    Saves are synchronous (the ring and writer thread of the design's slice 5 are not built): `save()` returns
    once the checkpoint is committed, so `writing()` is always False. Every call but the catalog's reads is
    collective. Rank 0 (`commits`) owns the store: the listing, retention, abandoning; the other ranks' rank-0-only
    verbs do nothing, as `ReadOnlyCheckpoints`' do.
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
        # The Session's own gloo group (see `Distributed`), not one more: saves run on the training thread, so
        # they never interleave with its collectives, and it is torn down in order by `Distributed.finish`.
        # A third gloo group, left to the final `destroy_process_group`, made a rank abort at exit now and
        # then (SIGABRT, "terminate called without an active exception") on these shared cores.
        self.checkpoints = ShardedCheckpoints(
            directory,
            process_group=getattr(dist, "group", None),
            collective_timeout_s=collective_timeout_s,
            retention=None,
            verify=verify,
        )
        self.commits = self.checkpoints.rank == 0
        if self.commits and options is not None and options.remote:
            log.warning(
                "checkpoint.remote %s is not used for sharded checkpoints yet (issue 17): they stay in %s",
                options.remote,
                directory,
            )
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
        if self.commits and self._options is not None:  # rebuilt per save: it keeps the ids held now
            o = self._options
            self.checkpoints.retention = policy_from_settings(
                o.keep_last, o.keep_best, o.keep_every_steps, protected=set(self._held)
            )
        try:
            cid = self.checkpoints.save(step, self.state, metrics, before_commit=before_commit)
        except CheckpointError as exc:
            if isinstance(exc, UnsupportedStateError):  # the user's state, not the disk: fix the script
                raise
            # Every rank got it in lockstep and nothing was committed. A failed save costs the checkpoint, not
            # the run: rank 0 reports it (the saver takes an OSError as a failed write), as it would alone.
            if not self.commits:
                log.warning("sharded checkpoint of step %d not saved: %s", step, exc)
                return None
            raise SaveFailedError(f"sharded checkpoint of step {step} not saved: {exc}") from exc
        if cid is None:
            return None
        self._last = self._info(cid)
        return self._last

    def _info(self, checkpoint_id: str) -> CheckpointInfo:
        return self.checkpoints.catalog.get(checkpoint_id)

    def restore(self, which: Which = "latest") -> CheckpointInfo:
        """Every rank loads its own shards of `which` (rank 0 chooses for "latest"); collective."""
        which = which if isinstance(which, str) else which.id
        if self.announce is not None:
            self.announce(which)
        cid = self.checkpoints.restore(self.state, which)
        self._last = self._info(cid)
        return self._last

    def restore_memory(self, which: Which = "latest", *, wait: bool = True) -> CheckpointInfo:
        """No host-memory ring yet (slice 5): restored from disk, on every rank."""
        return self.restore(which)

    def writing(self) -> bool:
        return False

    def wait(self) -> None:
        """Nothing is pending: every save committed before it returned."""

    def close(self) -> None:
        self.checkpoints.close()

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
        return self.list()

    def protect(self, ids: Iterable[str]) -> None:
        self._held |= set(ids)

    def unprotect(self, ids: Iterable[str]) -> None:
        self._held -= set(ids)

    def abandon_after(self, which: Which, *, wait: bool = True) -> list[CheckpointInfo]:
        """Mark every later commit abandoned (rank 0; nothing is in flight); returns them."""
        if not self.commits or self.checkpoints.store is None:
            return []
        target = self._info(which if isinstance(which, str) else which.id)
        gone = [i for i in self.list() if i.seq > target.seq and not i.abandoned]
        for info in gone:
            self.checkpoints.store.mark_abandoned(info.id, f"rolled back to {target.id}")
        self._last = target
        return [replace(i, abandoned=True) for i in gone]
