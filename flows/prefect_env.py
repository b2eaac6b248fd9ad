"""Quiet, offline Prefect defaults (see FACTS.md); applied before Prefect is imported, never overriding the user."""

from __future__ import annotations

import os
from pathlib import Path


def apply_defaults(workdir: Path) -> None:
    """No telemetry or UI, a generous ephemeral start-up timeout, and PREFECT_HOME inside the work dir."""
    defaults = {
        "PREFECT_HOME": str(Path(workdir).resolve() / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
        "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "GIT_PYTHON_REFRESH": "quiet",
    }
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    # Prefect creates its home without parents=True and then times out on the database it cannot open.
    Path(os.environ["PREFECT_HOME"]).expanduser().mkdir(parents=True, exist_ok=True)
