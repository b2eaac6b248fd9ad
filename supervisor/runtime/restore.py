"""Where a segment starts, per its launch plan: which checkpoint, then batches skipped and the LR scaled.

Under DDP rank 0 chooses and names its choice (or its failure) to every other rank, which restores the same
checkpoint read-only while rank 0 restores it too; rank 0 then confirms what it restored. Every rank then applies the same skip and LR scale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from supervisor.checkpoint import CheckpointInfo
from supervisor.errors import CheckpointError, CheckpointNotFound
from supervisor.runtime.plan import RestoreSpec
from supervisor.runtime.registry import Registered
from supervisor.runtime.seams import CheckpointReader, CheckpointStore, Collective, Outputs

log = logging.getLogger("rollback_supervisor.session")

T = TypeVar("T")


def choose(store: CheckpointStore, spec: RestoreSpec, *, where: str = "") -> str | None:
    """Which checkpoint the plan restores: its id, else the newest valid one's, or None for a start from
    scratch.

    Refuses to start from scratch when checkpoints exist but none is valid: silently retraining from step 0
    would hide it.
    """
    if spec.from_scratch:
        return None
    if spec.checkpoint_id:
        return spec.checkpoint_id
    latest = store.latest()
    if latest is None:
        if store.list():
            raise CheckpointNotFound(
                f"no valid checkpoint among {len(store.list())} in {where}; "
                "run `rollback-supervisor checkpoints verify` on it, or restart from scratch on purpose"
            )
        return None
    return latest.id


def restore_chosen(
    store: CheckpointStore, spec: RestoreSpec, *, clock: Callable[[], float] = time.monotonic
) -> CheckpointInfo:
    """Restore the plan's checkpoint, or the latest (falling back to older commits past a corrupt one), into
    the state. A plan that rolls back abandons every checkpoint committed after its target."""
    t0 = clock()
    info = store.restore(spec.checkpoint_id or "latest")
    log.info("restored %s (step %d) in %.3fs", info.id, info.step, clock() - t0)
    if spec.rollback:
        store.abandon_after(info)
    return info


def choose_and_restore(
    store: CheckpointStore, spec: RestoreSpec, *, where: str = "", clock: Callable[[], float] = time.monotonic
) -> CheckpointInfo | None:
    """Restore the plan's checkpoint (or the latest valid one) into the state; None for a start from scratch."""
    if choose(store, spec, where=where) is None:
        return None
    return restore_chosen(store, spec, clock=clock)


class PlanRestore:
    """Restores per the plan on every rank, and applies a restore's skip and LR scale to the registered parts."""

    def __init__(self, registered: Registered, outputs: Outputs, where: str, dist: Collective | None = None):
        self._registered, self._outputs, self._where, self._dist = registered, outputs, where, dist

    def restore(
        self, writer: CheckpointStore | None, reader: CheckpointReader, spec: RestoreSpec
    ) -> CheckpointInfo | None:
        """Rank 0 (`writer`) chooses and restores; under DDP the others (`reader`) restore what it names.

        Rank 0 names its candidate before it reads, so that every rank reads at once; it then names what it
        restored, and a rank that read something else (rank 0 fell back from a corrupt newest commit) reads
        that instead.
        """
        if self._dist is None:
            return None if writer is None else choose_and_restore(writer, spec, where=self._where)
        dist, info, early = self._dist, None, None
        which = self._on_writer(dist, writer, lambda w: choose(w, spec, where=self._where))
        named = dist.broadcast_outcome(which if writer is not None else None)
        if writer is None and named:
            early = self._read_early(reader, named)
        if writer is not None and which is not None:
            info = self._on_writer(dist, writer, lambda w: restore_chosen(w, spec))
        chosen = dist.broadcast_outcome(info.id if info else None)
        if writer is None and chosen:
            info = early if early is not None and early.id == chosen else reader.restore(chosen)
        return info

    @staticmethod
    def _on_writer(
        dist: Collective, writer: CheckpointStore | None, work: Callable[[CheckpointStore], T]
    ) -> T | None:
        """`work` on rank 0; a failure there is named to every other rank (which then stops too)."""
        if writer is None:
            return None
        try:
            return work(writer)
        except BaseException as exc:
            dist.broadcast_outcome(None, exc)
            raise

    @staticmethod
    def _read_early(reader: CheckpointReader, named: str) -> CheckpointInfo | None:
        """A non-zero rank's read of rank 0's candidate, alongside rank 0's own."""
        try:
            return reader.restore(named)
        except CheckpointError as exc:  # rank 0 fails the same way, and names the outcome next
            log.warning("rank could not read checkpoint %s yet (%s); waiting for rank 0's choice", named, exc)
            return None

    def apply(self, skip: int, lr_scale: float) -> None:
        """Skip `skip` batches and scale the LR by `lr_scale` (after a restore)."""
        if skip:
            self._registered.skip_batches(skip)
        if lr_scale != 1.0:
            self._registered.scale_lr(lr_scale)

    def report(self, step: int, skip: int, lr_scale: float, info: CheckpointInfo | None, why: str) -> None:
        """Log what a restore to `step` did, to MLflow and the log (under DDP, every rank's LR and skip)."""
        self._outputs.metrics.log(
            {"rollback.restored_step": step, "rollback.skip_batches": skip, "rollback.lr_scale": lr_scale},
            step,
        )
        if self._dist is not None:
            self._log_ranks_applied(self._dist, step)
        if info is not None or skip or lr_scale != 1.0:
            log.info(
                "%s: resumed at step %d from %s, skipped %d batches, lr x%g",
                why,
                step,
                info.id if info else "scratch",
                skip,
                lr_scale,
            )

    def _log_ranks_applied(self, dist: Collective, step: int) -> None:
        """What every rank actually has after the restore (LR, batches skipped), logged by rank 0 per rank."""
        rows = dist.gather_values(list(self._registered.applied()))
        metrics = {}
        for rank, (rank_lr, rank_skipped) in enumerate(rows):
            metrics[f"rollback.rank{rank}.lr"] = rank_lr
            metrics[f"rollback.rank{rank}.batches_skipped"] = rank_skipped
        self._outputs.metrics.log(metrics, step)
        if len({row[0] for row in rows}) > 1:
            log.error("ranks disagree on the learning rate after the restore: %s", [r[0] for r in rows])
