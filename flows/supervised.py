"""The Prefect flow: training runs as supervised segments; anomalies and faults become rollbacks or resumes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from supervisor.orchestrator import LineageRunner, RunOptions, SegmentResult, default_lineage, python_command


@task(cache_policy=NO_CACHE)
def open_lineage(runner: LineageRunner) -> dict[str, Any]:
    """Take the lineage lease and load (or create) its durable record."""
    return runner.open()


@task(cache_policy=NO_CACHE)
def run_segment(runner: LineageRunner) -> SegmentResult:
    """Run one training segment as a subprocess, streaming its output into the Prefect logs."""
    logger = get_run_logger()
    return runner.run_segment(on_line=lambda stream, line: logger.info("%s", line))


@task(cache_policy=NO_CACHE)
def decide_next(runner: LineageRunner, result: SegmentResult):
    """Classify how the segment ended and ask the policy what to do."""
    return runner.conclude(result)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def publish(runner: LineageRunner, decision_dict: dict[str, Any] | None) -> None:
    """Versioned event table (stable artifact key per lineage) and a Prefect event per decision."""
    from supervisor.report import markdown_table

    lineage = runner.record["lineage"]
    create_markdown_artifact(
        key=artifact_key(lineage),
        markdown=markdown_table(runner.record),
        description=f"rollback-supervisor: {lineage}",
    )
    if decision_dict is not None:
        emit_event(
            event=f"rollback-supervisor.{decision_dict['action']}",
            resource={
                "prefect.resource.id": f"rollback-supervisor.lineage.{lineage}",
                "prefect.resource.name": lineage,
            },
            payload=decision_dict,
        )


@task(cache_policy=NO_CACHE)
def finish_lineage(runner: LineageRunner, status: str, reason: str) -> dict[str, Any]:
    """Record the outcome, write the MLflow report (events.json, loss plot, tags), release the lease."""
    from supervisor.report import events_document, fetch_points, plot_lineage, write_mlflow_report

    record = runner.finish(status, reason)
    try:
        points = fetch_points(runner.tracking_uri, record["mlflow"]["run_id"])
        write_mlflow_report(runner.client, record["mlflow"]["run_id"], record, points)
        plot_lineage(record, points, runner.layout.local / "loss.png")
        (runner.layout.local / "events.json").write_text(json.dumps(events_document(record), indent=2))
    except Exception as exc:  # a report failure must not turn a recovered run into a failed one
        get_run_logger().warning("could not write the MLflow report: %s", exc)
    return record


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
    )
    runner = LineageRunner(options)
    try:
        open_lineage(runner)
        status, reason = "failed", f"gave up after {max_segments} segments"
        pending = runner.pending  # the previous supervisor vanished mid-segment: that spends budget too
        if pending is not None and pending.action in ("stop", "fail"):
            status, reason, max_segments = (
                ("stopped" if pending.action == "stop" else "failed"),
                pending.reason,
                0,
            )
        elif pending is not None and pending.delay_seconds > 0:
            runner.sleep(pending.delay_seconds)  # a crash loop through Prefect re-runs still backs off
        for _ in range(max_segments):
            result = run_segment.with_options(task_run_name=f"segment-{len(runner.record['segments'])}")(
                runner
            )
            decision = decide_next(runner, result)
            publish(runner, decision.to_dict() if decision else None)
            if decision is None:
                outcome = runner.record["segments"][-1]["outcome"]
                status = "finished" if outcome == "finished" else "stopped"
                reason = "training finished" if status == "finished" else "training stopped"
                break
            if decision.action == "stop":
                status, reason = "stopped", decision.reason
                break
            if decision.action == "fail":
                status, reason = "failed", decision.reason
                break
            if decision.delay_seconds > 0:
                runner.sleep(decision.delay_seconds)
        record = finish_lineage(runner, status, reason)
        publish(runner, None)
    finally:
        runner.close()
    return summarize(record, runner.layout.local)


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
