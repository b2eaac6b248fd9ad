"""Drive one lineage: launch a segment, watch it, stop it, decide, relaunch. Prefect-free; flows/ wraps it.

A LineageRunner is the facade over three parts: the `LineageBook` (the durable record and its lease), a
`SegmentRun` per segment (launch, watch, stop) and the `DecisionStep` (classify, decide, apply, tag).
It is not thread-safe: one caller drives it, with `supervise()` or step by step with `open`, `run_segment`,
`conclude` and `finish`, then `close`. From `open` to `close` a keeper thread renews the lease, so every
wait (the watch, the backoff delay, deciding, reporting) holds it; each launch and each record write first
checks that it still does.

    with LineageRunner(options) as runner:
        record = runner.supervise()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from policies import Decision, History, load_policy
from policies.plain import policy_data
from policies.schema import Policy
from supervisor.checkpoint import open_store
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.view import MergedCatalog
from supervisor.errors import UserError
from supervisor.launcher import Launcher, LaunchSpec, LocalLauncher, OnLine
from supervisor.launcher.standby import StandbyLauncher, StandbyOptions
from supervisor.launcher.standby_torchrun import TorchrunStandbyLauncher
from supervisor.launcher.torchrun import TorchrunLauncher
from supervisor.launcher.warmup import warm_checkpoint
from supervisor.layout import LineageLayout
from supervisor.lineage import Lease, LineageRecord, MlflowRef, SegmentRecord
from supervisor.lineage.exclusions import HostPool
from supervisor.monitor import Monitor, stack_dump
from supervisor.monitor.shipper import SpoolShipper, ship_leftovers
from supervisor.orchestrator import book as lifecycle
from supervisor.orchestrator.book import LineageBook
from supervisor.orchestrator.decision_step import DecisionStep, MlflowRun, this_machine
from supervisor.orchestrator.events_log import EventsLog
from supervisor.orchestrator.options import Outcome, RunOptions, SegmentResult, StepRunner, run_inline
from supervisor.orchestrator.segment_run import SegmentRun, SegmentSettings, start_step
from supervisor.orchestrator.stale import reclaim_details
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
from supervisor.script.mode import ScriptMode, SegmentPaths
from supervisor.tracking import (
    adopt_tracking,
    bound_http_requests,
    creating_store,
    default_tracking_uri,
    start_run,
)

log = logging.getLogger("rollback_supervisor.orchestrator")

#: Set to 1 in every segment unless the user set it: Python then prints each thread's stack on SIGSEGV,
#: SIGFPE, SIGABRT, SIGBUS and SIGILL, and the lineage record shows where a crash happened.
FAULTHANDLER_ENV = "PYTHONFAULTHANDLER"

#: Called after each segment's decision (None: the training ended by itself) with the record as it stands;
#: returning an Outcome ends the lineage there (a caller's own budget), None lets the policy go on.
OnDecision = Callable[[Decision | None, LineageRecord], Outcome | None]


class LineageRunner:
    """The supervisor of one lineage (see module docstring)."""

    def __init__(
        self,
        options: RunOptions,
        *,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.options = options
        self.clock = clock
        self.sleep = sleep
        self.policy = load_policy(options.policy_path)
        ck = self.policy.checkpoint
        self.layout = LineageLayout.resolve(options.workdir, ck.storage, options.lineage, ck.remote)
        self.options = options = with_standby(options, self.policy, self.layout.checkpoints)
        self.book = LineageBook(
            self.layout, ttl_seconds=options.lease_ttl_seconds, owner=options.lease_owner, clock=clock
        )
        self.events = EventsLog(self.layout.local / "events.jsonl")
        self.tracking_uri = options.tracking_uri or default_tracking_uri(Path(options.workdir))
        self.client: MlflowClient | None = None  # opened only under the lease (see open)
        self.decisions: DecisionStep | None = None  # built by open, once the run it tags is known
        self.pending: Decision | None = None
        self.script = (  # the policy's `script:` section: a command that does not use the training-side API
            ScriptMode(
                self.policy,
                options.policy_path,
                self.layout.checkpoints,
                cwd=options.cwd,
                env=options.env,
                exclude=(Path(options.workdir).resolve(),),  # the work directory is never versioned
            )
            if self.policy.script is not None
            else None
        )
        if self.script is not None:  # refuse relaunch arguments that disagree with the command's own
            self.script.check_command(options.command)

    def __enter__(self) -> LineageRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- views of the parts ---------------------------------------------------------------------

    @property
    def record(self) -> LineageRecord:
        """The lineage record (after `open`)."""
        if self.book.record is None:
            raise RuntimeError(f"lineage {self.options.lineage}: no record yet; call open() first")
        return self.book.record

    @property
    def history(self) -> History:
        """Decisions so far and the budgets they spent."""
        return self.decisions.history if self.decisions is not None else History()

    @property
    def lease(self) -> Lease | None:
        return self.book.lease

    # -- open / close ---------------------------------------------------------------------------

    def open(self) -> LineageRecord:
        """Take the lease, then load the lineage record (resuming it) or create it.

        If anything fails after the lease is taken, the lease is released before the error propagates.
        """
        bound_http_requests()
        try:
            return self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> LineageRecord:
        record = self.book.open(self.options.lease_wait_seconds)
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
                self.options.lineage,
                len(record.segments),
                record.status,
            )
            launcher = self._launcher()
            lifecycle.recover_interrupted(
                record, self.clock(), lambda seg: launcher.reclaim(reclaim_details(seg, self.layout.local))
            )
            workdir = Path(self.options.workdir)
            with creating_store(self.options.tracking_uri or default_tracking_uri(workdir)):
                self.tracking_uri, self.client = adopt_tracking(
                    record, self.options.tracking_uri, workdir, self.policy.name
                )
            lifecycle.resume(record, self._storage())
        lifecycle.stamp(record, self.options.command, str(self.options.policy_path), self.policy.name)
        lifecycle.align_events_offset(record, self.layout)
        self.book.adopt(record)
        ship_leftovers(self.client, record.mlflow.run_id, self._spool_dir)
        self.decisions = DecisionStep(
            self.policy,
            history=History.from_dict(record.history) if record.history else History(),
            events=self.events,
            catalog=self.catalog,
            run=MlflowRun(self.client, record.mlflow.run_id),
            save=self._save,
            clock=self.clock,
            host_pool=self._host_pool,
        )
        self.pending = self.decisions.decide_interrupted(record)
        self._save()
        return record

    def _new_record(self) -> LineageRecord:
        o = self.options
        run_id = start_run(self.client, o.experiment, o.lineage, self.policy.name, o.workdir)
        mlflow = MlflowRef(tracking_uri=self.tracking_uri, experiment=o.experiment, run_id=run_id)
        return lifecycle.new_record(o.lineage, mlflow, self._storage(), self.clock())

    def _storage(self) -> dict[str, Any]:
        return {
            "checkpoints": str(self.layout.checkpoints),
            "remote": self.layout.remote,
            "durable": self.layout.durable,
        }

    @property
    def _spool_dir(self) -> Path:
        return self.layout.local / "metrics"

    def close(self) -> None:
        """Close the launcher (a parked standby, multi-node followers), stop renewing the lease, release it."""
        close = getattr(self.options.launcher, "close", None)  # a standby's process, multi-node followers
        if callable(close):
            close()
        self.book.close()

    def _save(self) -> None:
        self.record.history = self.history.to_dict()
        self.book.save()

    def renew_lease(self) -> None:
        """Raise LeaseHeldError if the lease was lost (the keeper thread renews it)."""
        self.book.check()

    def keeper_renew(self) -> None:
        """Renew the lease now (a launch gets a whole TTL ahead); raise LeaseHeldError if it was lost."""
        self.book.renew_now()

    # -- the loop -------------------------------------------------------------------------------

    def supervise(
        self,
        on_line: OnLine | None = None,
        on_decision: OnDecision | None = None,
        *,
        step: StepRunner = run_inline,
    ) -> LineageRecord:
        """Open (unless open), run segments until the policy or `on_decision` ends the lineage, and finish.

        A decision left pending by a vanished supervisor is honoured first (its stop, failure or backoff);
        then each segment is run, concluded and followed by its decision's delay. `step` runs each named step
        (`open_lineage`, `run_segment`, `decide_next`, `finish_lineage`); the flow makes them Prefect tasks.
        The caller closes the runner (the lease is still held for its reporting).
        """
        if not self.book.holding:
            step("open_lineage", self.open)
        outcome = self._pending_outcome()
        segments = 0 if outcome is not None else self.options.max_segments
        for _ in range(segments):
            index = len(self.record.segments)
            result = step("run_segment", lambda: self.run_segment(on_line=on_line), f"segment-{index}")
            decision = step("decide_next", lambda result=result: self.conclude(result))
            outcome = on_decision(decision, self.record) if on_decision is not None else None
            outcome = outcome or self._outcome(decision)
            if outcome is not None:
                break
            if decision is not None and decision.delay_seconds > 0:
                self.sleep(decision.delay_seconds)
        if outcome is None:
            outcome = Outcome("failed", f"gave up after {self.options.max_segments} segments")
        return step("finish_lineage", lambda: self.finish(outcome.status, outcome.reason))

    def _pending_outcome(self) -> Outcome | None:
        """The previous supervisor vanished mid-segment: its decision spends budget too, and may end it.

        Honoured once: a later `supervise()` on the same runner does not replay it.
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending.action in ("stop", "fail"):
            return Outcome("stopped" if pending.action == "stop" else "failed", pending.reason)
        if pending.delay_seconds > 0:
            self.sleep(pending.delay_seconds)  # a crash loop through Prefect re-runs still backs off
        return None

    def _outcome(self, decision: Decision | None) -> Outcome | None:
        """How the lineage ends after `decision`, or None if it goes on."""
        if decision is None:
            if self.record.segments[-1].outcome == "finished":
                return Outcome("finished", "training finished")
            return Outcome("stopped", "training stopped")
        if decision.action == "stop":
            return Outcome("stopped", decision.reason)
        if decision.action == "fail":
            return Outcome("failed", decision.reason)
        return None

    # -- one segment ----------------------------------------------------------------------------

    def _plan(self, index: int) -> LaunchPlan:
        record = self.record
        return LaunchPlan(
            lineage=self.options.lineage,
            workdir=str(self.layout.local),
            checkpoint_dir=str(self.layout.checkpoints),
            checkpoint_remote=self.layout.remote,
            tracking_uri=self.tracking_uri,
            experiment=self.options.experiment,
            run_id=record.mlflow.run_id,
            segment=index,
            policy_path=str(Path(self.options.policy_path).resolve()),
            policy=policy_data(self.policy),
            restore=RestoreSpec(**record.next_restore),
            history=self.history.to_dict(),
            supervisor_pid=os.getpid(),
            lineage_seconds=record.running_seconds(),
            metrics_spool=str(self._spool_dir / f"{index}.jsonl"),
        )

    def run_segment(self, on_line: OnLine | None = None) -> SegmentResult:
        """Launch the next segment and watch it until it exits or an anomaly makes us stop it."""
        self.keeper_renew()  # never launch without the lease, and launch with a whole TTL ahead
        record = self.record
        index = len(record.segments)
        plan = self._plan(index)
        plan_path = plan.write(self.layout.local / f"plan-{index}.json")
        o = self.options
        # On top of ours (inherit_env). A fatal signal dumps the stack (the classifier reads the crashing
        # frame) unless the user set PYTHONFAULTHANDLER themselves (empty turns it off).
        dump = {} if FAULTHANDLER_ENV in os.environ or FAULTHANDLER_ENV in o.env else {FAULTHANDLER_ENV: "1"}
        # On a GPU machine, torch's NCCL flight recorder too, dumped through its pipe on a hang (stack_dump).
        nccl_stem = stack_dump.nccl_stem(self.layout.local)
        nccl = stack_dump.nccl_trace_env(nccl_stem, {**os.environ, **o.env})
        env = {**dump, **nccl, **o.env, PLAN_ENV: str(plan_path), "PYTHONUNBUFFERED": "1"}
        command, launcher = o.command, self._launcher()

        def open_watcher() -> Any:
            return _SegmentMonitor(self._monitor(plan))

        def open_shipper() -> Any:
            return SpoolShipper(self.client, plan.run_id, plan.metrics_spool).start()

        script = None
        if self.script is not None:  # put the chosen version in place; read metrics from the output
            paths = SegmentPaths(Path(plan.metrics_spool or ""), plan.heartbeat_path, plan.faults_path)
            self.script.warm_from = self._logged_history
            script = self.script.segment(index, plan.restore, o.command, paths, self._mlflow_env(), on_line)
            command, launcher, on_line = script.command, script.launcher(launcher), script.on_line()
            env.update(script.env)
            if script.watcher is not None:
                open_watcher = script.watch
            open_shipper = script.drain(open_shipper)
        seg = SegmentRecord(
            index=index,
            started=self.clock(),
            host=socket.gethostname(),
            restore=plan.restore.__dict__,
            start_step=start_step(plan.restore, plan.heartbeat_path),
        )
        if script is not None:
            version = script.start.version
            seg.note_launch({"command": list(command), "restored": version.id if version else None})
        record.segments.append(seg)
        self._save()
        report_wait = (
            0.0 if script is not None else SegmentSettings.report_wait_seconds
        )  # a script never reports
        stacks_dir = stack_dump.segment_dir(self.layout.local, index)
        unarmed = (  # the ranks arm their dumps as the training-side API starts; a script never does
            "an unmodified script"
            if script is not None
            else f"no rank's dump file in {stacks_dir} (a hang in start-up, or ranks on another machine),"
        )

        def collect_stacks(handle: Any) -> Any:
            root = handle.details().get("pid")
            armed = nccl_stem if nccl else None
            return stack_dump.collect(stacks_dir, nccl=armed, root_pid=root, unarmed=unarmed)

        run = SegmentRun(
            launcher,
            SegmentSettings(o.stop_grace_seconds, self.policy.monitor.poll_seconds, report_wait),
            record=record,
            events=self.events,
            lease=self.book,
            save=self._save,
            clock=self.clock,
            collect_stacks=collect_stacks,
            warn=self.decisions.warn if self.decisions is not None else None,
        )
        if not plan.restore.from_scratch:  # read the target ahead on a thread while the process starts
            warm_checkpoint(self.layout.checkpoints, plan.restore.checkpoint_id)
        return run.run(
            seg,
            LaunchSpec(
                command,
                env_overrides=env,
                cwd=o.cwd,
                name=f"{o.lineage}-{index}",
                exclude_hosts=record.exclusions(),
            ),
            heartbeat_path=plan.heartbeat_path,
            log_path=self.layout.local / "segments" / f"{index}.log",
            open_watcher=open_watcher,
            open_shipper=open_shipper,
            on_line=on_line,
        )

    def _logged_history(self, metrics: tuple[str, ...]) -> dict[str, list[tuple[int, float, int]]]:
        """The lineage run's logged history of `metrics` (script mode warms its detectors on it)."""
        from supervisor.report import fetch_points

        return fetch_points(self.tracking_uri, self.record.mlflow.run_id, metrics)

    def _mlflow_env(self) -> dict[str, str]:
        """MLflow's variables for the lineage's run: a script's own `mlflow.start_run()` logs into it. The
        experiment id is asked of MLflow once per run id, and only when the script joins the run."""
        run_id = self.record.mlflow.run_id
        script = self.script
        joins = script is not None and script.mlflow == "join"
        if joins and self.client is not None and script.experiment_of.get(run_id) is None:
            script.experiment_of = {run_id: self.client.get_run(run_id).info.experiment_id}
        experiment = script.experiment_of.get(run_id, "") if joins else ""
        return {
            "MLFLOW_TRACKING_URI": self.tracking_uri,
            "MLFLOW_EXPERIMENT_ID": experiment,
            "MLFLOW_RUN_ID": run_id,
        }

    def _launcher(self) -> Launcher:
        return self.options.launcher if self.options.launcher is not None else LocalLauncher()

    def _host_pool(self) -> HostPool:
        """What the launcher can place a segment on (a scheduler asks its cluster); the local ones: this machine."""
        pool = getattr(self._launcher(), "host_pool", None)
        if not callable(pool):
            return this_machine()
        try:
            return pool()
        except Exception as exc:  # the scheduler did not answer: its own placement is the only guard left
            log.warning(
                "could not read the hosts the launcher can use (%s); exclusions are taken as named", exc
            )
            return HostPool(1, None)

    def _monitor(self, plan: LaunchPlan) -> Monitor:
        return Monitor.from_specs(
            self.tracking_uri,
            plan.run_id,
            self.policy.monitor.detectors,
            heartbeat_path=plan.heartbeat_path,
            report_history=False,
            request_timeout=5.0,
        )

    # -- deciding and finishing -----------------------------------------------------------------

    def conclude(self, result: SegmentResult) -> Decision | None:
        """Record what happened in the segment and decide what next; None means the run finished or stopped."""
        if self.script is None:
            return self._decisions().conclude(self.record, result)
        decision = self._decisions().conclude(self.record, self.script.settle(result, self.clock()))
        problem = self.script.after_decision(decision)
        if problem is not None:  # the glob never matched a file: a policy mistake, not a training failure
            self.finish("failed", str(problem))
            raise problem
        return decision

    def finish(self, status: str, reason: str) -> LineageRecord:
        """Record the final status, the checkpoint to keep, and close the MLflow run."""
        return self._decisions().finish(self.record, status, reason)

    def _decisions(self) -> DecisionStep:
        if self.decisions is None:
            raise RuntimeError(f"lineage {self.options.lineage}: not open; call open() first")
        return self.decisions

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


