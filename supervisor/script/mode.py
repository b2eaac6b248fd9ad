"""Script mode for the runner: what changes when the policy has a `script:` section.

The runner asks `ScriptMode.segment()` for each segment's parts: the command (relaunch arguments appended,
the chosen version put back in place first), the MLflow variables a script's own `mlflow.start_run()` joins
the lineage's run with (only with `script.mlflow: join`), the output tap, the watcher (detectors on the printed metrics; None when metrics
come only from the script's MLflow logging, where the usual MLflow monitor watches), and the drain that
versions the files while the script runs and once it has exited. After the segment, `settle()` adds an anomaly
printed after the last poll, and `after_decision()` logs what the decision asks that the script cannot do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from supervisor.checkpoint import open_store
from supervisor.checkpoint.retention import policy_from_settings
from supervisor.errors import PolicyError, SupervisorError
from supervisor.launcher import Launcher, OnLine
from supervisor.monitor import DetectorSet, HeartbeatWriter, Point, build_detectors
from supervisor.runtime.plan import RestoreSpec
from supervisor.script.faults import ExternalFaults, FaultLauncher
from supervisor.script.files import KnownFiles, ScriptFiles
from supervisor.script.first_save import FirstSave
from supervisor.script.output import OutputParser
from supervisor.script.relaunch import Start, plan_start
from supervisor.script.scanner import ExitWatch, FileScanner
from supervisor.script.steps import NameStep, OutputStep, SidecarStep, StepRule
from supervisor.script.tap import OutputTap
from supervisor.script.watch import ScriptWatcher
from supervisor.spool import SpoolWriter

log = logging.getLogger("rollback_supervisor.script")

#: The variables that make a script's `mlflow.start_run()` log into the lineage's run.
MLFLOW_VARIABLES = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID")
#: Points of the surviving branch kept to warm a relaunched segment's detectors (the oldest go first).
BRANCH_POINTS = 1 << 16


@dataclass(frozen=True)
class SegmentPaths:
    """Where one segment's plan puts its spool, heartbeat and the drill's fired-faults record."""

    spool: Path
    heartbeat: Path
    faults: Path


@dataclass
class ScriptSegment:
    """The parts of one script segment (see module docstring)."""

    start: Start
    env: dict[str, str]
    tap: OutputTap
    watcher: ScriptWatcher | None
    files: ScriptFiles
    interval: float
    faults: ExternalFaults | None
    exit: ExitWatch | None = None

    @property
    def command(self) -> tuple[str, ...]:
        return self.start.command

    def launcher(self, inner: Launcher) -> Launcher:
        """`inner`, with the drill's external faults, noting how the script ended (for the final scan)."""
        self.exit = ExitWatch(FaultLauncher(inner, self.faults) if self.faults is not None else inner)
        return self.exit

    def on_line(self) -> OnLine:
        return self.tap

    def watch(self) -> ScriptWatcher | None:
        """The segment's watcher (`open_watcher` for SegmentRun)."""
        return self.watcher

    def drain(self, then: Callable[[], Any]) -> Callable[[], FileScanner]:
        """The `open_shipper` for SegmentRun: open the files (before launch), scan, then drain `then()`'s."""

        def open_drains() -> FileScanner:
            self.files.open()
            shipper = then()

            def after() -> None:
                self.tap.close()
                shipper.drain()

            exit_watch = self.exit
            clean = exit_watch.clean if exit_watch is not None else lambda: False
            return FileScanner(
                self.files, self.interval, self.tap.metrics_at, clean=clean, then=after
            ).start()

        return open_drains


