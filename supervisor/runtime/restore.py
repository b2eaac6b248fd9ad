"""Where a segment starts, per its launch plan: which checkpoint, then batches skipped and the LR scaled.

Under DDP rank 0 chooses and restores, then names its choice (or its failure) to every other rank, which
restores the same checkpoint read-only. Every rank then applies the same skip and LR scale.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from supervisor.checkpoint import CheckpointInfo
from supervisor.errors import CheckpointNotFound
from supervisor.runtime.plan import RestoreSpec
from supervisor.runtime.registry import Registered
from supervisor.runtime.seams import CheckpointReader, CheckpointStore, Collective, Outputs

log = logging.getLogger("rollback_supervisor.session")


def choose_and_restore(
    store: CheckpointStore, spec: RestoreSpec, *, where: str = "", clock: Callable[[], float] = time.monotonic
) -> CheckpointInfo | None:
    """Restore the plan's checkpoint (or the latest valid one) into the state; None for a start from scratch.

    Refuses to start from scratch when checkpoints exist but none is valid: silently retraining from step 0
    would hide it. A plan that rolls back abandons every checkpoint committed after its target.
    """
    if spec.from_scratch:
        return None
    if not spec.checkpoint_id and store.latest() is None:
        if spec.checkpoint_id is None and store.list():
            raise CheckpointNotFound(
                f"no valid checkpoint among {len(store.list())} in {where}; "
                "run `rollback-supervisor checkpoints verify` on it, or restart from scratch on purpose"
            )
        return None
    t0 = clock()
    info = store.restore(spec.checkpoint_id or "latest")
    log.info("restored %s (step %d) in %.3fs", info.id, info.step, clock() - t0)
    if spec.rollback:
        store.abandon_after(info)
    return info


class PlanRestore:
    """Restores per the plan on every rank, and applies a restore's skip and LR scale to the registered parts."""

    def __init__(self, registered: Registered, outputs: Outputs, where: str, dist: Collective | None = None):
        self._registered, self._outputs, self._where, self._dist = registered, outputs, where, dist

    def restore(
        self, writer: CheckpointStore | None, reader: CheckpointReader, spec: RestoreSpec
    ) -> CheckpointInfo | None:
        """Rank 0 (`writer`) chooses and restores; under DDP the others (`reader`) restore what it names."""
        info = None
        if writer is not None:
            try:
                info = choose_and_restore(writer, spec, where=self._where)
            except BaseException as exc:
                if self._dist is not None:
                    self._dist.broadcast_outcome(None, exc)
                raise
        if self._dist is not None:
            chosen = self._dist.broadcast_outcome(info.id if info else None)
            if writer is None and chosen:
                info = reader.restore(chosen)
        return info

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
