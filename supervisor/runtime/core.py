"""The training-side core: told that a step ended, it answers what to do next, whoever drives the loop.

`Session.loop()` drives it; so can a framework's callbacks. The driver's side of the contract:

- `start()` before anything else (or let `restore()` do it), `install_signal_handlers()` from the main thread;
- `restore()` once, before the first step;
- after each step (`state.step` already advanced), `step_ended(step, metrics, final=...)`, then act:
  `SaveDue` -> `save(step, metrics)`; `Rollback` -> the state was rolled back in process, restart the data
  iterator; `Stop` -> leave the loop; `Continue` -> go on;
- before each step, `stopping()`: a stop may arrive between steps (a signal);
- at the end: if `stopping()` names a stop, `save()` + `wait()` when it asks for a checkpoint, then
  `stopped()`; otherwise the final `save(force=True)` + `wait()`, or `fail()` if that did not land;
- `close()` always.

Not thread-safe: call it from the training thread. The core never saves on its own: the driver does, when
told, so a framework that owns its checkpoint moment keeps it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor import exitcodes
from supervisor.checkpoint import CheckpointInfo
from supervisor.events import Event
from supervisor.monitor import DetectorSet, HeartbeatWriter, Point, build_detectors
from supervisor.runtime.actions import CONTINUE, Action, Rollback, SaveDue, Stop
from supervisor.runtime.agreement import Agreement, StepView
from supervisor.runtime.cadence import Cadence, failures_in
from supervisor.runtime.distributed import Distributed
from supervisor.runtime.faults import FaultInjector
from supervisor.runtime.metrics import AsyncMetricLogger
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.registry import Registered
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.restore import Restorer
from supervisor.runtime.rollback import InProcessRollback
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.saver import Saver
from supervisor.runtime.seams import (
    CheckpointReader,
    NullHeartbeat,
    NullMetrics,
    Outputs,
)
from supervisor.runtime.segment_store import SegmentStore
from supervisor.runtime.stops import StopMode, StopRequest, StopSources, notice_watcher
from supervisor.runtime.tracking_run import metric_connection
from supervisor.runtime.wiring import checkpoint_options
from supervisor.state import TrainingState

log = logging.getLogger("rollback_supervisor.session")

#: How often the heartbeat is written (and the supervisor's pid checked) while training.
BEAT_EVERY_S = 0.5
#: How long ranks wait for each other on the way out: rank 0 first finishes its pending saves and uploads and
#: flushes its metrics (up to a minute), while the other ranks have nothing to close.
FINISH_TIMEOUT_S = 1800.0


class TrainingCore:
    """One supervised training segment's machinery, independent of who drives its steps.

    Owns the stop requests, the save cadence, the in-process detectors and rollback, the restore and the
    reports; `state.step` (the TrainingState's) is the one step counter.

    Under torchrun (`dist`) rank 0 writes checkpoints, metrics, the heartbeat and events; every rank
    restores what rank 0 names and applies the same plan. The in-process rollback is off there: every rank
    would need to agree on the target and read its own state back, so rank 0 reports the anomaly, every rank
    stops (exit 76), and the supervisor relaunches all ranks with the plan.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        policy: Any,
        state: TrainingState,
        *,
        config: dict[str, Any] | None = None,
        run_name: str = "train",
        dist: Distributed | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        from policies import History

        self.plan, self.state, self._dist, self._clock = plan, state, dist, clock
        writer = dist is None or dist.is_writer
        metrics = (
            AsyncMetricLogger(metric_connection(plan, run_name, config or {}, policy.name), start=False)
            if writer
            else NullMetrics()
        )
        # Only rank 0 logs: several processes opening a fresh sqlite store race on its schema. The sink (the
        # supervisor's spool, or MLflow) is opened on the logger's thread, started after the restore so that
        # it does not compete with it (see supervisor/runtime/metrics.py).
        self.outputs = Outputs(metrics=metrics, heartbeat=NullHeartbeat())
        self.registered = Registered()
        notices = notice_watcher(policy.monitor.preemption_notice) if writer else None
        self.stops = StopSources(notices, plan.supervisor_pid)
        history = History.from_dict(plan.history) if plan.history else History()
        ck = policy.checkpoint
        self.cadence = Cadence(
            ck.every_steps,
            ck.every_seconds,
            ck.adaptive,
            failures=failures_in(history),
            observed_s=plan.lineage_seconds,
        )
        reporter = EventReporter(plan.events_path, plan.segment)
        self.failures = SaveFailures(reporter, self.outputs)
        self.rollback = InProcessRollback(policy, history, self.failures, reporter)
        self._saver = Saver(state, self.registered, self.outputs, self.cadence, self.failures, dist)
        self._restorer = Restorer(self.registered, self.outputs, plan.checkpoint_dir, dist)
        specs = [d for d in policy.monitor.detectors if d.type != "hang"]
        self._detectors = DetectorSet(build_detectors(specs), source="in_process")
        self._agreement = Agreement(dist.agree) if dist is not None else None
        self._faults = FaultInjector.from_env(plan.faults_path, state.rank)
        self._stores = SegmentStore(
            checkpoint_options(policy, plan, config) if writer else None,
            policy.checkpoint.verify,
        )
        self._last_beat = 0.0
        self.restored = False
        self.exit_code = exitcodes.EXIT_OK

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open what the segment writes to (workdir, store, heartbeat) and watch for notices; idempotent."""
        if self._stores.started:
            return
        Path(self.plan.workdir).mkdir(parents=True, exist_ok=True)
        self._stores.start(self.plan, self.state)
        if self._dist is None or self._dist.is_writer:
            self.outputs.heartbeat = HeartbeatWriter(self.plan.heartbeat_path)
        self.stops.start()

    def install_signal_handlers(self) -> None:
        """Route SIGTERM (checkpoint, then stop) and SIGUSR2 (stop now) here; main thread only."""
        self.stops.install()

    def restore_signal_handlers(self) -> None:
        self.stops.restore()

    @property
    def store(self) -> CheckpointReader | None:
        """This rank's view of the checkpoint store (None before `start()`)."""
        return self._stores.reader

    def close(self) -> None:
        """Finish pending saves, close the metrics, and leave together with the other ranks."""
        self.stops.close()
        try:
            if self._stores.reader is not None:
                self.failures.despite(self.state.step, self._stores.reader.close)
        finally:
            metrics = self.outputs.metrics
            metrics.close()
            if not self.plan.supervised:
                sink, run_id = metrics.connection(timeout=0)
                if sink is not None and run_id is not None:
                    status = "FINISHED" if self.exit_code == exitcodes.EXIT_OK else "FAILED"
                    sink.client.set_terminated(run_id, status=status)
            if self._dist is not None and self.exit_code != exitcodes.EXIT_FAILED:
                # Every rank got here through the same agreed stop; a failed rank's peers may be stuck in a
                # collective instead, and torchrun tears them down.
                try:
                    self._dist.finish(timeout_s=FINISH_TIMEOUT_S)
                except Exception as exc:
                    log.warning("ranks did not leave together: %s", exc)
        log.info("segment done: %s (exit %d)", exitcodes.DESCRIPTIONS.get(self.exit_code), self.exit_code)

    # -- registration and restore ----------------------------------------------------------------

    def register(self, name: str, obj: Any) -> None:
        """Register a stateful part; optimizers' steps go through the fault drill's hooks."""
        self.registered.add(
            self.state,
            name,
            obj,
            before_step=lambda opt: self._faults.before_optimizer_step(self.state.step, [opt]),
            after_step=lambda opt: self._faults.after_optimizer_step([opt]),
        )

    def restore(self) -> CheckpointInfo | None:
        """Restore per the plan: the named checkpoint (or the latest valid), then skip batches and scale the LR."""
        self.restored = True
        self.start()
        self.outputs.heartbeat.beat(self.state.step, "checkpoint")  # restoring is slow, not stuck
        spec = self.plan.restore
        info = self._restorer.restore(self._stores.writer, self._stores.need(), spec)
        self.outputs.metrics.start()
        self._after_restore(spec.skip_batches, spec.lr_scale, info, "plan")
        return info

    def _after_restore(self, skip: int, lr_scale: float, info: CheckpointInfo | None, why: str) -> None:
        self._restorer.apply(skip, lr_scale)
        self._detectors.reset_segment()
        self.cadence.start(self.state.step, self._clock())
        self._restorer.report(self.state.step, skip, lr_scale, info, why)

    # -- steps -----------------------------------------------------------------------------------

    def log(self, metrics: dict[str, float]) -> None:
        """Log metrics at the current step (asynchronously)."""
        self.outputs.metrics.log(metrics, self.state.step)

    def step_ended(self, step: int, metrics: dict[str, float], *, final: bool = False) -> Action:
        """Step `step` ended with `metrics` (`final`: the driver's last step): what to do next."""
        now = self._clock()
        self.cadence.observe_step(now)
        if now - self._last_beat >= BEAT_EVERY_S:
            self.outputs.heartbeat.beat(step, "train")
            self._last_beat = now
            self.stops.poll()
        events = self._observe(step, metrics)
        if events and self._agreement is None:
            return self._anomaly(events[0], step)
        self._faults.after_step(step)
        writing = self.cadence.adaptive and self._stores.need().writing()
        pending = self.stops.requests.current
        due = self.cadence.due(step, now, writing=writing, stopping=pending is not None, final=final)
        if self._agreement is not None:
            return self._agree(self._agreement, events, step, due=due, writing=writing)
        if due:
            return SaveDue(step)
        return self.stopping() or CONTINUE

    def _observe(self, step: int, metrics: dict[str, float]) -> list[Event]:
        """Feed the step's metrics to the detectors; under DDP only rank 0's (what MLflow and the supervisor see)."""
        if self._dist is not None and not self._dist.is_writer:
            return []
        wall = time.time()
        segment = self._detectors.segment
        return [
            event
            for key, value in metrics.items()
            for event in self._detectors.observe(Point(key, step, float(value), wall, segment))
        ]

    def _anomaly(self, event: Event, step: int) -> Action:
        """Roll back in process if the policy says so; else stop for the supervisor to decide."""
        rolled = self.rollback.handle(self._stores.need_writer(), event, step)
        if rolled is None:
            return self._stop_for_anomaly(f"anomaly: {event.reason}")
        decision = rolled.decision
        self._after_restore(decision.skip_batches, decision.lr_scale, rolled.info, "in-process rollback")
        return Rollback(rolled.info.id, self.state.step, decision.skip_batches, decision.lr_scale)

    def _stop_for_anomaly(self, reason: str) -> Stop:
        request = StopRequest(StopMode.NOW, reason, exitcodes.EXIT_ANOMALY)
        self.stops.requests.force(request)
        self.exit_code = exitcodes.EXIT_ANOMALY
        return request.action()

    def _agree(
        self, agreement: Agreement, events: list[Event], step: int, *, due: bool, writing: bool
    ) -> Action:
        """One all_reduce per step: an anomaly or a stop anywhere stops every rank; a save is taken together."""
        pending = self.stops.requests.current
        mine = StepView(bool(events), pending.mode if pending else None, due, writing)
        agreed = agreement.agree(mine)
        if agreed.anomaly:
            for event in events:  # all of them, so the supervisor's monitor finds each one reported
                log.warning(
                    "anomaly under DDP: %s; every rank stops for the supervisor to decide", event.reason
                )
                self.rollback.left_to_supervisor(event)
            return self._stop_for_anomaly("anomaly reported by rank 0")
        if agreed.stop is not None:
            self.stops.requests.adopt(agreed.stop, "another rank was asked to stop")
        if agreed.save:
            return SaveDue(step)
        return self.stopping() or CONTINUE

    def stopping(self) -> Stop | None:
        """The stop to carry out now, if any; under DDP only one every rank agreed on counts."""
        if self._agreement is not None and not self._agreement.stopped:
            return None
        pending = self.stops.requests.current
        return pending.action() if pending is not None else None

    def request_stop(self, reason: str, *, checkpoint: bool = False) -> None:
        """Ask to stop after this step (with an emergency checkpoint first if `checkpoint`)."""
        self.stops.requests.request(StopMode.CHECKPOINT if checkpoint else StopMode.NOW, reason)

    # -- saving and stopping -------------------------------------------------------------------

    def save(self, step: int, metrics: dict[str, float], *, force: bool = False) -> bool:
        """Checkpoint `step`; False if it failed (reported: a full or broken disk does not stop training)."""
        return self._saver.save(self._stores.need(), step, metrics, force=force)

    def wait(self) -> bool:
        """Wait for pending saves and uploads; False if one failed (each failure is reported)."""
        return self._saver.wait(self._stores.need(), self.state.step)

    def stopped(self, stop: Stop, *, saved: bool = False, seconds: float = 0.0) -> int:
        """The driver left the loop for `stop` (and wrote its checkpoint if it asked for one): the exit code."""
        step = self.state.step
        if not stop.checkpoint:
            if self.exit_code == exitcodes.EXIT_OK:
                self.exit_code = stop.exit_code
            log.warning("stopping at step %d (%s), no checkpoint", step, stop.reason)
            return self.exit_code
        if saved:
            log.warning(
                "preempted (%s): emergency checkpoint at step %d in %.2fs", stop.reason, step, seconds
            )
        else:  # reported; the supervisor resumes from the newest valid checkpoint, as after a kill
            log.error("preempted (%s): emergency checkpoint at step %d failed", stop.reason, step)
        self.exit_code = stop.exit_code
        return self.exit_code

    def fail(self, reason: str | None = None) -> None:
        """The segment failed (an exception, or its final checkpoint did not land): exit 1 unless already set."""
        if reason:
            log.error("%s", reason)
        if self.exit_code == exitcodes.EXIT_OK:
            self.exit_code = exitcodes.EXIT_FAILED

    @property
    def rollbacks_in_process(self) -> int:
        return self.rollback.count
