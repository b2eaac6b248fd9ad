"""Which MLflow store a resumed lineage logs to (pure choice; the I/O is in tests/test_remote.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.tracking import choose_tracking_uri, local_store_path

HERE = {Path("/shared/nfs/mlflow.db"), Path("/work/run/mlflow.db")}
DEFAULT = "sqlite:////work/run/mlflow.db"


@pytest.mark.parametrize(
    ("recorded", "requested", "expected"),
    [
        (None, None, DEFAULT),  # a new lineage
        ("sqlite:////old/machine/mlflow.db", None, DEFAULT),  # moved: the old disk is gone
        ("sqlite:////shared/nfs/mlflow.db", None, "sqlite:////shared/nfs/mlflow.db"),  # shared file system
        ("http://mlflow.internal:5000", None, "http://mlflow.internal:5000"),  # a server is shared
        ("http://mlflow.internal:5000", "http://127.0.0.1:5000", "http://127.0.0.1:5000"),  # asked for wins
        ("sqlite:////old/machine/mlflow.db", "databricks", "databricks"),
        ("file:///old/machine/mlruns", None, DEFAULT),
        (DEFAULT, None, DEFAULT),
    ],
)
def test_choose_tracking_uri(recorded, requested, expected):
    assert choose_tracking_uri(recorded, requested, DEFAULT, exists=lambda p: p in HERE) == expected


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("sqlite:////a/b/mlflow.db", Path("/a/b/mlflow.db")),
        ("sqlite:////a/b/mlflow.db?timeout=30", Path("/a/b/mlflow.db")),
        ("file:///a/mlruns", Path("/a/mlruns")),
        ("http://127.0.0.1:5000", None),
        ("databricks", None),
    ],
)
def test_local_store_path(uri, path):
    assert local_store_path(uri) == path
