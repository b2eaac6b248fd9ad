"""The monitor: pure anomaly detectors, an MLflow metric watcher, an exit classifier, notices, heartbeats.

The names are imported on first use (PEP 562): a training process that only needs the detectors, the
heartbeat and the notices does not import the exit classifier, and through its patterns the policy schema.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.lazy import exports

# Not lazy: a lazy `replay` would be the submodule of that name once anything imported it.
from supervisor.monitor.replay import replay

if TYPE_CHECKING:
    from supervisor.monitor.classifier import classify_exit, exit_signal, read_oom_kills
    from supervisor.monitor.detector_set import DetectorSet
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
    from supervisor.monitor.from_specs import DetectorSpecError, build_detectors
    from supervisor.monitor.heartbeat import Heartbeat, HeartbeatReader, HeartbeatWriter
    from supervisor.monitor.notices import Notice, NoticePoller, NoticeWatcher, poll_notice
    from supervisor.monitor.segments import Segmenter
    from supervisor.monitor.sources import MetricsSourceError, MetricsUnavailable
    from supervisor.monitor.watcher import MetricWatcher, Monitor

__all__ = [
    "Detector",
    "DetectorSet",
    "DetectorSpecError",
    "DivergenceDetector",
    "HangDetector",
    "Heartbeat",
    "HeartbeatReader",
    "HeartbeatWriter",
    "MetricWatcher",
    "MetricsSourceError",
    "MetricsUnavailable",
    "Monitor",
    "NonFiniteDetector",
    "Notice",
    "NoticePoller",
    "NoticeWatcher",
    "PlateauDetector",
    "Point",
    "Segmenter",
    "SpikeDetector",
    "ThresholdDetector",
    "build_detectors",
    "classify_exit",
    "exit_signal",
    "poll_notice",
    "read_oom_kills",
    "replay",
]

_WHERE = {
    "classify_exit": "classifier",
    "exit_signal": "classifier",
    "read_oom_kills": "classifier",
    "DetectorSet": "detector_set",
    "Detector": "detectors",
    "DivergenceDetector": "detectors",
    "HangDetector": "detectors",
    "NonFiniteDetector": "detectors",
    "PlateauDetector": "detectors",
    "Point": "detectors",
    "SpikeDetector": "detectors",
    "ThresholdDetector": "detectors",
    "DetectorSpecError": "from_specs",
    "build_detectors": "from_specs",
    "Heartbeat": "heartbeat",
    "HeartbeatReader": "heartbeat",
    "HeartbeatWriter": "heartbeat",
    "Notice": "notices",
    "NoticePoller": "notices",
    "NoticeWatcher": "notices",
    "poll_notice": "notices",
    "Segmenter": "segments",
    "MetricsSourceError": "sources",
    "MetricsUnavailable": "sources",
    "MetricWatcher": "watcher",
    "Monitor": "watcher",
}


__getattr__ = exports(__name__, {name: f"{__name__}.{module}" for name, module in _WHERE.items()})
