"""Drive one lineage: launch a segment, watch it, stop it, decide, relaunch. Prefect-free; flows/ wraps it.

A LineageRunner owns the lease, the durable record and the MLflow run of one lineage. It is not thread-safe:
one flow drives it. Its verbs map one-to-one onto the flow's tasks: `open`, `run_segment`, `conclude`, `finish`.
From `open` to `close` a LeaseKeeper thread renews the lease, so every wait (the watch, the backoff delay,
deciding, reporting) holds it; each launch and each record write first checks that it still does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from policies import Decision, History, decide, load_policy
from supervisor import exitcodes
from supervisor.checkpoint import open_store
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.view import MergedCatalog
from supervisor.command import default_lineage as default_lineage  # re-exported for the flow
from supervisor.command import python_command as python_command
from supervisor.errors import LeaseHeldError
from supervisor.events import METRIC_EVENTS, Event
from supervisor.launcher import ExitInfo, Segment
from supervisor.layout import LineageLayout
from supervisor.lineage import Lease, LeaseKeeper, LineageStore
from supervisor.monitor import HeartbeatReader, Monitor, classify_exit
from supervisor.monitor.shipper import SpoolShipper, ship_leftovers
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
from supervisor.runtime.wiring import to_records
from supervisor.tracking import (
    adopt_tracking,
    bound_http_requests,
    creating_store,
    default_tracking_uri,
    start_run,
)
from supervisor.tracking import artifact_location as artifact_location  # re-exported for the training side

log = logging.getLogger("rollback_supervisor.orchestrator")


@dataclass(frozen=True)
class RunOptions:
    """What one supervised run needs; the CLI and the flow build it from their arguments."""

    command: tuple[str, ...]
    policy_path: str
    lineage: str
    workdir: Path = Path(".rollback")
    tracking_uri: str | None = None
    experiment: str = "rollback-supervisor"
    stop_grace_seconds: float = 30.0
    lease_ttl_seconds: float = 60.0
    lease_wait_seconds: float = 0.0
    max_segments: int = 1000
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    lease_owner: str = ""  #: adopt a lease this process already took (the CLI takes it before Prefect starts)


@dataclass
class SegmentResult:
    """How one segment went: its exit, the event we stopped it for, and what it reported itself."""

    index: int
    exit: ExitInfo
    stopped_for: Event | None
    started: float
    ended: float
    last_step: int | None


class LineageRunner:
    """The supervisor of one lineage (see module docstring)."""

    def __init__(self, options: RunOptions, *, clock: Callable[[], float] = time.time, sleep=time.sleep):
        self.options = options
        self.clock, self.sleep = clock, sleep
        self.policy = load_policy(options.policy_path)
        ck = self.policy.checkpoint
        self.layout = LineageLayout.resolve(options.workdir, ck.storage, options.lineage, ck.remote)
        self.layout.local.mkdir(parents=True, exist_ok=True)
        (self.layout.local / "segments").mkdir(exist_ok=True)
        self.spool_dir = self.layout.local / "metrics"
        self.store = LineageStore(self.layout.durable)
        self.local_store = (
            LineageStore(str(self.layout.local)) if self.layout.durable != str(self.layout.local) else None
        )
        self.lease = Lease(
            self.layout.durable, ttl_seconds=options.lease_ttl_seconds, owner=options.lease_owner, clock=clock
        )
        self.keeper: LeaseKeeper | None = None
        self.tracking_uri = options.tracking_uri or default_tracking_uri(Path(options.workdir))
        bound_http_requests()
        self.client: MlflowClient | None = None  # opened only under the lease (see open)
        self.record: dict[str, Any] = {}
        self.history = History()
        self.pending: Decision | None = None

    # -- open / close -------------------------------------------------------------------------

    def open(self) -> dict[str, Any]:
        """Take the lease, then load the lineage record (resuming it) or create it.

        If anything fails after the lease is taken, the lease is released before the error propagates.
        """
        self.lease.acquire(self.options.lease_wait_seconds)
        self.keeper = LeaseKeeper(self.lease).start()
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> dict[str, Any]:
        record = self.store.load() or (self.local_store.load() if self.local_store else None)
        recorded = (record or {}).get("lease_token", 0)
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            self.lease.advance(recorded)  # a lease file lost meanwhile restarted its tokens low
        if record is None:
            # The tracking store is opened (and, on a fresh workdir, created) only under the lease, and its
            # creation is serialised across lineages sharing the workdir's sqlite file.
            with creating_store(self.tracking_uri):
                self.client = MlflowClient(tracking_uri=self.tracking_uri)
                record = self._new_record()
            log.info("lineage %s: new", self.options.lineage)
        else:
            log.info(
                "lineage %s: resuming after %d segments (status %s)",
                self.options.lineage, len(record["segments"]), record["status"],
            )  # fmt: skip
            self._recover_interrupted(record)
            with creating_store(
                self.options.tracking_uri or default_tracking_uri(Path(self.options.workdir))
            ):
                self.tracking_uri, self.client = adopt_tracking(
                    record, self.options.tracking_uri, Path(self.options.workdir), self.policy.name
                )
            record["storage"] = self._storage()  # this machine's paths (the lineage may have moved here)
            record["status"] = "running"
            record["final_reason"] = None
        record["command"] = list(self.options.command)
        record["policy"] = {"path": str(self.options.policy_path), "name": self.policy.name}
        if not (self.layout.local / "events.jsonl").exists():
            # The offset indexes this machine's events.jsonl; a lineage that moved here starts a new file.
            record["events_consumed"] = 0
            record["events_offset"] = 0
        elif "events_offset" not in record:  # a record from before byte offsets counted lines
            record["events_offset"] = _line_offset(
                self.layout.local / "events.jsonl", record["events_consumed"]
            )
        self.record = record
        ship_leftovers(self.client, record["mlflow"]["run_id"], self.spool_dir)
        self.history = History.from_dict(record["history"]) if record["history"] else History()
        self.pending = self._decide_interrupted()
        self._save()
        return record

    def _decide_interrupted(self) -> Decision | None:
        """A segment whose supervisor vanished is a preemption like any other: it spends restart budget."""
        pending = None
        for seg in self.record["segments"]:
            if seg.get("outcome") != "interrupted" or seg.get("decision") is not None:
                continue
            self._merge_reported(seg)
            event = Event.from_dict(seg["event"])
            pending = self._apply(seg, event)
        return pending

    def _new_record(self) -> dict[str, Any]:
        run_id = start_run(
            self.client, self.options.experiment, self.options.lineage, self.policy.name, self.options.workdir
        )
        now = self.clock()
        return {
            "version": 1,
            "lineage": self.options.lineage,
            "created": now,
            "updated": now,
            "status": "running",
            "final_reason": None,
            "final_checkpoint": None,
            "command": list(self.options.command),
            "policy": {},
            "mlflow": {
                "tracking_uri": self.tracking_uri,
                "experiment": self.options.experiment,
                "run_id": run_id,
            },
            "storage": self._storage(),
            "history": {},
            "events_consumed": 0,
            "events_offset": 0,
            "next_restore": RestoreSpec().__dict__,
            "segments": [],
        }

    def _storage(self) -> dict[str, Any]:
        return {
            "checkpoints": str(self.layout.checkpoints),
            "remote": self.layout.remote,
            "durable": self.layout.durable,
        }

    def _recover_interrupted(self, record: dict[str, Any]) -> None:
        """A segment with no end belongs to a supervisor that died (spot loss): resume from the newest valid."""
        for seg in record["segments"]:
            if seg.get("ended") is None:
                _kill_stale(seg, self.layout.local)
                seg["ended"] = self.clock()
                seg["outcome"] = "interrupted"
                seg["event"] = Event(
                    type="preemption",
                    reason="the previous supervisor of this lineage vanished mid-segment (machine lost)",
                    source="lineage",
                    evidence={"segment": seg["index"]},
                ).to_dict()
                record["next_restore"] = RestoreSpec().__dict__

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
            self.keeper = None
        self.lease.release()

    def _save(self) -> None:
        """Write the record, fenced by the lease: a supervisor that lost its lease writes nothing."""
        self.renew_lease()
        self.record["history"] = self.history.to_dict()
        self.record["updated"] = self.clock()
        self.store.save(self.record, fence=self.lease.token)
        if self.local_store:
            self.local_store.save(self.record, fence=self.lease.token)

    def renew_lease(self) -> None:
        """Raise LeaseHeldError if the lease was lost (the keeper thread renews it)."""
        if self.keeper is None:
            raise LeaseHeldError(f"lineage {self.options.lineage}: the lease is not held; call open() first")
        self.keeper.check()

    # -- one segment --------------------------------------------------------------------------

    def _plan(self, index: int) -> LaunchPlan:
        return LaunchPlan(
            lineage=self.options.lineage,
            workdir=str(self.layout.local),
            checkpoint_dir=str(self.layout.checkpoints),
            checkpoint_remote=self.layout.remote,
            tracking_uri=self.tracking_uri,
            experiment=self.options.experiment,
            run_id=self.record["mlflow"]["run_id"],
            segment=index,
            policy_path=str(Path(self.options.policy_path).resolve()),
            restore=RestoreSpec(**self.record["next_restore"]),
            history=self.history.to_dict(),
            supervisor_pid=os.getpid(),
            lineage_seconds=running_seconds(self.record["segments"]),
            metrics_spool=str(self.spool_dir / f"{index}.jsonl"),
        )

    def run_segment(self, on_line: Callable[[str, str], None] | None = None) -> SegmentResult:
        """Launch the next segment and watch it until it exits or an anomaly makes us stop it."""
        self.keeper_renew()  # never launch without the lease, and launch with a whole TTL ahead
        index = len(self.record["segments"])
        plan = self._plan(index)
        plan_path = plan.write(self.layout.local / f"plan-{index}.json")
        env = {**os.environ, **self.options.env, PLAN_ENV: str(plan_path), "PYTHONUNBUFFERED": "1"}
        start_step = _heartbeat_step(plan.heartbeat_path)
        seg_record = {
            "host": socket.gethostname(),
            "index": index,
            "started": self.clock(),
            "ended": None,
            "pid": None,
            "pid_started": None,
            "returncode": None,
            "signal_sent": None,
            "restore": plan.restore.__dict__,
            "start_step": start_step,
            "last_step": None,
            "outcome": None,
            "event": None,
            "decision": None,
            "in_process": [],
        }
        self.record["segments"].append(seg_record)
        self._save()
        with contextlib.ExitStack() as cleanup:
            logfile = cleanup.enter_context(open(self.layout.local / "segments" / f"{index}.log", "a"))  # noqa: SIM115

            def sink(stream: str, line: str) -> None:
                logfile.write(f"{stream}: {line}\n")
                logfile.flush()
                if on_line:
                    on_line(stream, line)

            # The training process appends its metrics to the spool; this ships them to the run (spool.py: why).
            shipper = SpoolShipper(self.client, plan.run_id, plan.metrics_spool).start()
            cleanup.callback(shipper.drain)  # runs after the child is gone: all it logged reaches MLflow
            started = self.clock()
            segment = Segment(self.options.command, env=env, cwd=self.options.cwd, on_line=sink)
            # Whatever fails below (the monitor, the record, a lost lease), the child is stopped and reaped.
            cleanup.callback(segment.wait)
            cleanup.callback(_stop_if_running, segment, self.options.stop_grace_seconds)
            seg_record["pid"] = segment.pid
            seg_record["pid_started"] = _process_started(segment.pid)
            self._save()
            log.info("segment %d: pid %d, %s", index, segment.pid, describe_restore(plan.restore))
            monitor = Monitor.from_specs(
                self.tracking_uri,
                plan.run_id,
                self.policy.monitor.detectors,
                heartbeat_path=plan.heartbeat_path,
                report_history=False,
                request_timeout=5.0,
            )
            cleanup.callback(monitor.close)
            monitor.detectors.progress(self.clock(), phase="checkpoint")  # start-up and restore: long grace
            if monitor.heartbeat is not None:
                monitor.heartbeat.changed()  # the previous segment's last beat is not this one's progress
            stopped_for = None
            try:
                while segment.poll() is None:
                    stopped_for = self._watch_once(monitor)
                    if stopped_for is not None:
                        log.warning("segment %d: %s; stopping it", index, stopped_for.reason)
                        segment.stop(self.options.stop_grace_seconds, sig=signal.SIGUSR2)
                        break
                    self.renew_lease()
                    try:
                        segment.proc.wait(self.policy.monitor.poll_seconds)
                    except subprocess.TimeoutExpired:  # still running
                        pass
            except BaseException as exc:
                # The supervisor itself is going away (SIGTERM on a spot machine, Ctrl-C, a lost lease): let
                # the training save its emergency checkpoint, record that, and let the next run resume.
                segment.stop(self.options.stop_grace_seconds, sig=signal.SIGTERM)
                exit_info = segment.wait()
                seg_record.update(
                    ended=self.clock(),
                    returncode=exit_info.returncode,
                    outcome="interrupted",
                    signal_sent=exit_info.signal_sent,
                    last_step=_heartbeat_step(plan.heartbeat_path),
                    event=Event(
                        type="preemption",
                        reason="the supervisor was interrupted; training stopped with an emergency checkpoint",
                        source="supervisor",
                        evidence={"returncode": exit_info.returncode},
                    ).to_dict(),
                )
                self.record["next_restore"] = RestoreSpec().__dict__
                if not isinstance(exc, LeaseHeldError):  # a stale holder must not write the record
                    self._save()
                raise
        exit_info = segment.wait()
        return SegmentResult(
            index, exit_info, stopped_for, started, self.clock(), _heartbeat_step(plan.heartbeat_path)
        )

    def keeper_renew(self) -> None:
        """Renew the lease now (a launch gets a whole TTL ahead); raise LeaseHeldError if it was lost."""
        self.renew_lease()
        assert self.keeper is not None
        self.keeper.renew_now()

    def _watch_once(self, monitor: Monitor) -> Event | None:
        for event in monitor.poll(self.clock()):
            if event.type in METRIC_EVENTS and self._handled_in_process(event):
                log.info("monitor saw %s; the training process already handled it", event.reason)
                continue
            return event
        return None

    def _handled_in_process(self, event: Event, wait_s: float = 2.0) -> bool:
        """Whether the training process already reported this incident in the current segment.

        One incident can show on several metrics and detectors at one step (a spike on the loss and the grad
        norm over its threshold; NaN gradients make the loss NaN too): any metric event with the same onset
        (within a tolerance) is the same incident, whatever its type or metric, and gets one decision.
        """
        deadline = time.monotonic() + wait_s
        while True:
            records, _ = self._events_since(self.record["events_offset"])
            if any(_same_incident(Event.from_dict(rec["event"]), event) for rec in records):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)

    def _events_since(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Complete records of events.jsonl after byte `offset`, and the offset after the last one.

        Read the way the spool is read: a line cut by a kill is left for later, and a malformed line is
        skipped with a warning (its bytes still count), so the offset never drifts and nothing raises.
        """
        path = self.layout.local / "events.jsonl"
        try:
            with path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        records = []
        for line in data.split(b"\n")[:-1]:  # the last piece has no newline yet
            offset += len(line) + 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                Event.from_dict(rec["event"])
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("%s: skipping a malformed line (%s): %r", path, exc, line[:200])
                continue
            records.append(rec)
        return records, offset

    # -- deciding -----------------------------------------------------------------------------

    def conclude(self, result: SegmentResult) -> Decision | None:
        """Record what happened in the segment and decide what next; None means the run finished or stopped."""
        seg = self.record["segments"][result.index]
        seg.update(
            ended=result.ended, returncode=result.exit.returncode, signal_sent=result.exit.signal_sent,
            last_step=result.last_step,
        )  # fmt: skip
        reported = self._merge_reported(seg)
        event = result.stopped_for or reported
        if event is None:
            event = classify_exit(
                result.exit.returncode,
                result.exit.stderr_tail,
                signal_sent_by_us=result.exit.signal_sent,
                extra_patterns=[p.model_dump() for p in self.policy.monitor.classifier_patterns],
            )
        seg["event"] = event.to_dict() if event else None
        if event is None:
            code = result.exit.returncode
            seg["outcome"] = "finished" if code == exitcodes.EXIT_OK else "stopped"
            self._save()
            return None
        return self._apply(seg, event)

    def _merge_reported(self, seg: dict[str, Any]) -> Event | None:
        """Fold the training side's events.jsonl into the history; returns an anomaly it left to us.

        A left-over anomaly at the onset of one the training process handled in this segment is part of
        that incident: it is recorded with it and gets no second decision.
        """
        reported = None
        handled: list[Event] = []
        records, offset = self._events_since(self.record["events_offset"])
        for rec in records:
            event = Event.from_dict(rec["event"])
            if rec.get("kind") == "save_failed":  # a report, not an anomaly: training went on without it
                seg.setdefault("save_failures", []).append(rec)
                log.warning("segment %d: %s", seg["index"], event.reason)
            elif rec.get("handled_in_process") and rec.get("decision"):
                decision = Decision.from_dict(rec["decision"])
                self.history.record(decision.event, decision, rec["time"])
                seg["in_process"].append(rec)
                handled.append(event)
                self._tag_decision(decision, in_process=True)
            elif any(_same_incident(h, event) for h in handled):
                seg["in_process"].append({**rec, "part_of_incident": True})
                log.info("%s is part of an incident the training process already handled", event.reason)
            else:
                reported = event
        if reported is not None and any(_same_incident(h, reported) for h in handled):
            reported = None
        self.record["events_consumed"] += len(records)
        self.record["events_offset"] = offset
        return reported

    def _apply(self, seg: dict[str, Any], event: Event) -> Decision:
        """Decide about the event that ended `seg`, record it, and set the next segment's restore."""
        decision = self._decide(event)
        seg["decision"] = decision.to_dict()
        if seg.get("outcome") != "interrupted":
            seg["outcome"] = decision.action
        self.history.record(event, decision, self.clock())
        if decision.relaunches:
            self.record["next_restore"] = RestoreSpec(
                checkpoint_id=decision.target_id,
                skip_batches=decision.skip_batches,
                lr_scale=decision.lr_scale,
                from_scratch=decision.target_id is None,
                rollback=decision.action == "rollback",
            ).__dict__
        self._save()
        self._tag_decision(decision, in_process=False)
        log.warning("decision: %s", decision.reason)
        return decision

    def _decide(self, event: Event) -> Decision:
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

    def catalog(self) -> MergedCatalog | None:
        """The checkpoints of both tiers in one view, the same merge the training side restores through."""
        catalogs = []
        if self.layout.checkpoints.exists() and any(self.layout.checkpoints.iterdir()):
            catalogs.append(open_store(self.layout.checkpoints))
        if self.layout.remote:
            try:
                remote = RemoteTier(self.layout.remote).catalog  # the same catalog the training side merges
                remote.ids()  # reachable?
                catalogs.append(remote)
            except Exception as exc:  # an empty or unreachable remote has nothing to offer yet
                log.warning("remote checkpoint store %s unavailable: %s", self.layout.remote, exc)
        allow = self.policy.checkpoint.allow_nonfinite
        return MergedCatalog(catalogs, allow_nonfinite=allow) if catalogs else None

    def _tag_decision(self, decision: Decision, *, in_process: bool) -> None:
        n = len(self.history) - 1  # the same 0-based numbering as the final report
        text = f"{'[in-process] ' if in_process else ''}{decision.action}: {decision.reason}"[:4900]
        try:
            self.client.set_tag(self.record["mlflow"]["run_id"], f"rollback.decision.{n:03d}", text)
        except Exception as exc:  # the tracking server being down must not stop recovery
            log.warning("could not tag the MLflow run: %s", exc)

    # -- finishing ----------------------------------------------------------------------------

    def finish(self, status: str, reason: str) -> dict[str, Any]:
        """Record the final status, the checkpoint to keep, and close the MLflow run."""
        catalog = self.catalog()
        final = None
        if catalog is not None:
            keep_best = self.policy.checkpoint.keep_best
            if status == "finished" or keep_best is None:
                final = catalog.latest()
            else:
                final = catalog.best(keep_best.metric, keep_best.mode) or catalog.latest()
        self.record.update(status=status, final_reason=reason, final_checkpoint=final.id if final else None)
        self._save()
        run_id = self.record["mlflow"]["run_id"]
        try:
            self.client.set_terminated(
                run_id, status={"finished": "FINISHED", "stopped": "FINISHED"}.get(status, "FAILED")
            )
        except Exception as exc:
            log.warning("could not close the MLflow run: %s", exc)
        return self.record


