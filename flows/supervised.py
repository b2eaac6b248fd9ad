"""The Prefect flow: training runs as supervised segments; anomalies and faults become rollbacks or resumes."""

from __future__ import annotations

import json
import logging
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from flows import prefect_fork
from policies import load_policy
from supervisor.launcher.slurm import launcher_from_policy
from supervisor.lineage import LineageRecord
from supervisor.orchestrator import LineageRunner, Outcome, RunOptions, default_lineage, python_command

prefect_fork.install()

T = TypeVar("T")
#: Task names of the runner's steps, as Prefect shows them.
STEP_TASKS = ("open_lineage", "run_segment", "decide_next", "finish_lineage")


class TaskSteps:
    """Runs each step of `LineageRunner.supervise` as a Prefect task, and logs segment output to its task run.

    Output lines arrive on the launcher's reader threads, outside any Prefect context: they go to the logger
    of the task run that launched the segment, captured when it starts.
    """

    def __init__(self) -> None:
        self._logger: logging.Logger | logging.LoggerAdapter | None = None

    def __call__(self, name: str, fn: Callable[[], T], run_name: str | None = None) -> T:
        def body() -> T:
            self._logger = get_run_logger()
            return fn()

        body.__name__ = body.__qualname__ = name
        body.__doc__ = _STEP_DOCS.get(name)
        return task(body, name=name, task_run_name=run_name or name, cache_policy=NO_CACHE)()

    def line(self, stream: str, line: str) -> None:
        if self._logger is not None:
            self._logger.info("%s", line)


_STEP_DOCS = {
    "open_lineage": "Take the lineage lease and load (or create) its durable record.",
    "run_segment": "Run one training segment, streaming its output into the Prefect logs.",
    "decide_next": "Classify how the segment ended and ask the policy what to do.",
    "finish_lineage": "Record the outcome and the final checkpoint, and close the MLflow run.",
}


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def publish(
    lineage: str, table: str, decision: dict[str, Any] | None, in_process: list[dict[str, Any]] | None = None
) -> None:
    """Versioned event table (stable artifact key per lineage) and a Prefect event per decision: first those
    the training process took itself during the segment (payload `in_process: true`), then the segment's."""
    create_markdown_artifact(
        key=artifact_key(lineage),
        markdown=table,
        description=f"rollback-supervisor: {lineage}",
    )
    for taken in [*(in_process or []), *([decision] if decision is not None else [])]:
        emit_event(
            event=f"rollback-supervisor.{taken['action']}",
            resource={
                "prefect.resource.id": f"rollback-supervisor.lineage.{lineage}",
                "prefect.resource.name": lineage,
            },
            payload=taken,
        )


@task(cache_policy=NO_CACHE)
def write_report(record: dict[str, Any], lineage_dir: str) -> None:
    """The MLflow report (events.json, loss plot, tags) and its local copies; a failure is only a warning."""
    from mlflow.tracking import MlflowClient

    from supervisor.report import events_document, fetch_points, plot_lineage, write_mlflow_report

    run = record["mlflow"]
    try:
        points = fetch_points(run["tracking_uri"], run["run_id"])
        client = MlflowClient(tracking_uri=run["tracking_uri"])
        write_mlflow_report(client, run["run_id"], record, points)
        plot_lineage(record, points, Path(lineage_dir) / "loss.png")
        (Path(lineage_dir) / "events.json").write_text(json.dumps(events_document(record), indent=2))
    except Exception as exc:  # a report failure must not turn a recovered run into a failed one
        get_run_logger().warning("could not write the MLflow report: %s", exc)


def _publish(record: LineageRecord, decision: dict[str, Any] | None, *, segment_ended: bool = False) -> None:
    """The table and the decisions; after a segment, also the rollbacks its training process took in place
    (the supervisor learns of those when the segment ends)."""
    from supervisor.report import markdown_table

    in_process = []
    if segment_ended and record.segments:
        seg = record.segments[-1]
        for rec in seg.in_process:
            if isinstance(rec.get("decision"), dict):
                in_process.append({**rec["decision"], "in_process": True, "segment": seg.index})
    publish(record.lineage, markdown_table(record), decision, in_process)


def artifact_key(lineage: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes."""
    return "rollback-" + re.sub(r"[^a-z0-9-]+", "-", lineage.lower()).strip("-")


@flow(name="supervised-training", log_prints=True)
def supervised_training(
    command: list[str] | str,
    policy: str,
    lineage: str | None = None,
    workdir: str = ".rollback",
    tracking_uri: str | None = None,
    stop_grace_seconds: float = 30.0,
    lease_wait_seconds: float = 0.0,
    lease_ttl_seconds: float = 60.0,
    max_segments: int = 1000,
    env: dict[str, str] | None = None,
    lease_owner: str | None = None,
    progress_seconds: float = 30.0,
) -> dict[str, Any]:
    """Supervise `command` under `policy` until it finishes, stops, or exhausts its budgets."""
    argv = python_command(shlex.split(command) if isinstance(command, str) else list(command))
    options = RunOptions(
        command=argv,
        policy_path=policy,
        lineage=lineage or default_lineage(argv),
        workdir=Path(workdir),
        tracking_uri=tracking_uri,
        stop_grace_seconds=stop_grace_seconds,
        lease_wait_seconds=lease_wait_seconds,
        lease_ttl_seconds=lease_ttl_seconds,
        max_segments=max_segments,
        env=dict(env or {}),
        lease_owner=lease_owner or "",
        launcher=launcher_from_policy(load_policy(policy).launcher, Path(workdir)),
    )
    steps = TaskSteps()

    def on_decision(decision, record: LineageRecord) -> Outcome | None:
        _publish(record, decision.to_dict() if decision else None, segment_ended=True)
        return None

    with LineageRunner(options) as runner, _progress(runner, argv, progress_seconds):
        record = runner.supervise(on_line=steps.line, on_decision=on_decision, step=steps)
        write_report(record.to_dict(), str(runner.layout.local))
        _publish(record, None)
    return summarize(record.to_dict(), runner.layout.local)


def _progress(runner: LineageRunner, argv: list[str], every: float):
    """The progress line (supervisor.report.progress) in the flow run's log every `every` seconds; 0: never."""
    from supervisor.report.progress import ProgressLog, reader_for

    reader = reader_for(runner.layout.local, runner.layout.checkpoints, argv)
    return ProgressLog(reader.read, every, get_run_logger())


def summarize(record: dict[str, Any], lineage_dir: Path) -> dict[str, Any]:
    """The flow's result: final status, final checkpoint, and every event and decision in order."""
    from supervisor.report import timeline_rows

    return {
        "lineage": record["lineage"],
        "status": record["status"],
        "reason": record["final_reason"],
        "final_checkpoint": record["final_checkpoint"],
        "mlflow_run_id": record["mlflow"]["run_id"],
        "tracking_uri": record["mlflow"]["tracking_uri"],
        "segments": len(record["segments"]),
        "lineage_dir": str(lineage_dir),
        "plot": str(lineage_dir / "loss.png"),
        "timeline": timeline_rows(record),
    }
