"""Training-side API: attach to a launch plan, register state, loop, log, checkpoint, detect, heartbeat.

`Session` drives the loop itself; `TrainingCore` is the same machinery for a driver that owns its loop.

The names are imported on first use (PEP 562), so that the supervisor's side, which reads and writes launch
plans (`supervisor.runtime.plan`), never imports torch through this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from supervisor.lazy import exports

if TYPE_CHECKING:
    from supervisor.runtime.core import TrainingCore
    from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
    from supervisor.runtime.session import Session

__all__ = ["PLAN_ENV", "LaunchPlan", "RestoreSpec", "Session", "TrainingCore"]

_WHERE = {
    "TrainingCore": "supervisor.runtime.core",
    "Session": "supervisor.runtime.session",
    "PLAN_ENV": "supervisor.runtime.plan",
    "LaunchPlan": "supervisor.runtime.plan",
    "RestoreSpec": "supervisor.runtime.plan",
}


__getattr__ = exports(__name__, _WHERE)
