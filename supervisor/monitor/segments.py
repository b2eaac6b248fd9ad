"""Split a metric stream into segments at rollbacks (a metric's step going backwards)."""

from __future__ import annotations

import dataclasses
from collections import deque

from supervisor.monitor.detectors import Point


class Segmenter:
    """Assigns each point, fed in arrival order, to a segment; a step going backwards starts a new one.

    A rollback is seen when a metric logs a step lower than its last step in the current segment.
    Points logged (by wall time) before the first point of the current segment belong to an
    abandoned branch and are dropped. The last `history` points per metric with steps below the
    new segment's first step are its common prefix: `prefix(segment)` returns them so detectors
    can be warmed up without ever seeing the abandoned branch.
    """

    def __init__(self, history: int = 2048):
        self.history = history
        self.segment = 0
        self._start_time = float("-inf")
        self._last_step: dict[str, int] = {}
        self._recent: dict[str, deque[Point]] = {}
        self._prefixes: dict[int, list[Point]] = {}

    def assign(self, point: Point) -> Point | None:
        """The point tagged with its segment, or None when it belongs to an abandoned branch."""
        if point.wall_time < self._start_time:
            return None
        last = self._last_step.get(point.metric)
        if last is not None and point.step < last:
            self._start_segment(point)
        self._last_step[point.metric] = point.step
        tagged = dataclasses.replace(point, segment=self.segment)
        self._recent.setdefault(point.metric, deque(maxlen=self.history)).append(tagged)
        return tagged

    def _start_segment(self, first: Point) -> None:
        self.segment += 1
        self._start_time = first.wall_time
        kept = {
            m: deque((p for p in q if p.step < first.step), maxlen=self.history)
            for m, q in self._recent.items()
        }
        self._recent = kept
        self._last_step = {m: q[-1].step for m, q in kept.items() if q}
        prefix = sorted((p for q in kept.values() for p in q), key=lambda p: (p.step, p.wall_time))
        self._prefixes[self.segment] = [dataclasses.replace(p, segment=self.segment) for p in prefix]
        # Only the latest couple of segments can still be asked for; older prefixes are garbage.
        for old in [s for s in self._prefixes if s < self.segment - 1]:
            del self._prefixes[old]

    def prefix(self, segment: int) -> list[Point]:
        """The retained common-prefix points (steps before the rollback) of `segment`, in step order."""
        return list(self._prefixes.get(segment, ()))
