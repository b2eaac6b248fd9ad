"""What `run` and `drill` print while they work: our own INFO lines, and other libraries' only when asked."""

from __future__ import annotations

import logging
import os
import sys

#: The logger every module of ours logs under.
OURS = "rollback_supervisor"
FORMAT = "%(asctime)s %(name)s: %(message)s"


class OursOrWarnings(logging.Filter):
    """Passes our records at any level and other libraries' at WARNING and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name == OURS or record.name.startswith(OURS + ".")
        return ours or record.levelno >= logging.WARNING


class CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time: a live display swaps in a proxy that prints above it."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def configure_logging(verbose: bool = False) -> logging.Handler:
    """Log our INFO lines to stderr; MLflow's, alembic's, httpx's and Prefect's INFO lines only if `verbose`.

    Call it before MLflow or Prefect is imported: both read their level from the environment once, at import
    (MLflow gives its loggers a handler of their own, so a level set on them beforehand is overwritten).
    A level the user set in the environment is kept.
    """
    if verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    else:
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "rollback_supervisor", False)]:
        root.removeHandler(old)  # called again in one process (tests): one handler, the latest settings
    handler = CurrentStderr()
    handler.rollback_supervisor = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    if not verbose:
        handler.addFilter(OursOrWarnings())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return handler
