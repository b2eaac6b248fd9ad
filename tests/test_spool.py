"""The metric spool: the training side appends, the supervisor ships to a real MLflow sqlite store."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from supervisor.monitor.shipper import SpoolShipper, ship_leftovers
from supervisor.spool import SpoolReader, SpoolWriter
from tests.segmentkit import segment_env

REPO = Path(__file__).resolve().parents[1]


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.fixture
def run(mlflow_sqlite_uri: str) -> tuple[MlflowClient, str]:
    client = MlflowClient(tracking_uri=mlflow_sqlite_uri)
    experiment = client.create_experiment("spool")
    return client, client.create_run(experiment).info.run_id


def test_reader_sees_whole_lines_only_and_resumes_after_what_was_marked(tmp_path: Path):
    path = tmp_path / "0.jsonl"
    writer = SpoolWriter(path)
    writer.send([("loss", 1.5, 1000, 1), ("loss", float("nan"), 1001, 2), ("grad", float("inf"), 1001, 2)])
    with path.open("ab") as f:  # a batch cut by a kill, or still being written
        f.write(b'["loss", 3.0, 10')
    reader = SpoolReader(path)
    points, end = reader.pending(limit=1000)
    assert [p[0] for p in points] == ["loss", "loss", "grad"]
    assert points[0] == ("loss", 1.5, 1000, 1) and math.isnan(points[1][1]) and points[2][1] == math.inf
    assert end == path.read_bytes().rindex(b"\n") + 1
    one, end1 = reader.pending(limit=1000, max_bytes=8)  # a small read still ends on a whole line
    assert one == points[:1] and end1 == path.read_bytes().index(b"\n") + 1
    two, end2 = reader.pending(limit=2)
    assert len(two) == 2 and end2 < end
    reader.mark(end2)
    rest, _ = SpoolReader(path).pending(limit=1000)  # a new reader (a new supervisor) resumes at the mark
    assert [p[0] for p in rest] == ["grad"]
    with path.open("ab") as f:  # the cut line completes
        f.write(b'03, 3]\n{"not": "a point"}\n')
    reader.mark(end)
    rest, end3 = reader.pending(limit=1000)
    assert rest == [("loss", 3.0, 1003, 3)] and end3 == path.stat().st_size  # the malformed line is skipped
    writer.close()


def test_shipper_ships_in_order_keeps_points_through_an_outage_and_never_duplicates(tmp_path, run):
    client, run_id = run
    path = tmp_path / "metrics" / "0.jsonl"
    writer = SpoolWriter(path)
    writer.send([("loss", float(s), 1_700_000_000_000 + s, s) for s in range(1, 2501)])  # > 2 MLflow batches

    class Outage:
        def log_batch(self, *args, **kwargs):
            raise ConnectionError("tracking server down")

    down = SpoolShipper(Outage(), run_id, path)
    assert down.drain() is False  # refused: nothing marked, nothing lost
    assert SpoolReader(path).shipped() == 0
    shipper = SpoolShipper(client, run_id, path)
    assert shipper.ship() == 2500
    writer.send([("loss", 0.5, 1_700_000_009_999, 2501)])
    # A supervisor that died after MLflow took a batch but before it marked the offset sends it again.
    lines = path.read_bytes().splitlines(keepends=True)
    shipper.reader.mark(sum(len(line) for line in lines[:2490]))  # the last 10 points of the batch
    assert shipper.drain() is True
    assert _history(client, run_id, "loss") == [(s, float(s)) for s in range(1, 2501)] + [(2501, 0.5)]
    writer.close()


def test_a_point_mlflow_refuses_for_good_is_dropped_alone(tmp_path, run, caplog):
    client, run_id = run
    path = tmp_path / "0.jsonl"
    points = [("loss", float(s), 1_700_000_000_000 + s, s) for s in range(1, 8)]
    points.insert(3, ("bad@key", 1.0, 1_700_000_000_004, 4))  # MLflow rejects this key on every try
    SpoolWriter(path).send(points)
    assert SpoolShipper(client, run_id, path).drain()
    assert _history(client, run_id, "loss") == [(s, float(s)) for s in range(1, 8)]
    assert "refused metric point ('bad@key'" in caplog.text and SpoolReader(path).unshipped_bytes() == 0


def test_the_shipping_thread_ships_while_the_segment_runs_and_leftovers_are_shipped_later(tmp_path, run):
    client, run_id = run
    spool = tmp_path / "metrics"
    shipper = SpoolShipper(client, run_id, spool / "0.jsonl", interval=0.05).start()
    writer = SpoolWriter(spool / "0.jsonl")
    writer.send([("loss", 2.0, 1_700_000_000_000, 1)])
    deadline = 200
    while not client.get_metric_history(run_id, "loss") and deadline:  # shipped with no drain
        shipper._stop.wait(0.05)
        deadline -= 1
    assert _history(client, run_id, "loss") == [(1, 2.0)]
    assert shipper.drain()
    # Segment 1's supervisor was SIGKILLed before its drain: the next supervisor of the lineage ships it.
    SpoolWriter(spool / "1.jsonl").send([("loss", 1.0, 1_700_000_000_500, 2)])
    assert ship_leftovers(client, run_id, spool) == 1
    assert ship_leftovers(client, run_id, spool) == 0
    assert _history(client, run_id, "loss") == [(1, 2.0), (2, 1.0)]


RUNNER = (
    "import json, sys; sys.path.insert(0, 'examples'); import charlm; code = charlm.main(sys.argv[1:]); "
    "print('MLFLOW-MODULES', json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'mlflow'))); "
    "sys.exit(code)"
)


def _train(
    tmp_path: Path, run_id: str, uri: str, *args: str, faults: str = ""
) -> subprocess.CompletedProcess:
    env = segment_env(tmp_path, run_id, uri, faults)
    cmd = [sys.executable, "-c", RUNNER, "--size", "tiny", "--batch-size", "4", "--eval-every", "1000", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_supervised_process_logs_to_the_spool_and_never_imports_mlflow(tmp_path, run, mlflow_sqlite_uri):
    client, run_id = run
    proc = _train(tmp_path, run_id, mlflow_sqlite_uri, "--steps", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MLFLOW-MODULES []" in proc.stdout, proc.stdout[-2000:]
    points, _ = SpoolReader(tmp_path / "metrics" / "0.jsonl").pending(limit=10_000)
    assert sorted(s for k, _, _, s in points if k == "loss") == list(range(1, 13))
    assert ("rollback.skip_batches", 0.0) in {(k, v) for k, v, _, _ in points}
    assert client.get_metric_history(run_id, "loss") == []  # the supervisor ships, not the training process


def test_after_a_sigkill_every_committed_checkpoints_metrics_are_in_the_spool(
    tmp_path, run, mlflow_sqlite_uri
):
    from supervisor.checkpoint import open_store

    client, run_id = run
    proc = _train(tmp_path, run_id, mlflow_sqlite_uri, "--steps", "200", faults="kill@37")
    assert proc.returncode == -9, proc.stderr[-3000:]
    latest = open_store(tmp_path / "checkpoints").latest()
    assert latest is not None and latest.step == 30
    spool = tmp_path / "metrics" / "0.jsonl"
    points, _ = SpoolReader(spool).pending(limit=10_000)
    logged = {s for k, _, _, s in points if k == "loss"}
    assert set(range(1, latest.step + 1)) <= logged  # a commit waits for its metrics to reach the file
    assert SpoolShipper(client, run_id, spool).drain()
    shipped = {step for step, _ in _history(client, run_id, "loss")}
    assert shipped == logged
