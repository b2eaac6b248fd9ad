"""The training side's events.jsonl as the supervisor reads it: by byte offset, tolerant of torn lines.

Also what makes two reports one incident: one anomaly can show on several metrics and detectors at one step
(a spike on the loss and the grad norm over its threshold; NaN gradients make the loss NaN too), so any two
metric events with (nearly) the same onset are one incident and get one decision. A `warn` is no incident:
training went on, so what comes after it is decided on its own.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from supervisor.events import METRIC_EVENTS, Event

log = logging.getLogger("rollback_supervisor.orchestrator")


def same_incident(a: Event, b: Event) -> bool:
    """Two metric events with (nearly) one onset are one incident, whatever their type or metric."""
    return a.type in METRIC_EVENTS and b.type in METRIC_EVENTS and same_onset(a, b)


def covers(record: dict[str, Any], event: Event) -> bool:
    """Whether a training-side report accounts for `event`: its incident; a warning (training went on, so a
    later anomaly is a new incident) only the same event type at (nearly) the same onset."""
    reported = Event.from_dict(record["event"])
    if warned(record):
        return reported.type == event.type and same_onset(reported, event)
    return same_incident(reported, event)


def warned(record: dict[str, Any]) -> bool:
    """Whether a training-side report is a `warn` decision: the event was reported and training went on."""
    decision = record.get("decision")
    return isinstance(decision, dict) and decision.get("action") == "warn"


def same_onset(a: Event, b: Event, tolerance: int = 2) -> bool:
    """Both sides run the same detectors on the same points, so one anomaly has (nearly) one onset."""
    if a.onset_step is None or b.onset_step is None:
        return True
    return abs(a.onset_step - b.onset_step) <= tolerance


class EventsLog:
    """events.jsonl of one lineage on this machine. Reads only; the training side appends."""

    def __init__(
        self,
        path: Path,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.path = path
        self._clock = clock
        self._sleep = sleep

    def exists(self) -> bool:
        return self.path.exists()

    def since(self, offset: int) -> tuple[list[dict[str, Any]], int]:
        """Complete records after byte `offset`, and the offset after the last one.

        Read the way the spool is read: a line cut by a kill is left for later, and a malformed line is
        skipped with a warning (its bytes still count), so the offset never drifts and nothing raises.
        """
        try:
            with self.path.open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return [], offset
        records = []
        for line in data.split(b"\n")[:-1]:  # the last piece has no newline yet
            offset += len(line) + 1
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                Event.from_dict(rec["event"])
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("%s: skipping a malformed line (%s): %r", self.path, exc, line[:200])
                continue
            records.append(rec)
        return records, offset

    def reported(self, event: Event, offset: int, wait_s: float = 2.0) -> bool:
        """Whether the training process reported `event`'s incident after `offset`, waiting up to `wait_s`.

        The training side writes its report when it handles the anomaly, which may be a moment after the
        supervisor's own monitor saw it.
        """
        deadline = self._clock() + wait_s
        while True:
            records, _ = self.since(offset)
            if any(covers(rec, event) for rec in records):
                return True
            if self._clock() >= deadline:
                return False
            self._sleep(0.25)


def line_offset(path: Path, lines: int) -> int:
    """The byte offset just after the first `lines` lines of `path` (records that counted lines)."""
    offset = 0
    with path.open("rb") as f:
        for _ in range(lines):
            line = f.readline()
            if not line.endswith(b"\n"):
                break
            offset += len(line)
    return offset
