"""What one segment opens and closes: the workdir, the checkpoint store, the heartbeat, the metric logger, the
notice watcher and the signal handlers, and leaving together with the other ranks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor import exitcodes
from supervisor.monitor import HeartbeatWriter, stack_dump
from supervisor.runtime.metrics import AsyncMetricLogger
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.seams import (
    CheckpointReader,
    CheckpointStore,
    Collective,
    MetricsLogger,
    NullHeartbeat,
    NullMetrics,
    Outputs,
)
from supervisor.runtime.segment_store import SegmentStore
from supervisor.runtime.stops import StopRequests, StopSources, notice_watcher
from supervisor.runtime.tracking_run import metric_connection
from supervisor.runtime.wiring import checkpoint_options
from supervisor.state import TrainingState

if TYPE_CHECKING:
    from policies.plain import PolicyView
    from policies.schema import Policy

log = logging.getLogger("rollback_supervisor.session")

#: How long ranks wait for each other on the way out: rank 0 first finishes its pending saves and uploads and
#: flushes its metrics (up to a minute), while the other ranks have nothing to close.
FINISH_TIMEOUT_S = 1800.0


class SegmentResources:
    """Opens the segment's resources in `open_store()`/`start()` (never in the constructor), closes them in `close()`.

    Under DDP only rank 0 writes checkpoints, metrics and the heartbeat and watches for notices; the other
    ranks get the null outputs and a read-only store. Not thread-safe: the training thread calls it.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        checkpoints: SegmentStore,
        outputs: Outputs,
        stops: StopSources,
        dist: Collective | None = None,
    ):
        self._plan, self._dist = plan, dist
        self.checkpoints, self.outputs, self.stops = checkpoints, outputs, stops
        self._started = False

    @classmethod
    def for_plan(
        cls,
        plan: LaunchPlan,
        policy: Policy | PolicyView,
        requests: StopRequests,
        *,
        config: dict[str, Any],
        run_name: str,
        dist: Collective | None = None,
    ) -> SegmentResources:
        """The resources a plan and policy name; rank 0's write, the others' are null or read-only."""
        writer = dist is None or dist.is_writer
        metrics: MetricsLogger = NullMetrics()
        if writer:
            # Only rank 0 logs: several processes opening a fresh sqlite store race on its schema. The sink (the
            # supervisor's spool, or MLflow) is opened on the logger's thread, started after the restore so that
            # it does not compete with it (see supervisor/runtime/metrics.py).
            metrics = AsyncMetricLogger(metric_connection(plan, run_name, config, policy.name), start=False)
        notices = notice_watcher(policy.monitor.preemption_notice) if writer else None
        checkpoints = SegmentStore(
            checkpoint_options(policy, plan, config) if writer else None, policy.checkpoint.verify
        )
        return cls(
            plan,
            checkpoints,
            Outputs(metrics=metrics, heartbeat=NullHeartbeat()),
            StopSources(notices, plan.supervisor_pid, requests=requests),
            dist,
        )

    @property
    def store(self) -> CheckpointReader | None:
        """This rank's view of the checkpoint store (None before it is opened)."""
        return self.checkpoints.reader

    def need(self) -> CheckpointReader:
        return self.checkpoints.need()

    def need_writer(self) -> CheckpointStore:
        return self.checkpoints.need_writer()

    def open_store(self, state: TrainingState) -> CheckpointReader:
        """Open the checkpoint store (and the workdir) if not yet open: the manager locks its directory."""
        if not self.checkpoints.started:
            Path(self._plan.workdir).mkdir(parents=True, exist_ok=True)
            self.checkpoints.start(self._plan, state)
        return self.checkpoints.need()

    def start(self, state: TrainingState) -> None:
        """Open the store and the heartbeat and watch for notices; idempotent."""
        if self._started:
            return
        self.open_store(state)
        if self._plan.supervised:  # every rank dumps its stacks on the supervisor's signal when it hangs
            rank = self._dist.rank if self._dist is not None else 0
            stack_dump.install(stack_dump.segment_dir(self._plan.workdir, self._plan.segment), rank)
        if self._dist is None or self._dist.is_writer:
            self.outputs.heartbeat = HeartbeatWriter(self._plan.heartbeat_path)
        self.stops.start()
        self._started = True

    def close(self, exit_code: int, close_store: Callable[[CheckpointReader], None]) -> None:
        """Stop the watcher, close the store through `close_store`, the metrics, then leave with the other ranks."""
        self.stops.close()
        try:
            if self.checkpoints.reader is not None:
                close_store(self.checkpoints.reader)
        finally:
            metrics = self.outputs.metrics
            metrics.close()
            if not self._plan.supervised:
                sink, run_id = metrics.connection(timeout=0)
                client = getattr(sink, "client", None)  # a spool has none: whoever ships it ends the run
                if client is not None and run_id is not None:
                    status = "FINISHED" if exit_code == exitcodes.EXIT_OK else "FAILED"
                    client.set_terminated(run_id, status=status)
            if self._dist is not None and exit_code != exitcodes.EXIT_FAILED:
                # Every rank got here through the same agreed stop; a failed rank's peers may be stuck in a
                # collective instead, and torchrun tears them down.
                try:
                    self._dist.finish(timeout_s=FINISH_TIMEOUT_S)
                except Exception as exc:
                    log.warning("ranks did not leave together: %s", exc)
