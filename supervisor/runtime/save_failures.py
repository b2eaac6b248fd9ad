"""Checkpoints that were not written: counted, reported, and never allowed to stop training.

A full or broken disk costs the checkpoint, not the run: each failure is logged, counted in MLflow
(`checkpoint.save_failures`) and reported to the supervisor in events.jsonl; training goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from supervisor.errors import BackgroundSaveError
from supervisor.events import Event
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.seams import Outputs

log = logging.getLogger("rollback_supervisor.session")
T = TypeVar("T")


class SaveFailures:
    """Counts and reports failed saves; `despite()` calls the store through the failures it reports."""

    def __init__(self, reporter: EventReporter, outputs: Outputs, *, clock: Callable[[], float] = time.time):
        self._reporter, self._outputs, self._clock = reporter, outputs, clock
        self.count = 0

    def failed(self, exc: BaseException, step: int) -> None:
        """Report a checkpoint not written (none of it committed) to the log, MLflow and events.jsonl."""
        self.count += 1
        cause = exc.__cause__ or exc
        log.error("checkpoint not saved at step %d, training goes on: %s", step, exc)
        self._outputs.metrics.log({"checkpoint.save_failures": self.count}, step)
        event = Event(
            "storage_error",
            f"checkpoint not saved: {exc}",
            step=step,
            source="in_process",
            wall_time=self._clock(),
            evidence={"error": type(cause).__name__, "errno": getattr(cause, "errno", None)},
        )
        try:
            self._reporter.save_failed(event)
        except OSError as err:  # the workdir may sit on the failing disk: the log line above is the report
            log.error("could not report the failed save to %s: %s", self._reporter.path, err)

    def despite(self, step: int, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call the store; an earlier background save that failed is reported (not raised), then the call retried.

        The store raises each background failure once, so this ends.
        """
        while True:
            try:
                return call(*args, **kwargs)
            except BackgroundSaveError as exc:
                self.failed(exc, step)
