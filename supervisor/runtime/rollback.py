"""The in-process rollback: an anomaly seen in training is decided by the policy and, if it says roll back to a
checkpoint this process can reach, undone here without a restart.

The target comes from the memory ring when the ring holds it (without waiting for writes in flight: their
snapshots are restorable already), else from disk. Every later checkpoint is abandoned, committed or not.
A `warn` rule is decided first: the event is recorded and reported, and every rank trains on. Anything else
the policy says (a rollback with no target, resume, stop, fail) is left to the supervisor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from supervisor.checkpoint import CheckpointInfo
from supervisor.errors import CheckpointNotFound
from supervisor.events import Event
from supervisor.runtime.replay import Replayer, ReplaySettings, Verdict
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.seams import CheckpointStore, Collective

if TYPE_CHECKING:
    from policies import Decision, History
    from policies.plain import PolicyView
    from policies.schema import Policy

log = logging.getLogger("rollback_supervisor.session")

#: What rank 0 broadcasts when it only warned about the step's anomalies: every rank trains on.
WARNED = "warned"


@dataclass(frozen=True)
class RolledBack:
    """A rollback done in process: the state is `info`'s; the decision's skip and LR scale are still to apply."""

    info: CheckpointInfo
    decision: Decision


class InProcessRollback:
    """Decides each anomaly with the policy engine and carries out the rollbacks it can; keeps the history.

    `policy` may be a launch plan's view of it: the engine (pydantic, the schema) is imported at the first
    decision, never before.
    Not thread-safe: the training thread calls it.
    """

    def __init__(
        self,
        policy: Policy | PolicyView,
        history: History,
        failures: SaveFailures,
        reporter: EventReporter,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        replay: Replayer | None = None,
    ):
        self.policy, self.history = policy, history
        self._failures, self._reporter = failures, reporter
        self._clock, self._monotonic = clock, monotonic
        self.count = 0
        #: The policy's `monitor.replay`: an anomaly may first be replayed from a memory snapshot.
        self.replay = replay or Replayer(ReplaySettings())

    def handle(self, store: CheckpointStore, event: Event, step: int) -> RolledBack | None:
        """Roll back for `event` if the policy says so and the target is here; None: reported, not handled."""
        from policies.engine import decide
        from policies.plain import as_model
        from policies.records import to_records

        known = self.known(store, step)
        decision = decide(
            as_model(self.policy), event, self.history, to_records(known), now=self._clock(), in_process=True
        )
        log.warning("in-process anomaly: %s -> %s", event.reason, decision.reason)
        if decision.action != "rollback" or decision.target_id is None:
            self._reporter.anomaly(event, decision, handled=False)
            return None
        t0 = self._monotonic()
        target = next(i for i in known if i.id == decision.target_id)
        store.protect([target.id])  # retention on the writer thread must not delete it meanwhile
        try:
            info, in_ring = self._restore_target(store, target, step)
            self._failures.despite(step, store.abandon_after, info, wait=False)
        finally:
            store.unprotect([target.id])
        self.history = self.history.record(event, decision, self._clock())
        self.count += 1
        self._reporter.anomaly(
            event,
            decision,
            handled=True,
            restore_s=self._monotonic() - t0,
            tier="memory" if in_ring else "local",
        )
        return RolledBack(info, decision)

    def warn(self, events: list[Event], step: int, dist: Collective | None = None) -> list[Event] | None:
        """Decide, record and report the anomalies the policy only warns about; the others, still to decide.

        None: nothing is left to decide, and training goes on (on every rank). Under DDP rank 0 alone holds
        the step's anomalies (`events` is [] elsewhere): it decides and broadcasts whether every rank trains
        on, so every rank calls this at the same point (collective); a failure on rank 0 is raised everywhere.
        """
        if dist is None:
            return [e for e in events if not self._warned(e, step)] or None
        if not dist.is_writer:
            return None if dist.broadcast_outcome(None) == WARNED else events
        try:
            left = [e for e in events if not self._warned(e, step)]
        except Exception as exc:
            dist.broadcast_outcome(None, exc)
            raise
        dist.broadcast_outcome(None if left else WARNED)
        return left or None

    def _warned(self, event: Event, step: int) -> bool:
        """If the policy's rule for `event` says warn: decide, record and report it; True then."""
        match = self.policy.rule_for(event.type)
        if match is None or match[1].action != "warn":
            return False
        from policies.engine import decide
        from policies.plain import as_model

        decision = decide(as_model(self.policy), event, self.history, [], now=self._clock(), in_process=True)
        log.warning("in-process anomaly at step %d: %s -> %s", step, event.reason, decision.reason)
        self.history = self.history.record(event, decision, self._clock())
        self._reporter.anomaly(event, decision, handled=True)
        return True

    def known(self, store: CheckpointStore, step: int) -> list[CheckpointInfo]:
        """The checkpoints a decision may pick: writes in flight included, never waited for (ARCHITECTURE.md)."""
        return self._failures.despite(step, store.candidates)

    def restore_for_replay(self, store: CheckpointStore, target: CheckpointInfo, step: int) -> CheckpointInfo:
        """Back to the replay's snapshot (from the ring, else disk); every later checkpoint is abandoned, as for
        a rollback: the replayed steps write their own. Neither a decision nor a rollback of the policy's."""
        store.protect([target.id])
        try:
            info, _ = self._restore_target(store, target, step)
            self._failures.despite(step, store.abandon_after, info, wait=False)
        finally:
            store.unprotect([target.id])
        return info

    def report_replay(self, event: Event, verdict: Verdict, anomaly: Event) -> None:
        """A replay's verdict, with its event (a `hardware_fault`, or the anomaly itself) and the anomaly it
        replayed (so the supervisor's monitor, seeing the first run's value, knows it was handled): a report
        kept with the segment, not a decision (the rule's decision, if one follows, is reported as usual)."""
        self._reporter.append(
            {
                "kind": "replay",
                "handled_in_process": True,
                "event": event.to_dict(),
                "anomaly": anomaly.to_dict(),
                "decision": None,
                "replay": verdict.to_dict(),
            }
        )

    def left_to_supervisor(self, event: Event) -> None:
        """Report an anomaly this process does not decide (under DDP every one): the supervisor does."""
        self._reporter.anomaly(event, None, handled=False)

    def _restore_target(
        self, store: CheckpointStore, target: CheckpointInfo, step: int
    ) -> tuple[CheckpointInfo, bool]:
        """From the memory ring without waiting for writes; from disk if the ring no longer holds it."""
        if "memory" in target.tiers:
            try:
                return self._failures.despite(step, store.restore_memory, target, wait=False), True
            except CheckpointNotFound:  # committed and dropped from the ring since it was listed
                pass
        return self._failures.despite(step, store.restore, target), False