def running_seconds(segments: list[dict[str, Any]]) -> float:
    """How long the lineage's finished segments ran: its age for the failure rate, idle time left out."""
    return sum(max(0.0, s["ended"] - s["started"]) for s in segments if s.get("ended") is not None)


def _same_incident(a: Event, b: Event) -> bool:
    """Two metric events with (nearly) one onset are one incident, whatever their type or metric."""
    return a.type in METRIC_EVENTS and b.type in METRIC_EVENTS and _same_onset(a, b)


def _same_onset(a: Event, b: Event, tolerance: int = 2) -> bool:
    """Both sides run the same detectors on the same points, so one anomaly has (nearly) one onset."""
    if a.onset_step is None or b.onset_step is None:
        return True
    return abs(a.onset_step - b.onset_step) <= tolerance


def _kill_stale(seg: dict[str, Any], plan_dir: Path) -> None:
    """Kill a training process group left running by a supervisor that died on this same host.

    Only the very process the segment started (see `_is_segment_process`): a PID reused since by an unrelated
    process is left alone.
    """
    pid, started = seg.get("pid"), seg.get("pid_started")
    if not pid or seg.get("host") != socket.gethostname():
        return
    if not _is_segment_process(pid, started, plan_dir):
        log.info("segment %d: pid %d is gone or was reused; nothing to kill", seg["index"], pid)
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            log.warning("killed stale training process group %d of segment %d", pid, seg["index"])
    except (ProcessLookupError, PermissionError):
        pass


