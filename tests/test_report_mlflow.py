"""The MLflow report against a real sqlite tracking store: metric history in, artifacts and tags out."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from supervisor.report import (
    ReportError,
    fetch_points,
    report_tags,
    split_branches,
    timeline_rows,
    write_mlflow_report,
)
from tests.test_report_timeline import lineage_points, lineage_record


@pytest.fixture(scope="module")
def mlflow_sqlite_uri(tmp_path_factory):
    """One real sqlite store for the module: creating its tables costs ~5 s, a run in it costs nothing."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture
def run(mlflow_sqlite_uri, tmp_path):
    client = MlflowClient(tracking_uri=mlflow_sqlite_uri)
    exp = client.create_experiment(tmp_path.name, artifact_location=(tmp_path / "artifacts").as_uri())
    return client, client.create_run(exp).info.run_id


def _log(client, run_id, points):
    metrics = [Metric(key, value, ts, step) for key, series in points.items() for step, value, ts in series]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def _same(a, b):
    key = lambda p: (p[2], p[0])  # noqa: E731
    return [(s, "nan" if math.isnan(v) else v, t) for s, v, t in sorted(a, key=key)] == [
        (s, "nan" if math.isnan(v) else v, t) for s, v, t in sorted(b, key=key)
    ]


def test_fetch_points_reads_every_branch_back(run, mlflow_sqlite_uri):
    client, run_id = run
    points, _ = lineage_points()
    _log(client, run_id, points)
    got = fetch_points(mlflow_sqlite_uri, run_id)
    assert set(got) == {"loss", "val_loss"}
    assert _same(got["loss"], points["loss"]) and _same(got["val_loss"], points["val_loss"])
    live, _ = split_branches(got["loss"])
    assert [p[0] for p in live] == list(range(1, 601))
    assert fetch_points(mlflow_sqlite_uri, run_id, metrics=("grad_norm",)) == {"grad_norm": []}


def test_fetch_points_of_an_unknown_run_is_a_report_error(run, mlflow_sqlite_uri):
    with pytest.raises(ReportError, match="no-such-run"):
        fetch_points(mlflow_sqlite_uri, "no-such-run")


def test_write_mlflow_report_logs_artifacts_and_tags(run, tmp_path):
    client, run_id = run
    points, _ = lineage_points()
    record = lineage_record()
    tags = write_mlflow_report(client, run_id, record, points)

    stored = client.get_run(run_id).data.tags
    assert {k: stored[k] for k in tags} == tags
    assert stored["rollback.status"] == "finished"
    assert stored["rollback.final_checkpoint"] == record["final_checkpoint"]
    assert stored["rollback.final_reason"] == "training finished at step 600"
    assert (stored["rollback.rollbacks"], stored["rollback.restarts"]) == ("2", "4")
    decisions = sorted(k for k in stored if k.startswith("rollback.decision."))
    assert decisions == [
        "rollback.decision.000",
        "rollback.decision.001",
        "rollback.decision.002",
        "rollback.decision.003",
    ]
    assert "spike" in stored["rollback.decision.001"] and "@200" in stored["rollback.decision.001"]

    assert sorted(a.path for a in client.list_artifacts(run_id)) == ["events.json", "loss.png"]
    local = Path(client.download_artifacts(run_id, "", str(tmp_path / "dl")))
    doc = json.loads(
        (local / "events.json").read_text(), parse_constant=lambda c: pytest.fail(f"non-strict {c}")
    )
    assert doc["lineage"] == "charlm-demo" and doc["status"] == "finished"
    assert (doc["rollbacks"], doc["restarts"], doc["in_process"]) == (2, 4, 1)
    assert [r["event"] for r in doc["timeline"]] == ["non_finite", "spike", "unknown_exit", "hardware_fault"]
    assert doc["timeline"][0]["value"] == "NaN"
    assert len(doc["segments"]) == 4 and doc["segments"][0]["in_process"][0]["tier"] == "memory"
    png = (local / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_many_decisions_are_written_in_batches_and_a_running_lineage_has_empty_final_tags(run):
    client, run_id = run
    record = lineage_record()
    record.update(status="running", final_checkpoint=None, final_reason=None)
    entry = record["segments"][0]["in_process"][0]
    record["segments"][0]["in_process"] = [entry] * 150
    tags = write_mlflow_report(client, run_id, record, {})
    stored = client.get_run(run_id).data.tags
    assert len(timeline_rows(record)) == 153
    assert sum(k.startswith("rollback.decision.") for k in stored) == 153
    assert stored["rollback.decision.152"] == tags["rollback.decision.152"]
    assert stored["rollback.status"] == "running"
    assert stored["rollback.final_checkpoint"] == "" and stored["rollback.final_reason"] == ""
    assert stored["rollback.decision.000"] == report_tags(record)["rollback.decision.000"]
