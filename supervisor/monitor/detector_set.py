"""A set of detectors for one run: routes points to them and reports each anomaly once per segment."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from supervisor.events import METRIC_EVENTS, Event
from supervisor.monitor.detectors import Detector, HangDetector, Point


class DetectorSet:
    """Routes points to detectors and returns each anomaly once per segment.

    Not thread-safe: one owner feeds it (the monitor loop or the training loop).
    """

    def __init__(self, detectors: Iterable[Detector], *, source: str = "monitor"):
        self.detectors = list(detectors)
        self.source = source
        self.segment = 0
        self._seen: set[tuple[str, str | None, int | None]] = set()

    @property
    def metrics(self) -> frozenset[str]:
        """Every metric some detector consumes."""
        return frozenset().union(*(d.metrics for d in self.detectors))

    def observe(self, point: Point) -> list[Event]:
        """Feed one point; a point from an older segment is dropped, a newer one resets first."""
        if point.segment < self.segment:
            return []
        if point.segment > self.segment:
            self.reset_segment(point.segment)
        return self._route(point)

    def observe_many(self, points: Iterable[Point]) -> list[Event]:
        return [event for point in points for event in self.observe(point)]

    def _route(self, point: Point) -> list[Event]:
        events = []
        for detector in self.detectors:
            if detector.metrics and point.metric not in detector.metrics:
                continue
            event = detector.observe(point)
            if event is not None and self._first(event):
                events.append(dataclasses.replace(event, source=self.source))
        return events

    def _first(self, event: Event) -> bool:
        # Two specs watching the same anomaly (e.g. duplicated in a policy) must not double-report it.
        if event.type not in METRIC_EVENTS:
            return True
        key = (event.type, event.metric, event.onset_step)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def check(self, now: float) -> list[Event]:
        """Run the clock-driven detectors (hang) at time `now` on the caller's clock."""
        events = []
        for detector in self.detectors:
            check = getattr(detector, "check", None)
            if check is not None and (event := check(now)) is not None:
                events.append(dataclasses.replace(event, source=self.source))
        return events

    def progress(self, now: float, *, step: int | None = None, phase: str | None = None) -> None:
        """Report progress that is not a metric point (a heartbeat) to the clock-driven detectors."""
        for detector in self.detectors:
            if isinstance(detector, HangDetector):
                detector.progress(now, step=step, phase=phase)

    def reset_segment(self, segment: int | None = None, history: Iterable[Point] = ()) -> None:
        """Start a new segment: forget all state, then silently warm up on `history` (its common prefix)."""
        self.segment = self.segment + 1 if segment is None else segment
        self._seen.clear()
        for detector in self.detectors:
            detector.reset()
        for point in history:
            self._route(dataclasses.replace(point, segment=self.segment))
        self._seen.clear()
