"""The watcher of a script's segment: the policy's detectors run on the metrics its output printed.

It reads the tap's queue instead of reading the points back from MLflow: no shipping or polling lag between a
printed NaN and the detectors, and `leftover()` still sees what the script printed after the last poll (a fast
script may diverge and exit 0 between two polls). It also writes the segment's heartbeat file from the steps
it reads, so the lineage record has each segment's first and last step. Not thread-safe: the runner's thread.

A relaunched segment's detectors start warm, as a `Session`'s monitor warms them from the lineage's MLflow
history: `history` (the surviving branch's points up to the step the segment resumes from) is fed to them
silently first, cut at the first step the script prints (a version's step, read from the output, may run a
step or two past the save the script resumes from), so a divergence whose baseline was set before a preemption still fires after it. Every point
read is kept in `observed` for the next segment's warm-up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from supervisor.events import METRIC_EVENTS, Event
from supervisor.monitor import DetectorSet, HeartbeatWriter, Point
from supervisor.script.tap import OutputTap

log = logging.getLogger("rollback_supervisor.script")


class ScriptWatcher:
    """Detectors over a tap's readings, plus the heartbeat (see module docstring)."""

    def __init__(
        self,
        tap: OutputTap,
        detectors: DetectorSet,
        heartbeat: HeartbeatWriter | None = None,
        *,
        history: Iterable[Point] = (),
    ):
        self.tap = tap
        self.detectors = detectors
        self.heartbeat = heartbeat
        self.last_step: int | None = None
        self.observed: list[Point] = []  #: every point read, in order (the runner's thread takes them)
        self._history: list[Point] | None = list(history) or None  # warms the detectors at the first reading

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
            if self._history is not None:
                self._warm(step)
            for metric, value in reading.parsed.metrics.items():
                point = Point(metric, step, value, reading.time)
                self.observed.append(point)
                events += self.detectors.observe(point)
        if step is not None:
            self.detectors.progress(now, step=step, phase="train")
            self._write_beat(step)
        return events

    def _warm(self, first: int) -> None:
        history, self._history = [p for p in self._history or () if p.step < first], None
        self.detectors.reset_segment(self.detectors.segment, history)
        if history:
            log.info(
                "detectors warmed on %d points of the surviving branch (steps %d-%d) before step %d",
                len(history),
                history[0].step,
                history[-1].step,
                first,
            )

    def _write_beat(self, step: int) -> None:
        if step != self.last_step and step >= 0:
            self.last_step = step
            if self.heartbeat is not None:
                self.heartbeat.beat(step)

    def close(self) -> None:
        """Nothing to release: `leftover()` still reads the tap once the segment has ended."""
