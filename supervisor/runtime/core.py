"""The training-side core: told that a step ended, it answers what to do next, whoever drives the loop.

`Session.loop()` drives it; so can a framework's callbacks. The driver's side of the contract:

- `start()` before anything else (or let `restore()` do it), `install_signal_handlers()` from the main thread;
- `restore()` once, before the first step;
- after each step (`state.step` already advanced), `step_ended(step, metrics, final=...)`, then act:
  `SaveDue` -> `save(step, metrics)`; `Rollback` -> the state was rolled back in process, restart the data
  iterator; `Stop` -> leave the loop; `Continue` -> go on;
- before each step, `stopping()`: a stop may arrive between steps (a signal);
- a driver built with `swaps_batches=True` passes every batch through `batch_for_step(batch)` before the step
  (collective in a replay's second stage); the others get no second stage;
- at the end: if `stopping()` names a stop, `save()` + `wait()` when it asks for a checkpoint, then
  `stopped()`; otherwise the final `save(force=True)` + `wait()`, or `fail()` if that did not land;
- `close()` always.

Not thread-safe: call it from the training thread. The core never saves on its own: the driver does, when
told, so a framework that owns its checkpoint moment keeps it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from supervisor import exitcodes
from supervisor.checkpoint import CheckpointInfo, preload
from supervisor.events import Event
from supervisor.monitor.detector_set import DetectorSet
from supervisor.monitor.from_specs import build_detectors
from supervisor.runtime.actions import CONTINUE, Action, Rollback, SaveDue, Stop
from supervisor.runtime.agreement import Agreement
from supervisor.runtime.cadence import Cadence, failures_in
from supervisor.runtime.decider import StepDecider
from supervisor.runtime.faults import FaultInjector
from supervisor.runtime.outcome import SegmentOutcome
from supervisor.runtime.plan import LaunchPlan, RestoreSpec
from supervisor.runtime.registry import Registered
from supervisor.runtime.replay import (
    PERSISTENT,
    REPRODUCIBLE,
    Local,
    Replayer,
    ReplaySettings,
    Verdict,
    hardware_event,
    with_verdict,
)
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.resources import SegmentResources
from supervisor.runtime.restore import PlanRestore
from supervisor.runtime.rollback import InProcessRollback
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.save_policy import SavePolicy
from supervisor.runtime.saver import Saver
from supervisor.runtime.seams import CheckpointReader, CheckpointStore, Collective, Outputs
from supervisor.runtime.segment_store import ShardedModel, ShardedStore, sharded_target
from supervisor.runtime.swap import describe, give_back, take_over
from supervisor.state import TrainingState

if TYPE_CHECKING:
    from policies.plain import PolicyView
    from policies.schema import Policy

log = logging.getLogger("rollback_supervisor.session")


def _is_sharded(obj: Any) -> bool:
    """A module with DTensor parameters (FSDP2's `fully_shard`, tensor parallelism). Without
    torch.distributed.tensor imported no parameter can be one, and the sharded path is not imported."""
    if "torch.distributed.tensor" not in sys.modules or not isinstance(obj, torch.nn.Module):
        return False
    from torch.distributed.tensor import DTensor  # imported already: a dictionary lookup

    return any(isinstance(p, DTensor) for p in obj.parameters())


class TrainingCore:
    """One supervised training segment's machinery, independent of who drives its steps.

    It composes the parts and owns none of their state: `resources` opens and closes what the segment
    writes to, `decider` reads each step's end (and owns the cadence), `outcome` holds the stop and the exit
    code, `rollback` the lineage's history; `state.step` (the TrainingState's) is the one step counter.

    Under torchrun (`dist`) rank 0 writes checkpoints, metrics, the heartbeat and events; every rank
    restores what rank 0 names and applies the same plan. An anomaly is rolled back in process on every rank:
    rank 0 decides, restores and names the (committed) target, the others restore it read-only with their own
    RNG streams and data position. `in_process_rollback=False` leaves every anomaly to the supervisor instead
    (every rank stops with exit 76 and is relaunched with the plan), for a driver whose loop cannot restart
    its data iterator (a framework's).

    With a sharded model registered (DTensor parameters: FSDP2), every rank saves and restores its own shards
    (`ShardedStore`; in the background with `checkpoint.async`, each rank's own writer) and nothing is gathered;
    an anomaly is then rolled back in process on every rank: rank 0 decides and names the target, every rank
    restores its own shards of it from its memory ring when every rank holds it, else from disk.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        policy: Policy | PolicyView,
        state: TrainingState,
        *,
        config: dict[str, Any] | None = None,
        run_name: str = "train",
        dist: Collective | None = None,
        clock: Callable[[], float] = time.monotonic,
        save_policy: SavePolicy | None = None,
        in_process_rollback: bool = True,
        swaps_batches: bool = False,
    ):
        from policies.history import History

        self.plan, self.state = plan, state
        self.in_process_rollback = in_process_rollback
        self.outcome = SegmentOutcome()
        self.resources = SegmentResources.for_plan(
            plan, policy, self.outcome.requests, config=config or {}, run_name=run_name, dist=dist
        )
        self.registered = Registered()
        history = History.from_dict(plan.history) if plan.history else History()
        ck = policy.checkpoint
        cadence = Cadence(
            ck.every_steps,
            ck.every_seconds,
            ck.adaptive,
            failures=failures_in(history),
            observed_s=plan.lineage_seconds,
            keep_every_steps=ck.keep_every_steps,
            policy=save_policy,
        )
        specs = [d for d in policy.monitor.detectors if d.type != "hang"]
        self.decider = StepDecider(
            cadence,
            DetectorSet(build_detectors(specs), source="in_process"),
            (
                Agreement(dist.agree, rank=dist.rank, world_size=dist.world_size, host=socket.gethostname())
                if dist is not None
                else None
            ),
            observes=dist is None or dist.is_writer,
            clock=clock,
        )
        reporter = EventReporter(plan.events_path, plan.segment)
        outputs = self.resources.outputs
        self.failures = SaveFailures(reporter, outputs)
        replay = Replayer(
            ReplaySettings.of(policy.monitor.replay),
            rank=state.rank,
            host=socket.gethostname(),
            deterministic=torch.are_deterministic_algorithms_enabled,
            swaps_batches=swaps_batches,
        )
        self.rollback = InProcessRollback(policy, history, self.failures, reporter, replay=replay)
        self.resources.checkpoints.dist = dist  # a sharded store restores and rolls back with every rank
        self.resources.checkpoints.sharded_mode = ck.sharded
        self._saver = Saver(state, self.registered, outputs, self.failures, dist)
        self._restorer = PlanRestore(self.registered, outputs, plan.checkpoint_dir, dist)
        # The fault drill listens to steps (and optimizer steps); it decides nothing.
        self._drill = FaultInjector.from_env(plan.faults_path, state.rank)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open what the segment writes to (workdir, store, heartbeat) and watch for notices; idempotent."""
        self.resources.start(self.state)

    def open_store(self) -> CheckpointReader:
        """Open only the checkpoint store (the rest waits for `start()`); idempotent."""
        return self.resources.open_store(self.state)

    def install_signal_handlers(self) -> None:
        """Route SIGTERM (checkpoint, then stop) and SIGUSR2 (stop now) here; main thread only."""
        self.resources.stops.install()

    def restore_signal_handlers(self) -> None:
        self.resources.stops.restore()

    @property
    def store(self) -> CheckpointReader | None:
        """This rank's view of the checkpoint store (None before `start()`/`open_store()`)."""
        return self.resources.store

    @property
    def outputs(self) -> Outputs:
        """Where the segment reports to (a test may swap the metric logger before the start)."""
        return self.resources.outputs

    @property
    def exit_code(self) -> int:
        return self.outcome.exit_code

    @property
    def restored(self) -> bool:
        return self.outcome.restored

    def close(self) -> None:
        """Finish pending saves, close the metrics, and leave together with the other ranks."""
        step = self.state.step
        self.resources.close(self.exit_code, lambda store: self.failures.despite(step, store.close))
        log.info("segment done: %s (exit %d)", exitcodes.DESCRIPTIONS.get(self.exit_code), self.exit_code)

    # -- registration and restore ----------------------------------------------------------------

    def register(self, name: str, obj: Any, *, grads_in_closure: bool = False) -> None:
        """Register a stateful part; optimizers' steps go through the fault drill's hooks.

        `grads_in_closure`: the framework computes the gradients inside `optimizer.step(closure)` (Lightning),
        after the optimizer's pre-step hooks, so the drill's gradient faults wait for `gradients_ready()`.
        """
        drill_before = None if grads_in_closure else self.gradients_ready
        if self.resources.checkpoints.shards(obj, dtensor=_is_sharded(obj)):
            # Every rank saves and restores its own shards; nothing is gathered, the per-rank state included
            # (it goes into each rank's ranks.<r>.json), so the saver gets no collective.
            self.resources.checkpoints.use_sharded(ShardedModel(name, self.registered.rank_parts))
            self._saver = Saver(self.state, self.registered, self.outputs, self.failures, None)
            mode = self.resources.checkpoints.sharded_mode
            why = "it has DTensor parameters" if _is_sharded(obj) else f"checkpoint.sharded: {mode}"
            log.info("%r: sharded checkpoints (%s), every rank writes its own share", name, why)
        self.registered.add(
            self.state,
            name,
            obj,
            before_step=drill_before,
            after_step=lambda opt: self._drill.after_optimizer_step([opt]),
        )

    def gradients_ready(self, optimizer: Any) -> None:
        """This step's gradients exist and `optimizer` is about to apply them: the drill's gradient faults fire."""
        self._drill.before_optimizer_step(self.state.step, [optimizer])

    def restore(self) -> CheckpointInfo | None:
        """Restore per the plan: the named checkpoint (or the latest valid), then skip batches and scale the LR."""
        self.outcome.restored = True
        self.start()
        self.outputs.heartbeat.beat(self.state.step, "checkpoint")  # restoring is slow, not stuck
        spec = self.plan.restore
        checkpoints = self.resources.checkpoints
        if isinstance(checkpoints.reader, ShardedStore):
            info = self._restore_sharded(checkpoints.reader, spec)
        else:
            info = self._restorer.restore(checkpoints.writer, checkpoints.need(), spec)
        preload.discard()  # a standby's preloaded copy that was not the target is of no further use
        self.outputs.metrics.start()
        self._after_restore(spec.skip_batches, spec.lr_scale, info, "plan")
        return info

    def _restore_sharded(self, store: ShardedStore, spec: RestoreSpec) -> CheckpointInfo | None:
        """Rank 0 decides what the plan restores and names it; then every rank loads its own shards of it."""
        target, error = None, None
        if store.commits:
            try:
                target = sharded_target(store, spec, self.plan.checkpoint_dir)
            except Exception as exc:
                error = exc
        chosen = store.dist.broadcast_outcome(target, error) if store.dist is not None else target
        if error is not None:
            raise error
        if chosen is None:
            return None
        t0 = time.monotonic()
        info = store.restore(chosen)
        log.info("restored sharded %s (step %d) in %.3fs", info.id, info.step, time.monotonic() - t0)
        if spec.rollback:
            store.abandon_after(info)
        return info

    def _after_restore(self, skip: int, lr_scale: float, info: CheckpointInfo | None, why: str) -> None:
        self._restorer.apply(skip, lr_scale)
        self.decider.restarted(self.state.step)
        self._restorer.report(self.state.step, skip, lr_scale, info, why)

    # -- steps -----------------------------------------------------------------------------------

    def log(self, metrics: dict[str, float]) -> None:
        """Log metrics at the current step (asynchronously); not in a replay's second stage, whose values are
        other ranks' batches."""
        if not self._swapped:
            self.outputs.metrics.log(metrics, self.state.step)

    @property
    def _swapped(self) -> bool:
        active = self.rollback.replay.active
        return active is not None and active.swapped

    def batch_for_step(self, batch: Any) -> Any:
        """The batch this rank computes next: its own, but in a replay's second stage the swapped rank's
        (collective then: every rank calls it once per step)."""
        active = self.rollback.replay.active
        if active is None or active.batches_of is None:
            return batch
        dist = self.resources.checkpoints.dist
        assert dist is not None
        return take_over(dist, batch, active.batches_of)

    def step_ended(self, step: int, metrics: dict[str, float], *, final: bool = False) -> Action:
        """Step `step` ended with `metrics` (`final`: the driver's last step): what to do next."""
        now, beat = self.decider.tick()
        if beat:
            self.outputs.heartbeat.beat(step, "train")
            self.resources.stops.poll()
        replay = self.rollback.replay
        swapped = self._swapped
        if swapped:  # every stream back to its own rank, before the next batch is drawn
            assert replay.active is not None and self.resources.checkpoints.dist is not None
            give_back(self.resources.checkpoints.dist, replay.active.batches_of)
        replay.record(step, metrics)
        # A second stage's values are other ranks' batches: no detector sees them (the onset is compared).
        events = [] if swapped else self.decider.anomalies(step, metrics)
        if replay.active is not None and (local := replay.observe(step, metrics)) is not None:
            return self._replayed(local, step)  # the onset, on every rank at once
        left = self.rollback.warn(events, step) if events and self.decider.agreement is None else None
        if left:  # (anomalies the policy only warns about were reported: training goes on)
            replay.abandon()  # another anomaly before the onset: decided as usual
            return self._anomaly(left[0], step)
        self._drill.after_step(step)
        store = self.resources.store
        writing = store is not None and store.writing()
        pending = self.outcome.pending
        due = self.decider.save_due(step, now, writing=writing, stopping=pending is not None, final=final)
        due = due and not self._swapped  # a second stage's steps ran other ranks' batches: never saved
        if self.decider.agreement is not None:
            return self._agree(events, step, due=due, writing=writing)
        if due:
            return SaveDue(step)
        return self.stopping() or CONTINUE

    def _anomaly(self, event: Event, step: int, *, replayed: bool = False) -> Action:
        """Roll back in process if the policy says so; else stop for the supervisor to decide. `replayed`: the
        replay ran already and the rule decides now."""
        if not self.in_process_rollback:
            log.warning(
                "anomaly at step %d: %s; in-process rollback is off for this driver, so the supervisor decides "
                "(exit %d)",
                step,
                event.reason,
                exitcodes.EXIT_ANOMALY,
            )
            self.rollback.left_to_supervisor(event)
            return self.outcome.stop_for_anomaly(f"anomaly: {event.reason}")
        store = self.resources.need_writer()
        snapshot = None if replayed else self._replay_first(store, event, step)
        if snapshot is not None:
            return self._replaying(snapshot)
        rolled = self.rollback.handle(store, event, step)
        if rolled is None:
            return self.outcome.stop_for_anomaly(f"anomaly: {event.reason}")
        decision = rolled.decision
        self._after_restore(decision.skip_batches, decision.lr_scale, rolled.info, "in-process rollback")
        return Rollback(rolled.info.id, self.state.step, decision.skip_batches, decision.lr_scale)

    def _agree(self, events: list[Event], step: int, *, due: bool, writing: bool) -> Action:
        """One all_reduce per step: an anomaly or a stop anywhere stops every rank; a save is taken together."""
        agreed = self.decider.agree(events, self.outcome.pending, due=due, writing=writing, step=step)
        if self.decider.rank_metrics is not None and not self._swapped:  # every rank's step time (stragglers)
            self.outputs.metrics.log(self.decider.rank_metrics[1], step)
        store = self.resources.store
        if agreed.anomaly:
            left = self.rollback.warn(self._events_on_rank_0(events), step, self.resources.checkpoints.dist)
            if left is None:  # only warned about: every rank trains on; stops and saves are agreed as usual
                agreed = dataclasses.replace(agreed, anomaly=False)
                self.decider.agreement.stopped = agreed.stop is not None
            else:
                self.rollback.replay.abandon()  # another anomaly before the onset: decided as usual
                self._drill.data_rank = self.state.rank  # its own batches again, after a second stage
                self._release_snapshot()
                events = left
        if agreed.anomaly and self.in_process_rollback and isinstance(store, ShardedStore):
            return self._sharded_rollback(store, events, step, stop_pending=agreed.stop is not None)
        dist = self.resources.checkpoints.dist
        if agreed.anomaly and self.in_process_rollback and dist is not None:
            return self._replicated_rollback(dist, events, step, stop_pending=agreed.stop is not None)
        if agreed.anomaly:
            for event in events:  # all of them, so the supervisor's monitor finds each one reported
                log.warning(
                    "anomaly under DDP: %s; every rank stops for the supervisor to decide", event.reason
                )
                self.rollback.left_to_supervisor(event)
            return self.outcome.stop_for_anomaly("anomaly reported by rank 0")
        if agreed.stop is not None:
            self.outcome.requests.adopt(agreed.stop, "another rank was asked to stop")
        if agreed.save:
            return SaveDue(step)
        return self.stopping() or CONTINUE

    def _events_on_rank_0(self, events: list[Event]) -> list[Event]:
        """Every rank's anomalies of this step, on rank 0 (which decides and reports them); [] elsewhere."""
        dist = self.resources.checkpoints.dist
        assert dist is not None
        mine = json.dumps([e.to_dict() for e in events]).encode()
        gathered = dist.gather_bytes(mine)
        if gathered is None:
            return []
        seen = [(r, Event.from_dict(e)) for r, data in enumerate(gathered) for e in json.loads(data)]
        # Which rank saw it, and which saw any: the replay's second stage moves one rank's batches elsewhere.
        by = sorted({r for r, _ in seen})
        return [
            e
            if "seen_on_rank" in e.evidence
            else dataclasses.replace(e, evidence={**e.evidence, "seen_on_rank": r, "seen_by": by})
            for r, e in seen
        ]

    def _sharded_rollback(
        self,
        store: ShardedStore,
        events: list[Event],
        step: int,
        *,
        stop_pending: bool,
        replayed: bool = False,
    ) -> Action:
        """Every rank rolls back in process: rank 0 decides (the policy, as alone) and names the target just
        before its restore; every rank restores its own shards of it, then applies rank 0's skip and LR scale.
        With no target here, every rank stops for the supervisor, as under DDP. A replay first (monitor.replay,
        unless `replayed`) goes the same way: rank 0 names the snapshot, every rank restores its shards of it,
        then rank 0 names the metric and onset every rank replays up to."""
        dist = store.dist
        assert dist is not None  # only under torchrun: alone, `_anomaly` rolls back as always
        if store.commits:
            announced: list[str] = []

            def announce(target: str) -> None:
                if not announced:
                    dist.broadcast_outcome(target)
                    announced.append(target)

            store.announce = announce
            snapshot = None
            try:
                snapshot = None if replayed else self._replay_first(store, events[0], step)
                rolled = None if snapshot is not None else self.rollback.handle(store, events[0], step)
            except Exception as exc:
                if not announced:  # the other ranks wait for a target: they fail with this error
                    dist.broadcast_outcome(None, exc)
                raise
            finally:
                store.announce = None
            if not announced:
                dist.broadcast_outcome(None)
            if snapshot is not None:
                dist.broadcast_outcome(json.dumps([0, 1.0, [events[0].metric, step]]))
                return self._replaying(snapshot)
            if rolled is None:
                return self.outcome.stop_for_anomaly(f"anomaly: {events[0].reason}")
            info, decision = rolled.info, rolled.decision
            dist.broadcast_outcome(json.dumps([decision.skip_batches, decision.lr_scale]))
            skip, lr_scale = decision.skip_batches, decision.lr_scale
        else:
            target = dist.broadcast_outcome(None)
            if target is None:
                return self.outcome.stop_for_anomaly("anomaly reported by rank 0")
            started = self.rollback.replay.now()
            info = store.restore(target)
            skip, lr_scale, *replay = json.loads(dist.broadcast_outcome(None) or "[0, 1.0]")
            if (
                replay
            ):  # rank 0 replays the steps up to the onset: so does this rank, comparing its own values
                self._replay_named(replay[0], events, info, started)
                return self._replaying(info)
            self.rollback.count += 1  # rank 0 decided and keeps the history; every rank counts its rollbacks
        return self._rolled_back(info, int(skip), float(lr_scale), stop_pending=stop_pending)

    def _replicated_rollback(
        self, dist: Collective, events: list[Event], step: int, *, stop_pending: bool, replayed: bool = False
    ) -> Action:
        """DDP with one writer: every rank rolls back in process to the checkpoint rank 0 chooses.

        Rank 0 decides (the policy, as alone), restores from its memory ring (or disk) and waits until the
        target is committed (it may still have been in flight); it then names the target, the skip and the LR
        scale, and every other rank restores that checkpoint read-only from disk, its own per-rank part (RNG
        streams, data position) included. No target (the policy says otherwise): every rank stops for the
        supervisor, as before. A failure on rank 0 is raised on every rank.
        """
        if dist.is_writer:
            store = self.resources.need_writer()
            try:
                snapshot = None if replayed else self._replay_first(store, events[0], step)
                if snapshot is not None:
                    store.wait()  # the other ranks read the snapshot from disk
                    dist.broadcast_outcome(json.dumps([snapshot.id, 0, 1.0, [events[0].metric, step]]))
                    store.protect([snapshot.id])  # kept for a second stage (retention may not drop it)
                    self.rollback.replay.snapshot = snapshot
                    return self._replaying(snapshot)
                rolled = self.rollback.handle(store, events[0], step)
                if rolled is not None:
                    store.wait()  # the other ranks read the target from disk
            except Exception as exc:
                dist.broadcast_outcome(None, exc)
                raise
            if rolled is None:
                dist.broadcast_outcome(None)
                return self.outcome.stop_for_anomaly(f"anomaly: {events[0].reason}")
            info, decision = rolled.info, rolled.decision
            dist.broadcast_outcome(json.dumps([info.id, decision.skip_batches, decision.lr_scale]))
            return self._rolled_back(
                info, decision.skip_batches, decision.lr_scale, stop_pending=stop_pending
            )
        named = dist.broadcast_outcome(None)
        if named is None:
            return self.outcome.stop_for_anomaly("anomaly reported by rank 0")
        target, skip, lr_scale, *replay = json.loads(named)
        started = self.rollback.replay.now()
        info = self.resources.need().restore(target)
        if replay:  # rank 0 replays the steps up to the onset: so does this rank, comparing its own values
            self._replay_named(replay[0], events, info, started)
            return self._replaying(info)
        self.rollback.count += 1  # rank 0 decided and keeps the history; every rank counts its rollbacks
        return self._rolled_back(info, int(skip), float(lr_scale), stop_pending=stop_pending)

    # -- replay (monitor.replay): data or hardware? ----------------------------------------------

    def _replay_first(self, store: CheckpointStore, event: Event, step: int) -> CheckpointInfo | None:
        """Rank 0 (or alone): go back to a memory snapshot to replay the steps up to `event`'s onset, if the
        policy asks and one is near enough (the snapshot restored); None: decide at once (said why, when replay
        is on). The caller then names it to the other ranks, if any, and `_replaying` settles the loop."""
        replay = self.rollback.replay
        why = replay.wants(event, step)
        target = None
        if why is None:
            target, why = replay.target(self.rollback.known(store, step), step)
        if target is None:
            if replay.settings.enabled:
                log.warning("anomaly at step %d not replayed: %s; the policy's rule decides", step, why)
            return None
        started = replay.now()
        info = self.rollback.restore_for_replay(store, target, step)
        replay.begin(event, info.step, started)
        replay.device = self._device()
        log.warning(
            "anomaly at step %d (%s): replaying steps %d-%d from the snapshot at step %d to tell data from hardware",
            step,
            event.reason,
            info.step + 1,
            step,
            info.step,
        )
        return info

    def _replay_named(
        self, named: list[Any], events: list[Event], info: CheckpointInfo, started: float
    ) -> None:
        """A rank other than 0 replays what rank 0 named ([metric, onset]) from the snapshot it restored."""
        metric, onset = named
        event = events[0] if events else _replayed_event(metric)
        self.rollback.replay.begin_named(metric, int(onset), info.step, event, started)
        self.rollback.replay.device = self._device()

    def _replaying(self, info: CheckpointInfo) -> Rollback:
        """The state is the replay's snapshot: the loop goes on from there, nothing skipped, the LR as it was."""
        self._after_restore(0, 1.0, info, "replay")
        return Rollback(info.id, self.state.step, 0, 1.0)

    def _replayed(self, local: Local, step: int) -> Action:
        """The replay reached the onset on every rank: the verdict (every rank's results, under DDP), then
        either go on from the replayed state (a transient hardware fault), replay again on another rank's
        device (the same values, under DDP), or let the rule decide."""
        replay = self.rollback.replay
        active = replay.active
        assert active is not None
        original = active.event
        dist = self.resources.checkpoints.dist
        rows, hosts = [local], [replay.host]
        if dist is not None:
            mine = [
                float(local.differs),
                float(local.first_diff or -1),
                _num(local.original),
                _num(local.replayed),
            ]
            rows = [
                Local(bool(d), int(f) if f >= 0 else None, o, r)  # a missing value is NaN
                for d, f, o, r in dist.gather_values(mine)
            ]
            known = self.decider.agreement.hosts if self.decider.agreement is not None else None
            hosts = list(known) if known is not None else [f"rank {i}" for i in range(len(rows))]
        if active.swapped:
            assert dist is not None
            return self._replayed_elsewhere(dist, rows, step)
        verdict = replay.conclude(rows, hosts)
        if dist is None or verdict.verdict != REPRODUCIBLE:
            self._release_snapshot()  # no second stage
        writer = dist is None or dist.is_writer
        log.warning("replay: %s", verdict.reason)
        if verdict.hardware:
            if writer:
                self.rollback.report_replay(hardware_event(verdict, original, time.time()), verdict, original)
            return self.stopping() or CONTINUE
        event = with_verdict(original, verdict)
        if writer:
            self.rollback.report_replay(event, verdict, original)
        if dist is None:
            return self._anomaly(event, step, replayed=True)
        store = self.resources.store
        if isinstance(store, ShardedStore):
            # No second stage: a rank's shards are every rank's input (all-gathered), so swapping batches
            # cannot move a device's damage away from the others.
            return self._sharded_rollback(store, [event], step, stop_pending=False, replayed=True)
        if verdict.verdict == REPRODUCIBLE:
            elsewhere = self._replay_elsewhere(dist, verdict, original, step)
            if elsewhere is not None:
                return elsewhere
        return self._replicated_rollback(dist, [event], step, stop_pending=False, replayed=True)

    def _replay_elsewhere(
        self, dist: Collective, first: Verdict, original: Event, step: int
    ) -> Action | None:
        """The second stage: the first stage's snapshot again on every rank, then its steps with the batches
        and RNG streams of the rank that saw the anomaly and the next rank swapped. Rank 0 decides whether
        (the policy's `other_device`, the snapshot still held) and names the pair; None: the rule decides."""
        replay = self.rollback.replay
        started = replay.now()
        named: str | None = None
        info: CheckpointInfo | None = None
        if dist.is_writer:
            pair, why = replay.pair_for(original, dist.world_size, first)
            snapshot = replay.snapshot
            try:
                store = self.resources.need_writer()
                held = {c.id for c in self.rollback.known(store, step)} if pair is not None else set()
                if pair is not None and (snapshot is None or snapshot.id not in held):
                    pair, why = None, "the first stage's snapshot is no longer held"
                if pair is not None and snapshot is not None:
                    info = self.rollback.restore_for_replay(store, snapshot, step)
                    store.wait()  # the other ranks read it from disk
                    named = json.dumps([info.id, *pair])
            except Exception as exc:
                self._release_snapshot()
                dist.broadcast_outcome(None, exc)
                raise
            if named is None:
                self._release_snapshot()
                log.warning("replay: no second stage: %s; the policy's rule decides", why)
            dist.broadcast_outcome(named)
        else:
            named = dist.broadcast_outcome(None)
        if named is None:
            return None
        target, suspect, buddy = json.loads(named)
        if info is None:
            info = self.resources.need().restore(target)
        windows = dist.gather_values(replay.window(first.metric, first.from_step, first.onset_step))
        self._release_snapshot()  # every rank restored it (the gather above waited for them)
        hosts, devices = describe(dist, replay.host, self._device())
        pair = (int(suspect), int(buddy))
        batches_of = replay.begin_elsewhere(first, original, pair, windows, hosts, devices, started)
        self._after_restore(0, 1.0, info, "replay on another rank's device")
        self._drill.data_rank = batches_of
        log.warning(
            "replay: the same values on the same device; replaying steps %d-%d again with rank %d's batches on "
            "rank %d's device (this rank computes rank %d's)",
            first.from_step + 1,
            first.onset_step,
            suspect,
            buddy,
            batches_of,
        )
        return Rollback(info.id, self.state.step, 0, 1.0)

    def _release_snapshot(self) -> None:
        """Rank 0: the first stage's snapshot is no longer needed for a second stage (retention may drop it)."""
        replay = self.rollback.replay
        snapshot, replay.snapshot = replay.snapshot, None
        store = self.resources.store
        if snapshot is not None and store is not None and hasattr(store, "unprotect"):
            store.unprotect([snapshot.id])

    def _replayed_elsewhere(self, dist: Collective, rows: list[Local], step: int) -> Action:
        """The second stage reached the onset: a device wrong every time stops every rank for the supervisor
        (which relaunches away from its host where it can); otherwise the rule decides, from each rank's own
        state (its rollback restores its own RNG streams)."""
        replay = self.rollback.replay
        active = replay.active
        assert active is not None and active.first is not None
        first, original = active.first, active.event
        verdict = replay.conclude_elsewhere(rows)
        self._drill.data_rank = self.state.rank
        log.warning("replay: %s", verdict.reason)
        if verdict.verdict == PERSISTENT:
            event = hardware_event(verdict, original, time.time(), [first])
            if dist.is_writer:
                self.rollback.report_replay(event, verdict, original)
                self.rollback.left_to_supervisor(event)
            return self.outcome.stop_for_anomaly(f"hardware fault: {verdict.reason}")
        event = with_verdict(original, verdict, [first])
        if dist.is_writer:
            self.rollback.report_replay(event, verdict, original)
        return self._replicated_rollback(dist, [event], step, stop_pending=False, replayed=True)

    def _device(self) -> str:
        """Where the model computes: the first registered optimizer's first parameter's device."""
        for opt in self.registered.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    return str(p.device)
        return "cpu"

    def _rolled_back(self, info: CheckpointInfo, skip: int, lr_scale: float, *, stop_pending: bool) -> Action:
        if self.decider.agreement is not None and not stop_pending:
            self.decider.agreement.stopped = False  # rolled back, not stopping: stops are agreed again
        self._after_restore(skip, lr_scale, info, "in-process rollback")
        return Rollback(info.id, self.state.step, skip, lr_scale)

    def save_may_be_due(self, step: int, *, final: bool = False) -> bool:
        """Whether `step_ended(step)` may answer SaveDue (the last step, a pending stop, or the cadence), asked
        before the step's metrics are gathered; changes nothing. A driver whose framework logs only some steps
        (the HF Trainer) makes sure such a step's metrics exist, so no checkpoint is written unchecked.

        Under DDP the answer is agreed (one `all_reduce`: collective, every rank asks at the same point): a
        time trigger read on each rank's clock could differ, and the driver's answer changes what the
        framework does next (the Trainer's logging gathers the loss from every rank)."""
        mine = final or self.stopping() is not None or self.decider.may_save(step)
        dist = self.resources.checkpoints.dist
        return mine if dist is None else bool(dist.agree(int(mine))[0])

    def stopping(self) -> Stop | None:
        """The stop to carry out now, if any; under DDP only one every rank agreed on counts."""
        if not self.decider.may_stop:
            return None
        pending = self.outcome.pending
        return pending.action() if pending is not None else None

    def request_stop(self, reason: str, *, checkpoint: bool = False) -> None:
        """Ask to stop after this step (with an emergency checkpoint first if `checkpoint`)."""
        self.outcome.request(reason, checkpoint=checkpoint)

    # -- saving and stopping -------------------------------------------------------------------

    def save(self, step: int, metrics: dict[str, float], *, force: bool = False) -> bool:
        """Checkpoint `step`; False if it failed (reported: a full or broken disk does not stop training), or
        in a replay's second stage (its steps ran other ranks' batches: the snapshot before it is committed)."""
        if self._swapped:
            log.warning("no checkpoint at step %d: a replay's second stage is under way", step)
            return False
        result = self._saver.save(self.resources.need(), step, metrics, force=force)
        self.decider.saved(step, result.blocked_s, result.ended)
        return result.ok

    def wait(self) -> bool:
        """Wait for pending saves and uploads; False if one failed (each failure is reported)."""
        return self._saver.wait(self.resources.need(), self.state.step)

    def stopped(self, stop: Stop, *, saved: bool = False, seconds: float = 0.0) -> int:
        """The driver left the loop for `stop` (and wrote its checkpoint if it asked for one): the exit code."""
        return self.outcome.stopped(stop, self.state.step, saved=saved, seconds=seconds)

    def fail(self, reason: str | None = None, exit_code: int = exitcodes.EXIT_FAILED) -> None:
        """The segment failed (an exception, or its final checkpoint did not land): `exit_code` (1; 2 for a
        user's mistake) unless already set."""
        self.outcome.fail(reason, exit_code)

    @property
    def rollbacks_in_process(self) -> int:
        return self.rollback.count


def _num(value: float | None) -> float:
    return float("nan") if value is None else value


def _replayed_event(metric: str) -> Event:
    """What a rank that did not see rank 0's anomaly knows of it: the metric (its onset comes with it)."""
    return Event("non_finite", f"anomaly in {metric} seen by rank 0", metric=metric, source="in_process")
