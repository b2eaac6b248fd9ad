"""Where a lineage's MLflow run lives, including after the lineage moves to another machine."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlparse

from mlflow.tracking import MlflowClient

from supervisor.lineage.record import LineageRecord
from supervisor.mlflow_seed import seed_sqlite_store

log = logging.getLogger("rollback_supervisor.tracking")

#: MLflow's HTTP retry defaults make one call to a dead server take ~4 minutes (7 retries, backoff up to
#: 120 s; FACTS.md). The supervisor must keep deciding while the tracking server is down, so its calls give up
#: within seconds (3 retries: 1 + 2 + 4 s of backoff) and our own code retries or carries on. A value the user
#: set is kept.
BOUNDED_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def bound_http_requests(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Bound MLflow's per-call HTTP retries and timeout in this process (and the ones it starts)."""
    for key, value in BOUNDED_HTTP.items():
        environ.setdefault(key, value)


def default_tracking_uri(workdir: Path) -> str:
    """A local sqlite store in the work directory: no server needed."""
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def artifact_location(tracking_uri: str, workdir: Path) -> str | None:
    """Keep a local store's artifacts inside the workdir (MLflow's default is ./mlruns in the cwd)."""
    if tracking_uri.startswith("sqlite:") or tracking_uri.startswith("file:"):
        return (Path(workdir).resolve() / "mlartifacts").as_uri()
    return None


def local_store_path(uri: str) -> Path | None:
    """The file behind a sqlite or file store URI; None for a tracking server."""
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    if uri.startswith("file:"):
        return Path(urlparse(uri).path)
    return None


def choose_tracking_uri(
    recorded: str | None,
    requested: str | None,
    default: str,
    exists: Callable[[Path], bool] = Path.exists,
) -> str:
    """The store a resumed lineage logs to: the one asked for; else the recorded one if reachable from here.

    A tracking server is shared between machines, so a recorded server URI is kept. A recorded local store
    (sqlite or file) is kept only when its file is here too (same host, or a shared file system); a lineage
    that moved to a machine without it logs to this machine's default store.
    """
    if requested:
        return requested
    if not recorded or recorded == default:
        return default
    path = local_store_path(recorded)
    return recorded if path is None or exists(path) else default


@contextlib.contextmanager
def creating_store(tracking_uri: str) -> Iterator[None]:
    """Serialise opening (and, on a fresh workdir, creating) a local sqlite store across processes.

    Two supervisors opening one new `mlflow.db` at once race on MLflow's table creation (`table ... already
    exists` in the loser); an exclusive lock next to the file makes the second wait for the first. A new
    store starts as a copy of a cached empty one where it can (`mlflow_seed`).
    """
    path = local_store_path(tracking_uri) if tracking_uri.startswith("sqlite:") else None
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(f"{path}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        seed_sqlite_store(path)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def start_run(
    client: MlflowClient,
    experiment: str,
    lineage: str,
    policy: str,
    workdir: Path,
    *,
    run_name: str | None = None,
) -> str:
    """Create the lineage's MLflow run (and its experiment, with artifacts kept in the workdir when local).

    The run is named after the lineage, or `run_name` (a stand-alone training run names itself).
    """
    exp = client.get_experiment_by_name(experiment)
    artifacts = artifact_location(client.tracking_uri, workdir)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, artifacts)
    run = client.create_run(
        exp_id, run_name=run_name or lineage, tags={"rollback.lineage": lineage, "rollback.policy": policy}
    )
    return run.info.run_id


def adopt_tracking(
    record: LineageRecord, requested: str | None, workdir: Path, policy: str
) -> tuple[str, MlflowClient]:
    """Point a resumed record at a store reachable from here; open a new run there if its run is elsewhere.

    The run the lineage had is kept in `record.mlflow_previous`, so its earlier metrics stay findable.
    """
    old = record.mlflow
    uri = choose_tracking_uri(old.tracking_uri, requested, default_tracking_uri(workdir))
    client = MlflowClient(tracking_uri=uri)
    if uri == old.tracking_uri or _has_run(client, old.run_id):
        record.mlflow = replace(old, tracking_uri=uri)
        return uri, client
    run_id = start_run(client, old.experiment or "rollback-supervisor", record.lineage, policy, workdir)
    record.mlflow_previous = [*(record.mlflow_previous or []), {**old.to_dict(), "left_at": time.time()}]
    record.mlflow = replace(old, tracking_uri=uri, run_id=run_id)
    log.warning(
        "lineage %s: its MLflow run %s lives in %s, which is not reachable from here; logging to a new run "
        "%s in %s (the old run is kept in the record as mlflow_previous)",
        record.lineage,
        old.run_id,
        old.tracking_uri,
        run_id,
        uri,
    )
    return uri, client


def _has_run(client: MlflowClient, run_id: str | None) -> bool:
    """Whether `run_id` exists in this store (the same server can be spelled two ways)."""
    if not run_id:
        return False
    try:
        client.get_run(run_id)
        return True
    except Exception:  # MlflowException (not found) or the store being unreachable: not usable here
        return False
