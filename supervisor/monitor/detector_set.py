"""Build detectors from policy specs, route points to them, de-duplicate their events, replay streams."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from supervisor.errors import UserError
from supervisor.events import METRIC_EVENTS, Event
from supervisor.monitor.detectors import (
    Detector,
    DivergenceDetector,
    HangDetector,
    NonFiniteDetector,
    PlateauDetector,
    Point,
    SpikeDetector,
    ThresholdDetector,
)
from supervisor.monitor.segments import Segmenter


class DetectorSpecError(UserError):
    """A detector spec has an unknown type, an unknown key or a bad value."""


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


def _as_dict(spec: Any) -> dict[str, Any]:
    if hasattr(spec, "model_dump"):
        spec = spec.model_dump()
    if not isinstance(spec, Mapping):
        raise DetectorSpecError(f"expected a mapping with a 'type' key, got {type(spec).__name__}")
    # A null means "use the default"; pydantic dumps unset optional fields as None.
    return {k: v for k, v in spec.items() if v is not None}


def _num(
    where: str, key: str, value: Any, *, minimum: float, integer: bool = False, strict: bool = False
) -> Any:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not math.isfinite(value):
        kind = "an integer" if integer else "a number"
        bound = f" {'>' if strict else '>='} {minimum:g}" if math.isfinite(minimum) else ""
        raise DetectorSpecError(f"{where}.{key}: expected {kind}{bound}, got {value!r}")
    if value < minimum or (strict and value == minimum):
        raise DetectorSpecError(
            f"{where}.{key}: expected a value {'>' if strict else '>='} {minimum:g}, got {value!r}"
        )
    return value


def _metric(where: str, spec: dict[str, Any], key: str = "metric") -> str:
    value = spec.get(key)
    if not isinstance(value, str) or not value:
        raise DetectorSpecError(f"{where}.{key}: expected a metric name, got {value!r}")
    return value


def _non_finite(where: str, s: dict[str, Any]) -> Detector:
    metrics = s.get("metrics", [s["metric"]] if "metric" in s else None)
    if (
        not isinstance(metrics, list | tuple)
        or not metrics
        or not all(isinstance(m, str) and m for m in metrics)
    ):
        raise DetectorSpecError(
            f"{where}.metrics: expected a non-empty list of metric names, got {metrics!r}"
        )
    return NonFiniteDetector(metrics)


def _spike(where: str, s: dict[str, Any]) -> Detector:
    window = _num(where, "window", s.get("window", 128), minimum=2, integer=True)
    min_history = _num(where, "min_history", s.get("min_history", 32), minimum=2, integer=True)
    if min_history > window:
        raise DetectorSpecError(f"{where}.min_history: expected at most window ({window}), got {min_history}")
    return SpikeDetector(
        _metric(where, s),
        window=window,
        sigmas=_num(where, "sigmas", s.get("sigmas", 6.0), minimum=0, strict=True),
        warmup_steps=_num(where, "warmup_steps", s.get("warmup_steps", 200), minimum=0, integer=True),
        min_history=min_history,
    )


def _divergence(where: str, s: dict[str, Any]) -> Detector:
    return DivergenceDetector(
        _metric(where, s),
        window=_num(where, "window", s.get("window", 200), minimum=1, integer=True),
        factor=_num(where, "factor", s.get("factor", 1.5), minimum=1, strict=True),
        patience=_num(where, "patience", s.get("patience", 50), minimum=1, integer=True),
    )


def _threshold(where: str, s: dict[str, Any]) -> Detector:
    bounds = {}
    for key in ("above", "below"):
        value = s.get(key)
        if value is not None:
            bounds[key] = float(_num(where, key, value, minimum=-math.inf))
    if not bounds:
        raise DetectorSpecError(f"{where}: expected 'above' or 'below' (or both), got neither")
    if "above" in bounds and "below" in bounds and bounds["below"] > bounds["above"]:
        raise DetectorSpecError(
            f"{where}.below: expected <= above ({bounds['above']:g}), got {bounds['below']:g}"
        )
    return ThresholdDetector(_metric(where, s), **bounds)


def _plateau(where: str, s: dict[str, Any]) -> Detector:
    mode = s.get("mode", "min")
    if mode not in ("min", "max"):
        raise DetectorSpecError(f"{where}.mode: expected 'min' or 'max', got {mode!r}")
    return PlateauDetector(
        _metric(where, s),
        mode=mode,
        patience=_num(where, "patience", s.get("patience", 10), minimum=1, integer=True),
        min_delta=_num(where, "min_delta", s.get("min_delta", 0.0), minimum=0),
    )


def _hang(where: str, s: dict[str, Any]) -> Detector:
    grace = s.get("phase_grace_seconds")
    return HangDetector(
        _num(where, "seconds", s.get("seconds", 600), minimum=0, strict=True),
        phase_grace_seconds=None if grace is None else _num(where, "phase_grace_seconds", grace, minimum=0),
    )


_BUILDERS: dict[str, tuple[Callable[[str, dict[str, Any]], Detector], frozenset[str]]] = {
    "non_finite": (_non_finite, frozenset({"metrics", "metric"})),
    "spike": (_spike, frozenset({"metric", "window", "sigmas", "warmup_steps", "min_history"})),
    "divergence": (_divergence, frozenset({"metric", "window", "factor", "patience"})),
    "threshold": (_threshold, frozenset({"metric", "above", "below"})),
    "plateau": (_plateau, frozenset({"metric", "mode", "patience", "min_delta"})),
    "hang": (_hang, frozenset({"seconds", "phase_grace_seconds"})),
}


def build_detectors(specs: Sequence[Any]) -> list[Detector]:
    """Detectors from policy detector specs (dicts or pydantic models), validated key by key."""
    detectors = []
    for i, raw in enumerate(specs):
        spec = _as_dict(raw)
        kind = spec.pop("type", None)
        where = f"detectors[{i}]"
        if kind not in _BUILDERS:
            raise DetectorSpecError(f"{where}.type: expected one of {', '.join(_BUILDERS)}, got {kind!r}")
        build, allowed = _BUILDERS[kind]
        unknown = sorted(set(spec) - allowed)
        if unknown:
            raise DetectorSpecError(
                f"{where} ({kind}): unknown key(s) {', '.join(unknown)}; expected some of {', '.join(sorted(allowed))}"
            )
        detectors.append(build(where, spec))
    return detectors


def replay(points: Iterable[Point], specs: Sequence[Any], *, history: int = 2048) -> list[Event]:
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
