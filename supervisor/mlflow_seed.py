"""A new local MLflow sqlite store, copied from an empty one that this MLflow version created once.

MLflow creates a sqlite store's tables by running every Alembic migration, 3-5 s of CPU on a small machine,
and every new work directory pays it again. The first store created on a machine is also saved, empty, in
the user's cache (keyed by MLflow's version and schema head); later new stores start as a copy of it, with
the default experiment's location and times set as MLflow would have set them. Anything unusual (no cache
dir, a store that already exists, an error while copying) falls back to MLflow's own creation.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path

log = logging.getLogger("rollback_supervisor.tracking")

#: Where the empty store is kept; `ROLLBACK_CACHE_DIR` overrides, empty turns seeding off.
CACHE_ENV = "ROLLBACK_CACHE_DIR"


def cache_dir(environ: os._Environ | dict[str, str] = os.environ) -> Path | None:
    """The directory for the empty store, or None when seeding is off."""
    if CACHE_ENV in environ:
        return Path(environ[CACHE_ENV]) if environ[CACHE_ENV] else None
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollback-supervisor"


def _template_name() -> str:
    import mlflow
    from mlflow.store.db.utils import _get_latest_schema_revision

    return f"mlflow-{mlflow.__version__}-{_get_latest_schema_revision()}-empty.db"


def _build_template(template: Path) -> None:
    """Let MLflow create an empty store, then publish it under `template` in one rename."""
    from mlflow.tracking import MlflowClient

    template.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
        db = Path(tmp) / "empty.db"
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
        os.replace(db, template)


def _default_experiment_location() -> str:
    """Experiment 0's artifact location, as MLflow sets it when it creates a store in this process."""
    from mlflow.store.tracking import DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH
    from mlflow.utils.uri import append_to_uri_path, resolve_uri_if_local

    return append_to_uri_path(resolve_uri_if_local(DEFAULT_LOCAL_FILE_AND_ARTIFACT_PATH), "0")


def seed_sqlite_store(path: Path) -> bool:
    """Create the sqlite store `path` as a copy of the cached empty store; False where MLflow must create it.

    Never replaces a file: the copy is linked into place, which fails if another process created it first.
    """
    cache = cache_dir()
    if cache is None or path.exists():
        return False
    try:
        template = cache / _template_name()
        if not template.exists():
            _build_template(template)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        try:
            shutil.copyfile(template, tmp)
            now = int(time.time() * 1000)
            with sqlite3.connect(tmp) as db:
                db.execute(
                    "UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                    "WHERE experiment_id = 0",
                    (_default_experiment_location(), now, now),
                )
            db.close()
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
    except FileExistsError:
        return False
    except Exception as exc:  # a cache that cannot be written or read: MLflow creates the store as usual
        log.debug("no seeded MLflow store for %s (%s: %s); MLflow creates it", path, type(exc).__name__, exc)
        return False
    return True
