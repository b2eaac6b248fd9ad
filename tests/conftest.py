"""Real-component test harness: MLflow on sqlite, a real `mlflow server`, Prefect's test harness."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_SESSION_TMP = Path(tempfile.mkdtemp(prefix="rbs-tests-"))

# Quiet, offline Prefect (FACTS.md): no telemetry, no UI, a generous ephemeral start-up timeout,
# and PREFECT_HOME inside a temp dir so tests never touch the user's profile.
os.environ.setdefault("PREFECT_HOME", str(_SESSION_TMP / "prefect-home"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_UI_ENABLED", "false")
os.environ.setdefault("PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("ROLLBACK_SUPERVISOR_FAULTS", None)


@pytest.fixture
def mlflow_sqlite_uri(tmp_path: Path) -> str:
    """A fresh MLflow tracking store on sqlite in tmp_path."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="session")
def mlflow_server():
    """A real `mlflow server` on a free 127.0.0.1 port for the whole session, stopped by PID."""
    from tests.servers import MlflowServer

    server = MlflowServer(_SESSION_TMP / "mlflow-server").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def prefect_harness():
    """Prefect's test harness, started once per session (it costs ~12 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
