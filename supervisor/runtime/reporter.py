"""The segment's reports to its supervisor: one JSON record per line in `events.jsonl`, fsynced.

Anomalies (handled in process or left to the supervisor, with the decision taken) and saves that failed.
Each record carries a sequence number, the pid and the segment, so the supervisor reads each one once.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.events import Event


class EventReporter:
    """Appends records to one `events.jsonl`; not thread-safe (the training thread reports)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        segment: int,
        *,
        clock: Callable[[], float] = time.time,
        pid: Callable[[], int] = os.getpid,
    ):
        self.path, self.segment = Path(path), segment
        self._clock, self._pid = clock, pid
        self._seq = 0

    def anomaly(self, event: Event, decision: Any, *, handled: bool, **extra: Any) -> None:
        """An anomaly and the decision taken in process (None: the supervisor decides)."""
        self.append(
            {
                "handled_in_process": handled,
                "event": event.to_dict(),
                "decision": decision.to_dict() if decision is not None else None,
                **extra,
            }
        )

    def save_failed(self, event: Event) -> None:
        """A checkpoint that was not written (training went on)."""
        self.append({"kind": "save_failed", "handled_in_process": True, "event": event.to_dict()})

    def append(self, fields: dict[str, Any]) -> None:
        self._seq += 1
        record = {"seq": self._seq, "pid": self._pid(), "segment": self.segment, "time": self._clock()}
        record |= fields
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
