"""Drive one lineage: launch a segment, watch it, stop it, decide, relaunch. Prefect-free; flows/ wraps it.

A LineageRunner owns the lease, the durable record and the MLflow run of one lineage. It is not thread-safe:
one flow drives it. Its verbs map one-to-one onto the flow's tasks: `open`, `run_segment`, `conclude`, `finish`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from policies import Decision, History, decide, load_policy
from supervisor import exitcodes
from supervisor.checkpoint import open_store
from supervisor.events import METRIC_EVENTS, Event
from supervisor.launcher import ExitInfo, Segment
from supervisor.layout import LineageLayout
from supervisor.lineage import Lease, LineageStore
from supervisor.monitor import HeartbeatReader, Monitor, classify_exit
from supervisor.monitor.shipper import SpoolShipper, ship_leftovers
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
from supervisor.runtime.wiring import to_records
from supervisor.tracking import adopt_tracking, bound_http_requests, default_tracking_uri, start_run
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
        self.lease = Lease(self.layout.durable, ttl_seconds=options.lease_ttl_seconds, clock=clock)
        self.tracking_uri = options.tracking_uri or default_tracking_uri(Path(options.workdir))
        bound_http_requests()
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.record: dict[str, Any] = {}
        self.history = History()
        self.pending: Decision | None = None
        self._last_renew = 0.0

    # -- open / close -------------------------------------------------------------------------

    def open(self) -> dict[str, Any]:
        """Take the lease, then load the lineage record (resuming it) or create it."""
        self.lease.acquire(self.options.lease_wait_seconds)
        self._last_renew = self.clock()
        record = self.store.load() or (self.local_store.load() if self.local_store else None)
        if record is None:
            record = self._new_record()
            log.info("lineage %s: new", self.options.lineage)
        else:
            log.info(
                "lineage %s: resuming after %d segments (status %s)",
                self.options.lineage, len(record["segments"]), record["status"],
            )  # fmt: skip
            self._recover_interrupted(record)
            self.tracking_uri, self.client = adopt_tracking(
                record, self.options.tracking_uri, Path(self.options.workdir), self.policy.name
            )
            record["storage"] = self._storage()  # this machine's paths (the lineage may have moved here)
            record["status"] = "running"
            record["final_reason"] = None
        record["command"] = list(self.options.command)
        record["policy"] = {"path": str(self.options.policy_path), "name": self.policy.name}
        if not (self.layout.local / "events.jsonl").exists():
            # The count indexes this machine's events.jsonl; a lineage that moved here starts a new file.
            record["events_consumed"] = 0
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
                _kill_stale(seg)
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
        self.lease.release()

    def _save(self) -> None:
        self.record["history"] = self.history.to_dict()
        self.record["updated"] = self.clock()
        self.store.save(self.record)
        if self.local_store:
            self.local_store.save(self.record)

    def renew_lease(self) -> None:
        if self.clock() - self._last_renew >= self.options.lease_ttl_seconds / 3:
            self.lease.renew()
            self._last_renew = self.clock()

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
        index = len(self.record["segments"])
        plan = self._plan(index)
        plan_path = plan.write(self.layout.local / f"plan-{index}.json")
        env = {**os.environ, **self.options.env, PLAN_ENV: str(plan_path), "PYTHONUNBUFFERED": "1"}
        start_step = _heartbeat_step(plan.heartbeat_path)
        seg_record = {
            "host": socket.gethostname(), "index": index, "started": self.clock(), "ended": None, "pid": None, "returncode": None,
            "signal_sent": None, "restore": plan.restore.__dict__, "start_step": start_step, "last_step": None,
            "outcome": None, "event": None, "decision": None, "in_process": [],
        }  # fmt: skip
        self.record["segments"].append(seg_record)
        self._save()
        logfile = open(self.layout.local / "segments" / f"{index}.log", "a")  # noqa: SIM115

        def sink(stream: str, line: str) -> None:
            logfile.write(f"{stream}: {line}\n")
            logfile.flush()
            if on_line:
                on_line(stream, line)

        started = self.clock()
        segment = Segment(self.options.command, env=env, cwd=self.options.cwd, on_line=sink)
        # The training process appends its metrics to the spool; this ships them to the run (spool.py: why).
        shipper = SpoolShipper(self.client, plan.run_id, plan.metrics_spool).start()
        seg_record["pid"] = segment.pid
        self._save()
        log.info("segment %d: pid %d, restore %s", index, segment.pid, plan.restore)
        monitor = Monitor.from_specs(
            self.tracking_uri,
            plan.run_id,
            self.policy.monitor.detectors,
            heartbeat_path=plan.heartbeat_path,
            report_history=False,
            request_timeout=5.0,
        )
        monitor.detectors.progress(
            self.clock(), phase="checkpoint"
        )  # start-up and restore get the long grace
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
        except BaseException:
            # The supervisor itself is going away (SIGTERM on a spot machine, Ctrl-C): let the training save
            # its emergency checkpoint, record that, and let the next flow run resume the lineage.
            segment.stop(self.options.stop_grace_seconds, sig=signal.SIGTERM)
            exit_info = segment.wait()
            seg_record.update(
                ended=self.clock(), returncode=exit_info.returncode, outcome="interrupted",
                signal_sent=exit_info.signal_sent,
                last_step=_heartbeat_step(plan.heartbeat_path),
                event=Event(type="preemption", reason="the supervisor was interrupted; training stopped with an "
                            "emergency checkpoint", source="supervisor",
                            evidence={"returncode": exit_info.returncode}).to_dict(),
            )  # fmt: skip
            self.record["next_restore"] = RestoreSpec().__dict__
            self._save()
            raise
        finally:
            monitor.close()
            exit_info = segment.wait()
            logfile.close()
            shipper.drain()  # everything the segment logged is in MLflow before anyone decides or reports
        return SegmentResult(
            index, exit_info, stopped_for, started, self.clock(), _heartbeat_step(plan.heartbeat_path)
        )

    def _watch_once(self, monitor: Monitor) -> Event | None:
        for event in monitor.poll(self.clock()):
            if event.type in METRIC_EVENTS and self._handled_in_process(event):
                log.info("monitor saw %s; the training process already handled it", event.reason)
                continue
            return event
        return None

    def _handled_in_process(self, event: Event, wait_s: float = 2.0) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            for rec in self._events_since(self.record["events_consumed"]):
                seen = Event.from_dict(rec["event"])
                # Any metric: one anomaly can show on several at one step (NaN gradients make the loss and the
                # grad norm NaN), and the training process handles and reports the first it sees.
                if seen.type == event.type and _same_onset(seen, event):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.25)

    def _events_since(self, consumed: int) -> list[dict[str, Any]]:
        path = self.layout.local / "events.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        return [json.loads(line) for line in lines[consumed:] if line.strip()]

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
        """Fold the training side's events.jsonl into the history; returns an anomaly it left to us."""
        reported = None
        records = self._events_since(self.record["events_consumed"])
        for rec in records:
            if rec.get("handled_in_process") and rec.get("decision"):
                decision = Decision.from_dict(rec["decision"])
                self.history.record(decision.event, decision, rec["time"])
                seg["in_process"].append(rec)
                self._tag_decision(decision, in_process=True)
            else:
                reported = Event.from_dict(rec["event"])
        self.record["events_consumed"] += len(records)
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

    def catalog(self):
        if self.layout.checkpoints.exists() and any(self.layout.checkpoints.iterdir()):
            return open_store(self.layout.checkpoints)
        if self.layout.remote:
            try:
                return open_store(self.layout.remote)
            except Exception as exc:  # an empty or unreachable remote has nothing to offer yet
                log.warning("remote checkpoint store %s unavailable: %s", self.layout.remote, exc)
        return None

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


