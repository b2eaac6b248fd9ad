"""The checkpoint store of one segment, opened when the segment starts: rank 0's manager, or a reader."""

from __future__ import annotations

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.errors import UserError
from supervisor.runtime.distributed import ReadOnlyCheckpoints
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.seams import CheckpointReader, CheckpointStore
from supervisor.state import TrainingState


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

    @property
    def started(self) -> bool:
        return self.reader is not None

    def start(self, plan: LaunchPlan, state: TrainingState) -> None:
        if self._options is not None:
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
