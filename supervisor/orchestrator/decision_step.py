"""The decision step: how a segment ended, what the policy says to do about it, and recording that.

It classifies the end (the event we stopped the segment for, an anomaly the training process left to us, or
its exit code and stderr), decides, re-deciding while the chosen checkpoint fails full verification, applies
the decision to the lineage record (the next segment's restore), tags the MLflow run, and picks the final
checkpoint when the lineage ends. Not thread-safe; the runner's thread only.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any, Protocol

from policies import Decision, History, decide
from policies.records import to_records
from supervisor import exitcodes
from supervisor.checkpoint.view import MergedCatalog
from supervisor.events import Event
from supervisor.lineage.exclusions import HostPool, admit, blames, exclusions_from
from supervisor.lineage.record import LineageRecord, SegmentRecord
from supervisor.monitor import classify_exit
from supervisor.orchestrator.events_log import EventsLog, same_incident
from supervisor.orchestrator.options import SegmentResult
from supervisor.runtime.plan import RestoreSpec

log = logging.getLogger("rollback_supervisor.orchestrator")

#: `ExitInfo.cause` of a segment stopped from outside the supervisor (e.g. `scancel`): the lineage ends stopped.
OUTSIDE_STOP = "stop"

#: MLflow rejects tag values much longer than this.
MAX_TAG_CHARS = 4900
#: The MLflow run status a lineage's final status closes it with.
RUN_STATUS = {"finished": "FINISHED", "stopped": "FINISHED"}


class RunTracking(Protocol):
    """The lineage's MLflow run as the decision step writes to it; failures are logged, never raised."""

    def tag(self, key: str, text: str) -> None: ...

    def terminate(self, status: str) -> None: ...


class MlflowRun:
    """Tags and closes one MLflow run; the tracking server being down must not stop recovery."""

    def __init__(self, client: Any, run_id: str):
        self.client = client
        self.run_id = run_id

    def tag(self, key: str, text: str) -> None:
        try:
            self.client.set_tag(self.run_id, key, text)
        except Exception as exc:
            log.warning("could not tag the MLflow run: %s", exc)

    def terminate(self, status: str) -> None:
        try:
            self.client.set_terminated(self.run_id, status=status)
        except Exception as exc:
            log.warning("could not close the MLflow run: %s", exc)