def with_standby(options: RunOptions, policy: Policy, checkpoints: Path | None = None) -> RunOptions:
    """`options` with a standby launcher (kept from segment to segment, closed by `close()`) where the policy
    asks for one and no launcher was given; the local launcher alone can park a process. `checkpoints`: the
    lineage's local store, which a preloading standby (`relaunch.preload`) reads ahead."""
    relaunch = policy.relaunch
    if not relaunch.standby:
        return options
    standby = StandbyOptions(
        tuple(relaunch.imports),
        relaunch.standby_delay_seconds,
        park=relaunch.park,
        park_timeout_seconds=relaunch.park_timeout_seconds,
        preload=str(checkpoints) if relaunch.preload and checkpoints is not None else None,
    )
    if isinstance(
        options.launcher, TorchrunLauncher
    ):  # one node's torchrun: its agent is parked with its ranks
        try:
            return dataclasses.replace(options, launcher=TorchrunStandbyLauncher(standby, options.launcher))
        except UserError as exc:
            log.warning("%s; this launcher starts each segment cold", exc)
            return options
    if options.launcher is not None or policy.launcher.type != "local":
        log.warning(
            "relaunch.standby: the local and single-node torchrun launchers only; this launcher starts each "
            "segment cold"
        )
        return options
    return dataclasses.replace(options, launcher=StandbyLauncher(standby))


class _SegmentMonitor:
    """The supervisor's Monitor as a segment's Watcher."""

    def __init__(self, monitor: Monitor):
        self.monitor = monitor

    def begin(self, now: float) -> None:
        self.monitor.detectors.progress(now, phase="checkpoint")  # start-up and restore: long grace
        if self.monitor.heartbeat is not None:
            self.monitor.heartbeat.changed()  # the previous segment's last beat is not this one's progress

    def poll(self, now: float) -> list:
        return self.monitor.poll(now)

    def close(self) -> None:
        self.monitor.close()
