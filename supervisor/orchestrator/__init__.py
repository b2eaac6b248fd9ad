"""The supervisor core: drive one lineage through its segments (see runner.py). Prefect-free; flows/ wraps it.

Parts: `book` (the durable record and its lease), `segment_run` (one segment's life), `decision_step`
(classify, decide, apply, tag), `events_log` (the training side's reports), `stale` (processes a vanished
supervisor left behind), and `runner`, the `LineageRunner` facade over them.
"""

from supervisor.command import default_lineage, python_command
from supervisor.launcher.local import process_started as _process_started
from supervisor.lineage.record import running_seconds
from supervisor.orchestrator.options import Outcome, RunOptions, SegmentResult, StepRunner, run_inline
from supervisor.orchestrator.runner import LineageRunner, OnDecision
from supervisor.orchestrator.segment_run import describe_restore
from supervisor.orchestrator.stale import kill_stale as _kill_stale
from supervisor.tracking import artifact_location  # for the training side

__all__ = [
    "LineageRunner",
    "OnDecision",
    "Outcome",
    "RunOptions",
    "SegmentResult",
    "StepRunner",
    "_kill_stale",
    "_process_started",
    "artifact_location",
    "default_lineage",
    "describe_restore",
    "python_command",
    "run_inline",
    "running_seconds",
]
