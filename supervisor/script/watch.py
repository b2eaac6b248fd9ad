"""The watcher of a script's segment: the policy's detectors run on the metrics its output printed.

It reads the tap's queue instead of reading the points back from MLflow: no shipping or polling lag between a
printed NaN and the detectors, and `leftover()` still sees what the script printed after the last poll (a fast
script may diverge and exit 0 between two polls). It also writes the segment's heartbeat file from the steps
it reads, so the lineage record has each segment's first and last step. Not thread-safe: the runner's thread.
"""

from __future__ import annotations

import logging

from supervisor.events import METRIC_EVENTS, Event
from supervisor.monitor import DetectorSet, HeartbeatWriter, Point
from supervisor.script.tap import OutputTap

log = logging.getLogger("rollback_supervisor.script")


class ScriptWatcher:
    """Detectors over a tap's readings, plus the heartbeat (see module docstring)."""

    def __init__(self, tap: OutputTap, detectors: DetectorSet, heartbeat: HeartbeatWriter | None = None):
        self.tap = tap
        self.detectors = detectors
        self.heartbeat = heartbeat
        self.last_step: int | None = None

    def begin(self, now: float) -> None:
        self.detectors.progress(now, phase="checkpoint")  # start-up and the script's own restore: long grace

    def poll(self, now: float) -> list[Event]:
        events = self._observe(now)
        return events + self.detectors.check(now)

    def leftover(self, now: float) -> Event | None:
        """The first metric anomaly in what the script printed after the last poll (it has exited)."""
        return next((e for e in self._observe(now) if e.type in METRIC_EVENTS), None)

    def _observe(self, now: float) -> list[Event]:
        events: list[Event] = []
        step = None
        for reading in self.tap.take():
            step = reading.parsed.step
            for metric, value in reading.parsed.metrics.items():
                events += self.detectors.observe(Point(metric, step, value, reading.time))
        if step is not None:
            self.detectors.progress(now, step=step, phase="train")
            self._write_beat(step)
        return events

    def _write_beat(self, step: int) -> None:
        if step != self.last_step and step >= 0:
            self.last_step = step
            if self.heartbeat is not None:
                self.heartbeat.beat(step)

    def close(self) -> None:
        """Nothing to release: `leftover()` still reads the tap once the segment has ended."""