def _is_segment_process(pid: int, started: float | None, plan_dir: Path) -> bool:
    """Whether `pid` is still the training process a segment of this lineage started.

    Its start time must match the recorded one within a second (psutil derives it from the boot time, which
    can move by about that much when the clock is adjusted), and where its environment is readable it must
    carry a launch plan from this lineage's directory. A record from before start times were kept is judged
    by the environment alone.
    """
    import psutil

    now = _process_started(pid)
    if now is None or (started is not None and abs(now - started) > 1.0):
        return False
    try:
        plan = psutil.Process(pid).environ().get(PLAN_ENV)
    except psutil.Error:
        return started is not None
    return plan is not None and Path(plan).parent == plan_dir


def _process_started(pid: int) -> float | None:
    """The process's start time (identifies it across PID reuse), or None if it is gone."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _stop_if_running(segment: Segment, grace: float) -> None:
    if segment.poll() is None:
        segment.stop(grace, sig=signal.SIGTERM)


def describe_restore(spec: RestoreSpec) -> str:
    """A restore spec in words, for the log."""
    if spec.from_scratch:
        return "starts from scratch"
    where = f"checkpoint {spec.checkpoint_id}" if spec.checkpoint_id else "the newest valid checkpoint"
    kind = "rolls back to" if spec.rollback else "starts from"
    return f"{kind} {where} (skip {spec.skip_batches}, lr x{spec.lr_scale:g})"


def _line_offset(path: Path, lines: int) -> int:
    """The byte offset just after the first `lines` lines of `path` (records that counted lines)."""
    offset = 0
    with path.open("rb") as f:
        for _ in range(lines):
            line = f.readline()
            if not line.endswith(b"\n"):
                break
            offset += len(line)
    return offset


def _heartbeat_step(path: Path) -> int | None:
    beat = HeartbeatReader(path).read()
    return beat.step if beat else None
