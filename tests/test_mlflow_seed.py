"""A new local MLflow store seeded from the cached empty one is the store MLflow itself would have created."""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from supervisor import mlflow_seed
from supervisor.mlflow_seed import CACHE_ENV, seed_sqlite_store
from supervisor.tracking import creating_store


def _schema(db: Path) -> list[tuple[str, list[str]]]:
    """Each table's and index's definition with its lines sorted: Alembic's batch migrations order a
    table's constraints differently from one creation to the next."""
    with sqlite3.connect(db) as con:
        rows = con.execute(
            "SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY name"
        ).fetchall()
    con.close()
    return [(name, sorted(line.strip().rstrip(",") for line in sql.splitlines())) for name, sql in rows]


def _rows(db: Path, query: str) -> list[tuple]:
    with sqlite3.connect(db) as con:
        rows = con.execute(query).fetchall()
    con.close()
    return rows


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_seeded_store_has_mlflows_schema_version_and_default_experiment(tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    made = tmp_path / "made" / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
    assert seed_sqlite_store(tmp_path / "one" / "mlflow.db")  # builds the cached empty store first
    assert len(list(cache.glob("mlflow-*-empty.db"))) == 1
    seeded = tmp_path / "two" / "mlflow.db"
    assert seed_sqlite_store(seeded)  # a copy of it

    assert _schema(seeded) == _schema(made)
    version = "SELECT version_num FROM alembic_version"
    assert _rows(seeded, version) == _rows(made, version)
    default = "SELECT experiment_id, name, artifact_location, lifecycle_stage FROM experiments"
    assert (
        _rows(seeded, default)
        == _rows(made, default)
        == [(0, "Default", str(tmp_path / "mlruns" / "0"), "active")]
    )


def test_mlflow_opens_a_seeded_store_without_migrating_and_logs_to_it(tmp_path, cache, caplog):
    db = tmp_path / "mlflow.db"
    assert seed_sqlite_store(db)  # building the cached empty store logs MLflow's creation: not counted
    caplog.set_level(logging.INFO, logger="mlflow")
    caplog.clear()
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    run = client.create_run(client.create_experiment("e", (tmp_path / "art").as_uri()))
    client.log_metric(run.info.run_id, "loss", 2.5, step=3)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(3, 2.5)]
    assert "Creating initial MLflow database tables" not in caplog.text


def test_an_existing_store_is_never_replaced(tmp_path, cache):
    db = tmp_path / "mlflow.db"
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    client.create_experiment("kept")
    assert not seed_sqlite_store(db)
    assert client.get_experiment_by_name("kept") is not None


def test_a_store_created_by_another_process_between_the_check_and_the_link_is_kept(
    tmp_path, cache, monkeypatch
):
    db = tmp_path / "mlflow.db"
    real_link = os.link

    def racing_link(src, dst):
        Path(dst).write_bytes(b"the other process's store")
        real_link(src, dst)

    monkeypatch.setattr(mlflow_seed.os, "link", racing_link)
    assert not seed_sqlite_store(db)
    assert db.read_bytes() == b"the other process's store"
    assert [p.name for p in tmp_path.iterdir() if p.name != "cache"] == ["mlflow.db"]  # no temp file left


def test_seeding_off_or_an_unwritable_cache_leaves_the_creation_to_mlflow(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, "")
    assert not seed_sqlite_store(tmp_path / "a.db")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    monkeypatch.setenv(CACHE_ENV, str(locked / "cache"))
    if os.geteuid() == 0:  # root writes anywhere: a file where the cache directory should be stops it instead
        (locked / "cache").write_text("not a directory")
    assert not seed_sqlite_store(tmp_path / "b.db")
    assert not (tmp_path / "b.db").exists()
    with creating_store(f"sqlite:///{tmp_path / 'c.db'}"):  # the supervisor's path goes on without a seed
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'c.db'}")
    assert client.get_experiment("0").name == "Default"