class DecisionStep:
    """Turns the end of a segment into a decision recorded in the lineage record and the MLflow run."""

    def __init__(
        self,
        policy: Any,
        *,
        history: History,
        events: EventsLog,
        catalog: Callable[[], MergedCatalog | None],
        run: RunTracking,
        save: Callable[[], None],
        clock: Callable[[], float],
        host_pool: Callable[[], HostPool] | None = None,
    ):
        self.policy = policy
        self.history = history
        self.events = events
        self.catalog = catalog
        self.run = run
        self.save = save
        self.clock = clock
        #: What the launcher can place a segment on, asked only when an event blames a host; None: this
        #: machine alone (the local launcher), which is never excluded.
        self.host_pool = host_pool or this_machine

    def conclude(self, record: LineageRecord, result: SegmentResult) -> Decision | None:
        """Record how the segment ended and decide what next; None means the run finished or stopped."""
        seg = record.segments[result.index]
        seg.ended = result.ended
        seg.returncode = result.exit.returncode
        seg.signal_sent = result.exit.signal_sent
        seg.last_step = result.last_step
        if result.exit.hosts:
            seg.put(hosts=list(result.exit.hosts))
        reported = self.fold_reports(record, seg)
        event = result.stopped_for or reported or self.classify(result)
        seg.event = event.to_dict() if event else None
        # A scheduler's cancel from outside (scancel): stopped, nothing to decide.
        if event is not None and event.type == OUTSIDE_STOP:
            seg.outcome = "stopped"
            self.save()
            log.warning("segment %d: %s", seg.index, event.reason)
            return None
        if event is None:
            seg.outcome = "finished" if result.exit.returncode == exitcodes.EXIT_OK else "stopped"
            self.save()
            return None
        return self.apply(record, seg, event)

    def classify(self, result: SegmentResult) -> Event | None:
        """The event an exit says happened (exit code, stderr, our own signal); None for a clean end.

        A launcher's own verdict (`ExitInfo.cause`, e.g. a scheduler's PREEMPTED) comes first when it has one.
        """
        if result.exit.cause is not None:
            return Event(
                type=result.exit.cause,
                reason=f"the launcher reported {result.exit.cause} (exit code {result.exit.returncode})",
                source="launcher",
                evidence={
                    "returncode": result.exit.returncode,
                    "handle": result.exit.handle_id,
                    **result.exit.cause_evidence,
                },
            )
        return classify_exit(
            result.exit.returncode,
            result.exit.stderr_tail,
            signal_sent_by_us=result.exit.signal_sent,
            extra_patterns=[p.model_dump() for p in self.policy.monitor.classifier_patterns],
        )

    def decide_interrupted(self, record: LineageRecord) -> Decision | None:
        """A segment whose supervisor vanished is a preemption like any other: it spends restart budget."""
        pending = None
        for seg in record.segments:
            if seg.outcome != "interrupted" or seg.decision is not None:
                continue
            self.fold_reports(record, seg)
            pending = self.apply(record, seg, Event.from_dict(seg.event or {}))
        return pending

    def fold_reports(self, record: LineageRecord, seg: SegmentRecord) -> Event | None:
        """Fold the training side's new events.jsonl records into the history; returns an anomaly it left to us.

        A left-over anomaly at the onset of one the training process handled in this segment is part of
        that incident: it is recorded with it and gets no second decision.
        """
        records, offset = self.events.since(record.events_offset)
        reported = self.fold(seg, records)
        record.put(events_consumed=record.events_consumed + len(records), events_offset=offset)
        for rec in records:  # a replay mismatch names the hosts whose values parted; training went on
            if rec.get("kind") == "replay" and isinstance(rec.get("event"), dict):
                self.exclude(record, seg, Event.from_dict(rec["event"]), relaunches=False)
        return reported

    def fold(self, seg: SegmentRecord, records: list[dict[str, Any]]) -> Event | None:
        """`fold_reports` on records already read (see there)."""
        reported = None
        handled: list[Event] = []
        for rec in records:
            event = Event.from_dict(rec["event"])
            if rec.get("kind") == "save_failed":  # a report, not an anomaly: training went on without it
                seg.save_failures = [*(seg.save_failures or []), rec]
                log.warning("segment %d: %s", seg.index, event.reason)
            elif rec.get("kind") == "replay":  # a replay's verdict: kept with the segment, not a decision
                seg.in_process.append(rec)
                handled += [event, *([Event.from_dict(rec["anomaly"])] if rec.get("anomaly") else [])]
                verdict = rec.get("replay") or {}
                log.warning("segment %d: replay: %s", seg.index, verdict.get("reason", event.reason))
            elif rec.get("handled_in_process") and rec.get("decision"):
                decision = Decision.from_dict(rec["decision"])
                self.history.record(decision.event, decision, rec["time"])
                seg.in_process.append(rec)
                if decision.action != "warn":  # a warning handled nothing: training went on
                    handled.append(event)
                else:
                    log.warning("segment %d: %s", seg.index, decision.reason)
                self.tag(decision, in_process=True)
            elif any(same_incident(h, event) for h in handled):
                seg.in_process.append({**rec, "part_of_incident": True})
                log.info("%s is part of an incident the training process already handled", event.reason)
            else:
                reported = event
        if reported is not None and any(same_incident(h, reported) for h in handled):
            reported = None
        return reported

    def apply(self, record: LineageRecord, seg: SegmentRecord, event: Event) -> Decision:
        """Decide about the event that ended `seg`, record it, and set the next segment's restore."""
        decision = self.decide(event)
        seg.decision = decision.to_dict()
        if seg.outcome != "interrupted":
            seg.outcome = decision.action
        self.history.record(event, decision, self.clock())
        if decision.relaunches:
            record.next_restore = restore_after(decision).__dict__
        elif decision.action == "warn":  # the segment stopped for it anyway: go on from its newest state
            record.next_restore = RestoreSpec().__dict__
            log.warning(
                "segment %d stopped for %s, which the policy only warns about; the next segment resumes from "
                "the newest valid checkpoint (no budget spent)",
                seg.index,
                event.type,
            )
        self.exclude(record, seg, event, relaunches=decision.relaunches)
        self.save()
        self.tag(decision, in_process=False)
        log.warning("decision: %s", decision.reason)
        return decision

    def warn(self, seg: SegmentRecord, event: Event) -> bool:
        """If the policy only warns about `event`, seen while `seg` runs: decide and record that (the history,
        the segment's `warnings`, an MLflow tag, the log), and True: the segment runs on; no host is excluded."""
        match = self.policy.rule_for(event.type)
        if match is None or match[1].action != "warn":
            return False
        now = self.clock()
        decision = decide(self.policy, event, self.history, [], now=now)
        self.history.record(event, decision, now)
        entry = {"time": now, "event": event.to_dict(), "decision": decision.to_dict()}
        seg.put(warnings=[*(seg.warnings or []), entry])
        self.save()
        self.tag(decision, in_process=False)
        log.warning("segment %d: %s", seg.index, decision.reason)
        return True

    def exclude(self, record: LineageRecord, seg: SegmentRecord, event: Event, *, relaunches: bool) -> None:
        """Add the hosts `event` blames to the lineage's `excluded_hosts`, or to `not_excluded` saying why.

        The supervisor's own host counts as where the segment ran only when the launcher places segments there
        (the local launchers), never for a scheduler's job whose nodes are unknown.
        """
        if not blames(event, relaunches):
            return
        pool = self.host_pool()
        ran_on = seg.hosts or ([seg.host] if seg.host and seg.host in (pool.hosts or ()) else [])
        found = exclusions_from(event, ran_on, segment=seg.index, time=self.clock())
        if not found:
            log.warning("segment %d: %s names no host, and where it ran is unknown; nothing excluded",
                        seg.index, event.type)  # fmt: skip
        kept = {(e.get("host"), e.get("segment")) for e in record.not_excluded or []}
        for entry in admit(found, record.exclusions(), pool):
            if not entry.excluded and (entry.host, entry.segment) in kept:
                continue  # said once per segment (a replay's report and the decision on it name the same host)
            key = "excluded_hosts" if entry.excluded else "not_excluded"
            record.put(**{key: [*(getattr(record, key) or []), entry.to_dict()]})
            if entry.excluded:
                log.warning("segment %d: host %s excluded from the next launches (%s)",
                            seg.index, entry.host, entry.reason)  # fmt: skip
            else:
                log.warning(
                    "segment %d: host %s %s; the next launches may use it",
                    seg.index,
                    entry.host,
                    entry.reason,
                )

    def decide(self, event: Event) -> Decision:
        """Decide, re-deciding if the chosen checkpoint fails full verification (it is then marked invalid)."""
        catalog = self.catalog()
        infos = catalog.list() if catalog else []
        invalid = {i.id for i in infos if catalog.verify(i.id, "fast") is not None}
        while True:
            decision = decide(self.policy, event, self.history, to_records(infos, invalid), now=self.clock())
            if decision.target_id is None or not decision.relaunches:
                return decision
            reason = catalog.verify(decision.target_id, self.policy.checkpoint.verify)
            if reason is None:
                return decision
            log.warning("checkpoint %s failed verification (%s); choosing again", decision.target_id, reason)
            invalid.add(decision.target_id)

    def tag(self, decision: Decision, *, in_process: bool) -> None:
        """One MLflow tag per decision, numbered as the final report numbers them (0-based)."""
        n = len(self.history) - 1
        prefix = "[in-process] " if in_process else ""
        text = f"{prefix}{decision.action}: {decision.reason}"[:MAX_TAG_CHARS]
        self.run.tag(f"rollback.decision.{n:03d}", text)

    def finish(self, record: LineageRecord, status: str, reason: str) -> LineageRecord:
        """Record the final status and the checkpoint to keep, and close the MLflow run."""
        final = self.final_checkpoint(status)
        record.put(status=status, final_reason=reason, final_checkpoint=final)
        self.save()
        self.run.terminate(RUN_STATUS.get(status, "FAILED"))
        return record

    def final_checkpoint(self, status: str) -> str | None:
        """The newest checkpoint of a finished lineage; else the policy's best (`keep_best`), or the newest."""
        catalog = self.catalog()
        if catalog is None:
            return None
        keep_best = self.policy.checkpoint.keep_best
        if status == "finished" or keep_best is None:
            final = catalog.latest()
        else:
            final = catalog.best(keep_best.metric, keep_best.mode) or catalog.latest()
        return final.id if final else None


def this_machine() -> HostPool:
    """The pool of a launcher that runs every segment on the supervisor's machine."""
    return HostPool(1, (socket.gethostname(),), "the segments run on this machine only")


def restore_after(decision: Decision) -> RestoreSpec:
    """Where the segment after a relaunching decision starts."""
    return RestoreSpec(
        checkpoint_id=decision.target_id,
        skip_batches=decision.skip_batches,
        lr_scale=decision.lr_scale,
        from_scratch=decision.target_id is None,
        rollback=decision.action == "rollback",
    )
