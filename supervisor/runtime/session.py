"""The training-side API: a few lines in the user's loop attach it to the supervisor."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

from supervisor import exitcodes
from supervisor.checkpoint import CheckpointInfo, CheckpointManager
from supervisor.errors import BackgroundSaveError, CheckpointNotFound, UserError
from supervisor.events import Event
from supervisor.monitor import DetectorSet, HeartbeatWriter, NoticeWatcher, Point, build_detectors
from supervisor.runtime.cadence import Cadence, failures_in
from supervisor.runtime.distributed import (
    Distributed,
    NullHeartbeat,
    NullMetrics,
    ReadOnlyCheckpoints,
)
from supervisor.runtime.faults import FaultInjector
from supervisor.runtime.metrics import AsyncMetricLogger, MetricsSent
from supervisor.runtime.plan import LaunchPlan, load_plan
from supervisor.runtime.tracking_run import metric_connection
from supervisor.runtime.wiring import (
    apply_lr_scale,
    checkpoint_options,
    load_session_policy,
    part_kind,
    to_records,
)
from supervisor.state import TrainingState

log = logging.getLogger("rollback_supervisor.session")

#: Signals the supervisor sends: SIGTERM = preempted (emergency checkpoint), SIGUSR2 = stop now, no checkpoint.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
#: How long ranks wait for each other on the way out: rank 0 first finishes its pending saves and uploads and
#: flushes its metrics (up to a minute), while the other ranks have nothing to close.
FINISH_TIMEOUT_S = 1800.0


class Session:
    """One training segment under supervision (or stand-alone on local defaults).

    Not thread-safe: call it from the training loop's thread. `log()` never blocks on the network;
    checkpoint writes happen in the background (only the host-memory snapshot blocks a step).

    Under torchrun (`dist`, see supervisor.runtime.distributed) rank 0 writes checkpoints, metrics, the
    heartbeat and events; every rank restores the checkpoint rank 0 names and applies the same plan. The
    in-process fast path is off there: a rollback would need every rank to agree on the target and read
    its own state back, so rank 0 reports the anomaly, every rank exits 76, and the supervisor relaunches
    all ranks with the plan (one restart, but no rank can be left behind on another branch).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        config: dict[str, Any] | None = None,
        run_name: str = "train",
        dist: Distributed | None = None,
    ):
        from policies import History

        self.plan = plan
        self.dist = dist
        writer = dist is None or dist.is_writer
        self.config = {k: (str(v) if isinstance(v, Path) else v) for k, v in (config or {}).items()}
        self.run_name = run_name
        self.exit_code = exitcodes.EXIT_OK
        self.policy = load_session_policy(plan)
        self.history = History.from_dict(plan.history) if plan.history else History()
        self.state = TrainingState()
        self.state.rank = dist.rank if dist else 0
        self.manager: Any = (
            CheckpointManager(checkpoint_options(self.policy, plan, self.config), self.state)
            if writer
            else ReadOnlyCheckpoints(plan.checkpoint_dir, self.state, self.policy.checkpoint.verify)
        )
        self.step = 0
        self.rollbacks_in_process = 0
        self._optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[Any] = []
        self._loader: Any = None
        self._rank_parts: list[str] = []  # registered parts that differ per rank (the data loader)
        self._agreed_stop = False
        self._restart_iter = False
        self._step_metrics: dict[str, float] = {}
        self._stop_signal: int | None = None
        self._stop_reason = ""
        self._old_handlers: dict[int, Any] = {}
        self._restored = False
        self._event_seq = 0
        self.save_failures = 0
        workdir = Path(plan.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self._faults = FaultInjector.from_env(plan.faults_path, self.state.rank)
        self._heartbeat: Any = HeartbeatWriter(plan.heartbeat_path) if writer else NullHeartbeat()
        self._last_beat = 0.0
        specs = [d for d in self.policy.monitor.detectors if d.type != "hang"]
        self._detectors = DetectorSet(build_detectors(specs), source="in_process")
        ck = self.policy.checkpoint
        self._cadence = Cadence(
            ck.every_steps,
            ck.every_seconds,
            ck.adaptive,
            failures=failures_in(self.history),
            observed_s=plan.lineage_seconds,
        )
        # Only rank 0 logs: several processes opening a fresh sqlite store race on its schema. The sink (the
        # supervisor's spool, or MLflow) is opened on the logger's thread, started after the restore so that
        # it does not compete with it (see supervisor/runtime/metrics.py).
        self._metrics: Any = (
            AsyncMetricLogger(metric_connection(plan, run_name, self.config, self.policy.name), start=False)
            if writer
            else NullMetrics()
        )
        notice = self.policy.monitor.preemption_notice
        self._notices = None
        if notice.provider != "none" and writer:
            self._notices = NoticeWatcher(
                notice.provider, self._on_notice, endpoint=notice.endpoint, interval=notice.poll_seconds
            ).start()

    @classmethod
    def attach(
        cls,
        *,
        config: dict[str, Any] | None = None,
        workdir: Path | None = None,
        policy: Path | None = None,
        run_name: str = "train",
    ) -> Session:
        """Attach to the supervisor's launch plan (env `ROLLBACK_SUPERVISOR_PLAN`), or run stand-alone.

        Under torchrun, call `dist.init_process_group()` first; a stand-alone run then uses rank 0's plan.
        """
        dist = Distributed.detect()
        plan = load_plan(run_name, workdir, policy)
        if dist is not None and not plan.supervised:
            shared = dist.broadcast_text(json.dumps(plan.to_dict()) if dist.is_writer else None)
            plan = LaunchPlan.from_dict(json.loads(shared))
        return cls(plan, config=config, run_name=run_name, dist=dist)

    @property
    def run_id(self) -> str | None:
        """The MLflow run this segment logs to (waits for the store to open when the run is created here)."""
        if self.plan.run_id:
            return self.plan.run_id
        return self._metrics.connection()[1]

    # -- registration -------------------------------------------------------------------------

    def register(self, **stateful: Any) -> None:
        """Register named objects with `state_dict()`/`load_state_dict()` (model, optimizer, scheduler, data)."""
        for name, obj in stateful.items():
            self.state.register(name, obj)
            if isinstance(obj, torch.optim.Optimizer):
                self._optimizers.append(obj)
                obj.register_step_pre_hook(
                    lambda opt, args, kwargs: self._faults.before_optimizer_step(self.step, [opt])
                )
                obj.register_step_post_hook(
                    lambda opt, args, kwargs: self._faults.after_optimizer_step([opt])
                )
            elif part_kind(obj) == "scheduler":
                self._schedulers.append(obj)
            elif part_kind(obj) == "loader":
                self._loader = self.state[name]  # what is saved: a plain StatefulDataLoader's exact wrapper
                self._rank_parts.append(name)

    # -- restore ------------------------------------------------------------------------------

    def restore(self) -> CheckpointInfo | None:
        """Restore per the plan: the named checkpoint (or the latest valid), then skip batches and scale the LR."""
        self._restored = True
        self._heartbeat.beat(
            self.state.step, "checkpoint"
        )  # restoring (maybe downloading) is slow, not stuck
        spec = self.plan.restore
        info = None
        if self.dist is None or self.dist.is_writer:
            try:
                info = self._restore_as_writer(spec)
            except BaseException as exc:
                if self.dist is not None:
                    self.dist.broadcast_outcome(None, exc)
                raise
        if self.dist is not None:
            chosen = self.dist.broadcast_outcome(info.id if info else None)
            if not self.dist.is_writer and chosen:
                info = self.manager.restore(chosen)
        self.step = self.state.step
        self._metrics.start()
        self._after_restore(spec.skip_batches, spec.lr_scale, info, "plan")
        return info

    def _restore_as_writer(self, spec: Any) -> CheckpointInfo | None:
        info = None
        if not spec.from_scratch:
            which = spec.checkpoint_id or "latest"
            if spec.checkpoint_id is None and self.manager.latest() is None and self.manager.list():
                # Checkpoints exist but none is valid: silently retraining from step 0 would hide it.
                raise CheckpointNotFound(
                    f"no valid checkpoint among {len(self.manager.list())} in {self.plan.checkpoint_dir}; "
                    "run `rollback-supervisor checkpoints verify` on it, or restart from scratch on purpose"
                )
            if spec.checkpoint_id or self.manager.latest() is not None:
                t0 = time.monotonic()
                info = self.manager.restore(which)
                log.info("restored %s (step %d) in %.3fs", info.id, info.step, time.monotonic() - t0)
                if spec.rollback:
                    self.manager.abandon_after(info)
        return info

    def _after_restore(self, skip: int, lr_scale: float, info: CheckpointInfo | None, why: str) -> None:
        if skip:
            self._skip(skip)
        if lr_scale != 1.0:
            apply_lr_scale(self._optimizers, self._schedulers, lr_scale)
        self._detectors.reset_segment()
        self._cadence.start(self.step, time.monotonic())
        self._restart_iter = True
        self._metrics.log(
            {
                "rollback.restored_step": self.step,
                "rollback.skip_batches": skip,
                "rollback.lr_scale": lr_scale,
            },
            self.step,
        )
        if self.dist is not None:
            self._log_ranks_applied()
        if info is not None or skip or lr_scale != 1.0:
            log.info(
                "%s: resumed at step %d from %s, skipped %d batches, lr x%g",
                why, self.step, info.id if info else "scratch", skip, lr_scale,
            )  # fmt: skip

    def _log_ranks_applied(self) -> None:
        """What every rank actually has after the restore (LR, batches skipped), logged by rank 0 per rank."""
        lr = self._optimizers[0].param_groups[0]["lr"] if self._optimizers else float("nan")
        skipped = getattr(self._loader, "batches_skipped", 0)
        rows = self.dist.gather_values([float(lr), float(skipped)])
        metrics = {}
        for rank, (rank_lr, rank_skipped) in enumerate(rows):
            metrics[f"rollback.rank{rank}.lr"] = rank_lr
            metrics[f"rollback.rank{rank}.batches_skipped"] = rank_skipped
        self._metrics.log(metrics, self.step)
        if len({row[0] for row in rows}) > 1:
            log.error("ranks disagree on the learning rate after the restore: %s", [r[0] for r in rows])

    def _skip(self, n: int) -> None:
        if self._loader is None or not hasattr(self._loader, "skip_batches"):
            raise TypeError(
                f"the plan asks to skip {n} batches, but no registered data loader has skip_batches(); "
                "register a supervisor.data.ResumableLoader as data=..."
            )
        self._loader.skip_batches(n)

    # -- the loop -----------------------------------------------------------------------------

    def loop(self, loader: Iterable, *, max_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield `(step, batch)` from the restored position until `max_steps`, handling epochs and rollbacks."""
        _check_loop_loader(loader, self._loader)
        if not self._restored:
            self.restore()
        iterator = None
        while self.step < max_steps and not self._stopping():
            if iterator is None or self._restart_iter:
                iterator, self._restart_iter = iter(loader), False
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = None
                self.state.epoch += 1
                continue
            self.step += 1
            self.state.step = self.step
            self._step_metrics = {}
            yield self.step, batch
            self.state.samples_seen += _batch_len(batch)
            self._after_step(max_steps)
        if self._stopping():
            self._emergency_stop()
        elif self.exit_code == exitcodes.EXIT_OK and not (self._save(self.step, force=True) and self._wait()):
            log.error("the final checkpoint at step %d was not written; the supervisor decides", self.step)
            self.exit_code = exitcodes.EXIT_FAILED

    def log(self, **metrics: float) -> None:
        """Log metrics at the current step (asynchronously) and feed them to the in-process detectors."""
        self._step_metrics.update(metrics)
        self._metrics.log(metrics, self.step)

    def _after_step(self, max_steps: int) -> None:
        now = time.monotonic()
        self._cadence.observe_step(now)
        if now - self._last_beat >= 0.5:
            self._heartbeat.beat(self.step, "train")
            self._last_beat = now
            if (
                self.plan.supervisor_pid
                and not psutil.pid_exists(self.plan.supervisor_pid)
                and self._stop_signal is None
            ):
                # Nobody would act on what we do next: save and stop; the next supervisor resumes us.
                self._stop_signal, self._stop_reason = signal.SIGTERM, "the supervisor process vanished"
        wall = time.time()
        watched = self._step_metrics if self.dist is None or self.dist.is_writer else {}
        events = [  # under DDP only rank 0's metrics are watched: they are what MLflow and the supervisor see
            e
            for k, v in watched.items()
            for e in self._detectors.observe(Point(k, self.step, float(v), wall, self._detectors.segment))
        ]
        if events and self.dist is None:
            self._handle_anomaly(events[0])
            return
        self._faults.after_step(self.step)
        due = self._stop_signal is None and self.step < max_steps and self._cadence.due(self.step, now)
        if self.dist is not None:
            due = self._agree(events, due)
        elif due and self._cadence.adaptive and self.manager.writing():
            # Saving now would block training until the previous write is done. An adaptive cadence picks its
            # own moment, so it saves at the first step after the write instead.
            due = False
        if due:
            self._save(self.step)

    def _stopping(self) -> bool:
        """Whether the loop stops now; under DDP only what every rank agreed on counts."""
        return self._agreed_stop if self.dist is not None else self._stop_signal is not None

    def _agree(self, events: list[Event], due: bool) -> bool:
        """One all_reduce per step: stop (1 = save first, 2 = now), anomaly, save, rank 0 still writing."""
        stop = 0 if self._stop_signal is None else 2 if self._stop_signal == signal.SIGUSR2 else 1
        writing = int(self._cadence.adaptive and self.dist.is_writer and self.manager.writing())
        anomaly, stop, due_any, writing = self.dist.agree(int(bool(events)), stop, int(due), writing)
        if anomaly:
            for event in events:  # all of them, so the supervisor's monitor finds each one reported
                log.warning(
                    "anomaly under DDP: %s; every rank stops for the supervisor to decide", event.reason
                )
                self._report(event, None, handled=False)
            self._stop_signal, self._stop_reason = signal.SIGUSR2, "anomaly reported by rank 0"
            self.exit_code = exitcodes.EXIT_ANOMALY
            self._agreed_stop = True
        elif stop:
            if self._stop_signal is None or stop == 2:
                self._stop_signal = signal.SIGUSR2 if stop == 2 else signal.SIGTERM
                self._stop_reason = self._stop_reason or "another rank was asked to stop"
            self._agreed_stop = True
        return bool(due_any) and not writing and not self._agreed_stop

    def _save(self, step: int, *, force: bool = False) -> bool:
        """Checkpoint `step`; False if it failed (reported: a full or broken disk does not stop training)."""
        t0 = time.monotonic()  # the cadence's save cost: all the time training is blocked here
        self._heartbeat.beat(step, "checkpoint")
        metrics = {k: float(v) for k, v in self._step_metrics.items()}
        # A committed checkpoint implies its metrics are recorded (after a SIGKILL nothing before it is missing
        # from MLflow): the writer waits for them before the commit, so training does not wait for MLflow.
        sent = MetricsSent(self._metrics, step)
        if self.dist is not None:  # every rank takes part; rank 0 stores each rank's share under ranks.<r>
            self.state.rank_states = self.dist.gather_state(self.state.rank_state_dict(self._rank_parts))
        ok = True
        try:
            self._despite_save_failures(
                self.manager.save, step, metrics=metrics, force=force, before_commit=sent.wait
            )
        except OSError as exc:  # a synchronous save's own write (an async one fails on the writer thread)
            self._save_failed(exc)
            ok = False
        finally:
            self.state.rank_states = None
        sent.ask()  # the state is copied: send the metrics now, beside training rather than beside the copy
        self._cadence.observe_save(time.monotonic() - t0)
        self._cadence.saved(step, time.monotonic())
        self._heartbeat.beat(step, "train")
        return ok

    def _wait(self) -> bool:
        """Wait for pending saves and uploads; False if one failed (each failure is reported)."""
        before = self.save_failures
        self._despite_save_failures(self.manager.wait)
        return self.save_failures == before

    def _despite_save_failures(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the manager; an earlier background save that failed is reported (not raised), then retried."""
        while True:
            try:
                return call(*args, **kwargs)
            except BackgroundSaveError as exc:  # the manager raises each one once
                self._save_failed(exc)

    def _save_failed(self, exc: BaseException) -> None:
        """Report a checkpoint not written (none of it committed) to the log, MLflow and events.jsonl."""
        self.save_failures += 1
        cause = exc.__cause__ or exc
        log.error("checkpoint not saved at step %d, training goes on: %s", self.step, exc)
        self._metrics.log({"checkpoint.save_failures": self.save_failures}, self.step)
        evidence = {"error": type(cause).__name__, "errno": getattr(cause, "errno", None)}
        event = Event("storage_error", f"checkpoint not saved: {exc}", step=self.step, source="in_process",
                      wall_time=time.time(), evidence=evidence)  # fmt: skip
        try:  # the workdir may sit on the failing disk: the log line above is then the report
            self._append_event({"kind": "save_failed", "handled_in_process": True, "event": event.to_dict()})
        except OSError as err:
            log.error("could not report the failed save to %s: %s", self.plan.events_path, err)

    # -- anomalies ----------------------------------------------------------------------------

    def _handle_anomaly(self, event: Event) -> None:
        from policies import decide

        # Writes in flight included: never waited for (ARCHITECTURE.md).
        known = self._despite_save_failures(self.manager.candidates)
        decision = decide(
            self.policy, event, self.history, to_records(known), now=time.time(), in_process=True
        )
        log.warning("in-process anomaly: %s -> %s", event.reason, decision.reason)
        if decision.action == "rollback" and decision.target_id is not None:
            t0 = time.monotonic()
            target = next(i for i in known if i.id == decision.target_id)
            self.manager.protect([target.id])  # retention on the writer thread must not delete it meanwhile
            try:
                info, in_ring = self._restore_target(target)
                self._despite_save_failures(self.manager.abandon_after, info, wait=False)
            finally:
                self.manager.unprotect([target.id])
            self.step = self.state.step
            self.history = self.history.record(event, decision, time.time())
            self.rollbacks_in_process += 1
            self._report(
                event,
                decision,
                handled=True,
                restore_s=time.monotonic() - t0,
                tier="memory" if in_ring else "local",
            )
            self._after_restore(decision.skip_batches, decision.lr_scale, info, "in-process rollback")
            return
        # Anything else (a rollback with no target, resume, stop, fail) is the supervisor's to carry out.
        self._report(event, decision, handled=False)
        self._stop_signal, self._stop_reason = signal.SIGUSR2, f"anomaly: {event.reason}"
        self.exit_code = exitcodes.EXIT_ANOMALY

    def _restore_target(self, target: Any) -> tuple[Any, bool]:
        """From the memory ring without waiting for writes; from disk if the ring no longer holds it."""
        if "memory" in target.tiers:
            try:
                return self._despite_save_failures(self.manager.restore_memory, target, wait=False), True
            except CheckpointNotFound:  # committed and dropped from the ring since it was listed
                pass
        return self._despite_save_failures(self.manager.restore, target), False

    def _report(self, event: Event, decision: Any, *, handled: bool, **extra: Any) -> None:
        """Append the event (and the decision taken in process, if any) to events.jsonl for the supervisor."""
        record = {
            "handled_in_process": handled,
            "event": event.to_dict(),
            "decision": decision.to_dict() if decision is not None else None,
            **extra,
        }
        self._append_event(record)

    def _append_event(self, fields: dict[str, Any]) -> None:
        self._event_seq += 1
        record = {
            "seq": self._event_seq,
            "pid": os.getpid(),
            "segment": self.plan.segment,
            "time": time.time(),
        }
        record |= fields
        with open(self.plan.events_path, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    # -- stopping -----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stop_signal is None:
            self._stop_signal = signum
            self._stop_reason = signal.Signals(signum).name

    def _on_notice(self, notice: Any) -> None:
        if self._stop_signal is None:
            self._stop_signal, self._stop_reason = signal.SIGTERM, f"preemption notice: {notice}"

    def _emergency_stop(self) -> None:
        if self._stop_signal == signal.SIGUSR2:
            if self.exit_code == exitcodes.EXIT_OK:
                self.exit_code = exitcodes.EXIT_STOPPED
            log.warning("stopping at step %d (%s), no checkpoint", self.step, self._stop_reason)
            return
        t0 = time.monotonic()
        if self._save(self.step) and self._wait():  # the save is a no-op when this step was just checkpointed
            log.warning(
                "preempted (%s): emergency checkpoint at step %d in %.2fs",
                self._stop_reason,
                self.step,
                time.monotonic() - t0,
            )
        else:  # reported; the supervisor resumes from the newest valid checkpoint, as after a kill
            log.error("preempted (%s): emergency checkpoint at step %d failed", self._stop_reason, self.step)
        self.exit_code = exitcodes.EXIT_PREEMPTED

    def __enter__(self) -> Session:
        for sig in STOP_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self.exit_code in (exitcodes.EXIT_OK,):
            self.exit_code = exitcodes.EXIT_FAILED
        try:
            self.close()  # a SIGTERM now (torchrun tearing ranks down) must not cut a pending save short
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)

    def close(self) -> None:
        if self._notices is not None:
            self._notices.stop()
        try:
            self._despite_save_failures(self.manager.close)
        finally:
            self._metrics.close()
            if not self.plan.supervised:
                sink, run_id = self._metrics.connection(timeout=0)
                if sink is not None and run_id is not None:
                    status = "FINISHED" if self.exit_code == exitcodes.EXIT_OK else "FAILED"
                    sink.client.set_terminated(run_id, status=status)
            if self.dist is not None and self.exit_code != exitcodes.EXIT_FAILED:
                # Every rank got here through the same agreed stop; a failed rank's peers may be stuck in a
                # collective instead, and torchrun tears them down.
                try:
                    self.dist.finish(timeout_s=FINISH_TIMEOUT_S)
                except Exception as exc:
                    log.warning("ranks did not leave together: %s", exc)
        log.info("segment done: %s (exit %d)", exitcodes.DESCRIPTIONS.get(self.exit_code), self.exit_code)


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    return int(first.shape[0]) if hasattr(first, "shape") and first.dim() > 0 else 1


def _check_loop_loader(loader: Any, registered: Any) -> None:
    """A torch DataLoader the session cannot checkpoint would resume at the wrong batch: refuse it up front."""
    import torch.utils.data

    if loader is registered or loader is getattr(registered, "loader", None):
        return
    if isinstance(loader, torch.utils.data.DataLoader):
        raise UserError(
            f"Session.loop(): the {type(loader).__name__} it iterates is not registered, so a resume would not "
            "know its position; build it with supervisor.data.ResumableLoader and register it "
            "(sess.register(..., data=loader))"
        )
