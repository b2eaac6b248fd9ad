"""The monitor: pure anomaly detectors, an MLflow metric watcher, an exit classifier, notices, heartbeats."""

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
from supervisor.monitor.replay import replay
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
