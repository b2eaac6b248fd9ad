"""Which MLflow store a resumed lineage logs to (pure choice; the I/O is in tests/test_remote.py)."""

from __future__ import annotations

import os
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


def test_bounded_http_keeps_what_the_user_set():
    from supervisor.tracking import BOUNDED_HTTP, bound_http_requests

    env = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}
    bound_http_requests(env)
    assert env == {**BOUNDED_HTTP, "MLFLOW_HTTP_REQUEST_TIMEOUT": "300"}


@pytest.mark.slow
def test_a_dead_tracking_server_is_given_up_on_in_seconds_not_minutes():
    # With MLflow's defaults this call retries for ~246 s (FACTS.md); the supervisor's bound makes it ~7 s.
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    code = f"""
import time
from mlflow.tracking import MlflowClient
from supervisor.tracking import _has_run, bound_http_requests
bound_http_requests()
t0 = time.monotonic()
print(_has_run(MlflowClient("http://127.0.0.1:{port}"), "0123456789abcdef"), round(time.monotonic() - t0))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    found, seconds = out.stdout.split()
    assert found == "False"
    assert int(seconds) < 60
