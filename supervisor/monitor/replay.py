"""Replay a recorded metric stream through detectors built from policy specs, as the watcher would see it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from supervisor.events import Event
from supervisor.monitor.detector_set import DetectorSet
from supervisor.monitor.detectors import Point
from supervisor.monitor.from_specs import build_detectors
from supervisor.monitor.segments import Segmenter

if TYPE_CHECKING:
    from policies.monitor_schema import AnyDetectorSpec


def replay(
    points: Iterable[Point], specs: Sequence[AnyDetectorSpec | Mapping[str, Any]], *, history: int = 2048
) -> list[Event]:
    """Feed a recorded stream (in arrival order) through detectors built from `specs`; return the events.

    Rollbacks are segmented exactly as the watcher does, and `hang` is judged on the points' own
    wall times, so a gap longer than its `seconds` between two points reads as a stall.
    """
    detectors = DetectorSet(build_detectors(specs), source="replay")
    segmenter = Segmenter(history)
    events: list[Event] = []
    for raw in points:
        point = segmenter.assign(raw)
        if point is None:
            continue
        if point.segment != detectors.segment:
            detectors.reset_segment(point.segment, segmenter.prefix(point.segment))
        events += detectors.check(point.wall_time)
        events += detectors.observe(point)
        # Credit progress at the point's own time, not at the next check, so gaps are measured.
        detectors.progress(point.wall_time, step=point.step)
    return events
