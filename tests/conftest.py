"""Real-component test harness: MLflow on sqlite, a real `mlflow server`, Prefect's test harness."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytest_plugins = ["tests.cpu_profile"]  # per-test CPU seconds with ROLLBACK_TEST_CPU=FILE
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
# Under pytest-xdist each worker trains beside another on 2 cores: one intra-op thread a process, since
# OpenMP threads that outnumber the cores spin-wait (two threads on two shared cores ran 4x slower) and the
# suite then burned about 1.7x the CPU of a run on one worker. Set before anything imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
# New MLflow sqlite stores are copies of one empty store made once per session (supervisor/mlflow_seed.py).
os.environ.setdefault("ROLLBACK_CACHE_DIR", str(_SESSION_TMP / "cache"))
os.environ.pop("ROLLBACK_SUPERVISOR_FAULTS", None)


def pytest_configure(config: pytest.Config) -> None:
    # xdist's loadfile hands out files by their number of tests unless told otherwise; the order that counts
    # is the one below (tests/file_costs.py says why).
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the files with the most measured seconds first (each file's tests keep their order)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.file_costs import load

    costs = load()
    items.sort(key=lambda item: -costs.get(item.nodeid.split("::", 1)[0], 0.0))  # stable: files stay whole


@pytest.fixture
def mlflow_sqlite_uri(tmp_path: Path) -> str:
    """A fresh MLflow tracking store on sqlite in tmp_path."""
    from supervisor.mlflow_seed import seed_sqlite_store

    seed_sqlite_store(tmp_path / "mlflow.db")
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
def prefect_api():
    """One real `prefect server` for the session (one per xdist worker), started on first use (~11 s).

    Its URL goes into `os.environ`, so every `rollback-supervisor run` a test starts talks to it instead of
    starting an ephemeral server of its own (6-10 s of CPU each on 2 cores). Tests of the ephemeral mode
    pop `PREFECT_API_URL` from their child's environment (tests/test_spot.py does).
    """
    from tests.prefect_servers import PrefectServer

    server = PrefectServer(_SESSION_TMP / "prefect-api").start()
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.api_url
    try:
        yield server
    finally:
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old
        server.stop()


@pytest.fixture(scope="session", autouse=True)
def _shared_prefect_server_for_end_to_end_tests(request):
    """A session with end-to-end tests shares one Prefect server from its start (module fixtures that run
    the CLI come before any function-scoped fixture); a session of unit tests never starts one."""
    if any(
        item.get_closest_marker("e2e") or item.get_closest_marker("slow") for item in request.session.items
    ):
        request.getfixturevalue("prefect_api")


@pytest.fixture(scope="session")
def prefect_harness(prefect_api):
    """Flows run in the test process against the session's Prefect server (what the harness would start)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_api.api_url}):
        yield


@pytest.fixture(scope="module", autouse=True)
def _no_prefect_services_past_their_module():
    """Stop the event and log workers an in-process flow started, at the end of its test file.

    The events worker keeps a websocket to the server open, and `websockets` draws each keepalive ping's
    payload from Python's global `random` every 20 s: a later test in the same worker that checks that
    nothing moved the global RNG streams (tests/test_data_resumable.py) then saw the stream move. The next
    flow starts new workers.
    """
    yield
    if "prefect.events.worker" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (EventsWorker, APILogWorker):
        service.drain_all(timeout=10)