def _same_onset(a: Event, b: Event, tolerance: int = 2) -> bool:
    """Both sides run the same detectors on the same points, so one anomaly has (nearly) one onset."""
    if a.onset_step is None or b.onset_step is None:
        return True
    return abs(a.onset_step - b.onset_step) <= tolerance


def _kill_stale(seg: dict[str, Any]) -> None:
    """Kill a training process group left running by a supervisor that died on this same host."""
    pid = seg.get("pid")
    if not pid or seg.get("host") != socket.gethostname():
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            log.warning("killed stale training process group %d of segment %d", pid, seg["index"])
    except (ProcessLookupError, PermissionError):
        pass


def _heartbeat_step(path: Path) -> int | None:
    beat = HeartbeatReader(path).read()
    return beat.step if beat else None


def default_lineage(command: tuple[str, ...]) -> str:
    """A lineage name from the script name: `charlm` for `python examples/charlm.py ...`."""
    for arg in command:
        if arg.endswith(".py"):
            return Path(arg).stem
    return Path(command[0]).name if command else "run"


def python_command(command: list[str]) -> tuple[str, ...]:
    """Run `python x.py` with this interpreter, so the training sees the same environment."""
    if command and command[0] in ("python", "python3"):
        return (sys.executable, *command[1:])
    return tuple(command)
