"""The lineage's report in its MLflow run: events.json and loss.png artifacts, status and decision tags."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from supervisor.errors import SupervisorError
from supervisor.lineage.record import RecordLike, as_json
from supervisor.report.plot import plot_lineage
from supervisor.report.timeline import Point, counts, jsonable, report_tags, timeline_rows

#: MLflow's log_batch takes at most this many tags per call.
TAGS_PER_BATCH = 100


class ReportError(SupervisorError):
    """The MLflow run to read from or write the report to could not be used."""


def fetch_points(
    tracking_uri: str, run_id: str, metrics: tuple[str, ...] = ("loss", "val_loss")
) -> dict[str, list[Point]]:
    """Every logged (step, value, timestamp_ms) of each metric of the run, all segments and branches."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        client.get_run(run_id)  # an unknown run has an empty history rather than an error
        return {
            m: [(h.step, h.value, h.timestamp) for h in client.get_metric_history(run_id, m)] for m in metrics
        }
    except MlflowException as exc:
        raise ReportError(
            f"MLflow run {run_id} at {tracking_uri}: cannot read metric history: {exc}"
        ) from exc


def events_document(record: RecordLike) -> dict[str, Any]:
    """The events.json content: summary fields, the timeline rows and the raw segments, as strict JSON."""
    record = as_json(record)
    return jsonable(
        {
            "lineage": record.get("lineage"),
            "status": record.get("status"),
            "final_reason": record.get("final_reason"),
            "final_checkpoint": record.get("final_checkpoint"),
            **counts(record),
            "timeline": timeline_rows(record),
            "segments": record.get("segments") or [],
        }
    )


def write_mlflow_report(
    client: Any, run_id: str, record: RecordLike, points: dict[str, list[Point]]
) -> dict[str, str]:
    """Log events.json and loss.png to the run and set its rollback.* tags; returns the tags set."""
    record = as_json(record)
    from mlflow.entities import RunTag

    text = json.dumps(events_document(record), indent=2, allow_nan=False)
    tags = report_tags(record)
    items = [RunTag(k, v) for k, v in tags.items()]
    with tempfile.TemporaryDirectory(prefix="rbs-report-") as tmp:
        png = plot_lineage(record, points, Path(tmp) / "loss.png")
        client.log_text(run_id, text, "events.json")
        client.log_artifact(run_id, str(png))
        for start in range(0, len(items), TAGS_PER_BATCH):
            client.log_batch(run_id, tags=items[start : start + TAGS_PER_BATCH])
    return tags