class ScriptMode:
    """Script mode of one lineage. Not thread-safe: the runner's thread. No I/O until `segment()`."""

    def __init__(
        self,
        policy: Any,
        policy_path: str,
        store_dir: Path,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        exclude: Sequence[Path | str] = (),
    ):
        self.policy = policy
        self.config = policy.script
        self.policy_path = str(policy_path)
        self.store_dir = Path(store_dir)
        self.root = Path(cwd or os.getcwd()).resolve()
        self.template = self.config.relaunch.template()
        from supervisor.runtime.faults import FAULTS_ENV, parse_faults  # it imports torch: only when needed

        self.faults = parse_faults((env or {}).get(FAULTS_ENV))
        self.known: KnownFiles = {}
        self.current: ScriptSegment | None = None
        self.exclude: list[Path] = [Path(p) for p in exclude]
        self.mlflow = self.config.mlflow_mode()
        #: The lineage run's experiment id, which the runner asks of MLflow once.
        self.experiment_of: dict[str, str] = {}
        #: The lineage run's logged history of some metrics ({metric: [(step, value, timestamp_ms)]}), set by
        #: the runner: a supervisor that starts on a lineage another one ran warms its detectors from it.
        self.warm_from: Callable[[tuple[str, ...]], Mapping[str, list[tuple[int, float, int]]]] | None = None
        #: Metric points of the lineage's surviving branch read so far, in reading order (detector warm-up).
        self.branch: list[Point] = []

    def check_command(self, command: Sequence[str]) -> None:
        """`check_command` for this lineage's policy (see there)."""
        check_command(self.policy, self.policy_path, command)

    def segment(
        self,
        index: int,
        restore: RestoreSpec,
        command: tuple[str, ...],
        paths: SegmentPaths,
        mlflow_env: Mapping[str, str],
        on_line: OnLine | None,
    ) -> ScriptSegment:
        """Put the segment's checkpoint in place and build its parts."""
        self._exclude_own(paths, mlflow_env)
        ck, output = self.policy.checkpoint, self.config.output
        relaunch = self.config.relaunch
        start = plan_start(
            self._files(self._steps(None)),
            self.template,
            dict(relaunch.values),
            command,
            restore,
            first=index == 0,
            allow_nonfinite=ck.allow_nonfinite,
        )
        history = self._branch_to(start)
        faults = ExternalFaults(self.faults, paths.faults) if self.faults else None
        tap = OutputTap(
            OutputParser(output.patterns),
            spool=SpoolWriter(paths.spool) if output.patterns else None,
            start_step=start.step,
            on_step=faults.on_step if faults is not None else None,
            then=on_line,
        )
        watcher = None
        if output.patterns:
            detectors = DetectorSet(build_detectors(self.policy.monitor.detectors))
            watcher = ScriptWatcher(tap, detectors, HeartbeatWriter(paths.heartbeat), history=history)
        notes = {"lr_scale": start.lr_scale, "segment": index}
        spec = self.config.checkpoints
        files = self._files(
            self._steps(tap),
            notes=notes,
            parent=start.version.id if start.version else None,
            first_save=FirstSave(start.step, spec.expect_within_steps, spec.warn_after_seconds),
            printed_step=tap.last_step,
        )
        if self.mlflow == "join":
            env = {k: v for k, v in mlflow_env.items() if k in MLFLOW_VARIABLES}
            log.info(
                "script.mlflow: join: exporting %s, so the script's own run is the lineage's", ", ".join(env)
            )
        else:
            env = {}
            log.info("script.mlflow: off: MLflow's variables are not exported; metrics come from the output")
        self.current = ScriptSegment(
            start, env, tap, watcher, files, self.config.checkpoints.scan_seconds, faults
        )
        return self.current

    def _branch_to(self, start: Start) -> list[Point]:
        """The previous segment's points added to the surviving branch, cut at where `start` resumes: the points
        the detectors of the segment warm up on (none when it starts as first given)."""
        seg = self.current
        if seg is not None and seg.watcher is not None:
            _extend_branch(self.branch, seg.watcher.observed)
            seg.watcher.observed = []
        if start.version is None:
            self.branch = []
        elif seg is None and not self.branch:
            self.branch = self._logged_branch(start.step)
        while self.branch and self.branch[-1].step > start.step:
            self.branch.pop()  # printed after the version the segment resumes from: abandoned or run again
        if len(self.branch) > BRANCH_POINTS:
            del self.branch[: len(self.branch) - BRANCH_POINTS]
        return list(self.branch)

    def _logged_branch(self, step: int) -> list[Point]:
        """The surviving branch up to `step` of the detectors' metrics as MLflow holds them: what this
        supervisor's first segment warms its detectors on when an earlier supervisor ran the lineage's segments
        (without it they would start cold after every restart of the supervisor). [] without a source."""
        if self.warm_from is None:
            return []
        from supervisor.report.timeline import split_branches

        names = detector_metrics(self.policy.monitor.detectors)
        try:
            series = self.warm_from(names) if names else {}
        except (SupervisorError, OSError) as exc:  # cold detectors rather than no segment at all
            log.warning("script mode: the detectors start cold: the lineage's MLflow history: %s", exc)
            return []
        points = [
            Point(metric, s, v, ts / 1000.0)
            for metric, logged in series.items()
            for s, v, ts in split_branches(list(logged))[0]
            if s <= step
        ]
        points.sort(key=lambda p: (p.step, p.wall_time))
        if points:
            log.info(
                "script mode: the detectors warm up on %d logged points of the surviving branch (steps %d-%d)",
                len(points),
                points[0].step,
                points[-1].step,
            )
        return points[-BRANCH_POINTS:]

    def _exclude_own(self, paths: SegmentPaths, mlflow_env: Mapping[str, str]) -> None:
        """The supervisor's own files, never versioned: the lineage directory (where the plan puts the heartbeat)
        and a sqlite MLflow store (the work directory is given to the constructor's `exclude`)."""
        own = [Path(paths.heartbeat).parent]
        uri = mlflow_env.get("MLFLOW_TRACKING_URI", "")
        if uri.startswith("sqlite:///"):
            own.append(Path(uri.removeprefix("sqlite://") + "*"))  # the file, its -journal and -wal
        for path in own:
            if path not in self.exclude:
                self.exclude.append(path)

    def _files(
        self,
        steps: StepRule,
        notes: dict[str, Any] | None = None,
        parent: str | None = None,
        first_save: FirstSave | None = None,
        printed_step: Callable[[], int | None] = lambda: None,
    ) -> ScriptFiles:
        ck, spec = self.policy.checkpoint, self.config.checkpoints
        keep_best = (ck.keep_best.metric, ck.keep_best.mode, ck.keep_best.count) if ck.keep_best else None
        return ScriptFiles(
            self.root,
            spec.glob,
            self.store_dir,
            steps,
            settle_seconds=spec.settle_seconds,
            zip_check=spec.file_format() == "zip",
            retention=policy_from_settings(ck.keep_last, keep_best, ck.keep_every_steps),
            known=self.known,
            notes=notes,
            parent_id=parent,
            exclude=self.exclude,
            sidecar=Path(spec.sidecar).as_posix() if spec.step_from == "sidecar" and spec.sidecar else None,
            first_save=first_save,
            printed_step=printed_step,
        )

    def _steps(self, tap: OutputTap | None) -> StepRule:
        spec = self.config.checkpoints
        if spec.step_from == "name":
            return NameStep(spec.step_pattern)
        if spec.step_from == "sidecar":
            return SidecarStep(self.root / spec.sidecar, spec.sidecar_key)
        return OutputStep(tap.step_at if tap is not None else lambda when: 0)

    # -- after the segment ----------------------------------------------------------------------

    def settle(self, result: Any, now: float) -> Any:
        """Add to `result` what the script printed after the watcher's last poll (an anomaly, its last step)."""
        seg = self.current
        if seg is None or seg.watcher is None:
            return result
        event = seg.watcher.leftover(now)
        if result.stopped_for is None and event is not None:
            log.warning("segment %d: %s (printed after the last poll)", result.index, event.reason)
            result.stopped_for = event
        if seg.watcher.last_step is not None:
            result.last_step = seg.watcher.last_step
        return result

    def after_decision(self, decision: Any) -> PolicyError | None:
        """Log each key of the decision the script cannot honour; the error to raise if no file was ever found."""
        if decision is None:
            return None
        for note in self.unsupported(decision):
            log.warning("decision: unsupported by this script: %s", note)
        if decision.action == "fail" and self._wanted_a_checkpoint(decision) and not self._anything_found():
            return self._nothing_found(decision)
        return None

    def unsupported(self, decision: Any) -> list[str]:
        """What a relaunching decision asks that the relaunch arguments cannot carry."""
        if not decision.relaunches:
            return []
        fields, notes = self.template.fields, []
        if decision.from_scratch and (decision.skip_batches or decision.lr_scale != 1.0):
            return [
                f"skip_batches {decision.skip_batches} and lr_scale {decision.lr_scale:g}: a relaunch from "
                "scratch runs the command as first given"
            ]
        if decision.skip_batches and "skip_batches" not in fields:
            notes.append(
                f"skip_batches {decision.skip_batches}: script.relaunch.args has no {{skip_batches}}, so the "
                "script is relaunched without skipping data"
            )
        if decision.lr_scale != 1.0 and "lr_scale" not in fields:
            notes.append(
                f"lr_scale {decision.lr_scale:g}: script.relaunch.args has no {{lr_scale}}, so the script is "
                "relaunched at its own learning rate"
            )
        return notes

    def _wanted_a_checkpoint(self, decision: Any) -> bool:
        index = decision.rule_index
        return index is not None and self.policy.rules[index].action in ("resume", "rollback")

    def _anything_found(self) -> bool:
        if any(self.store_dir.glob("ckpt-*")) and open_store(self.store_dir).list():
            return True
        return bool(self._files(self._steps(None)).matches())

    def _nothing_found(self, decision: Any) -> PolicyError:
        glob = self.config.checkpoints.glob
        where = f"{self.policy_path}:{_line_of(self.policy_path, ('script', 'checkpoints', 'glob'))}"
        return PolicyError(
            [
                f"{where}: script.checkpoints.glob: expected files matching {glob!r} in {self.root} by the time "
                f"of a decision ({decision.event.type} needed a checkpoint to {self.policy.rules[decision.rule_index].action} "
                "from), got no file ever matching it; point the glob at the files the script saves, relative to "
                "the command's working directory"
            ]
        )


def check_command(policy: Any, policy_path: str | Path, command: Sequence[str]) -> None:
    """Refuse (PolicyError, exit 2) a command whose `--key=V` differs from what `script.relaunch.args` renders for
    the same key at `lr_scale` 1 with no skip: a mismatched `values` would change the learning rate on every
    resume. Pure apart from reading the policy file for the line number; run's preflight may call it."""
    relaunch = policy.script.relaunch
    problems = []
    for key, rendered in relaunch.template().options(dict(relaunch.values)):
        given = [arg.partition("=")[2] for arg in command if arg.startswith(key + "=")]
        if given and not _same(given[-1], rendered):
            where = f"{policy_path}:{_line_of(str(policy_path), ('script', 'relaunch', 'args'))}"
            problems.append(
                f"{where}: script.relaunch.args: expected {key}= rendered at lr_scale 1 to equal the command's "
                f"{key}={given[-1]}, got {key}={rendered}; every relaunch would run at {rendered} instead of "
                f"{given[-1]}: set script.relaunch.values so that it renders {given[-1]}"
            )
    if problems:
        raise PolicyError(problems)


def detector_metrics(detectors: Iterable[Any]) -> tuple[str, ...]:
    """The metric names the policy's detectors read, in order, each once."""
    names: list[str] = []
    for spec in detectors:
        for name in [*(getattr(spec, "metrics", None) or []), getattr(spec, "metric", None)]:
            if isinstance(name, str) and name not in names:
                names.append(name)
    return tuple(names)


def _extend_branch(branch: list[Point], points: Iterable[Point]) -> None:
    """Add points read in order to `branch`; a step lower than the last one abandons every point at or after
    it (the script restarted itself from an earlier step), as `report.split_branches` reads MLflow's history."""
    for point in points:
        if branch and point.step < branch[-1].step:
            while branch and branch[-1].step >= point.step:
                branch.pop()
        branch.append(point)


def _same(given: str, rendered: str) -> bool:
    """Whether a command's value and a rendered one mean the same (`2e-3` and `0.002` do)."""
    try:
        return float(given) == float(rendered)
    except ValueError:
        return given == rendered


def _line_of(path: str, keys: tuple[str, ...]) -> str:
    """`line:col` of a key in a policy file (`1:1` when it cannot be found)."""
    try:
        node = yaml.compose(Path(path).read_text(), Loader=yaml.SafeLoader)
        for key in keys:
            node = next(v for k, v in node.value if getattr(k, "value", None) == key)
        return f"{node.start_mark.line + 1}:{node.start_mark.column + 1}"
    except (OSError, yaml.YAMLError, StopIteration, AttributeError, TypeError):
        return "1:1"
