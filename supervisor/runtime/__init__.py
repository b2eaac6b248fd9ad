"""Training-side API: attach to a launch plan, register state, loop, log, checkpoint, detect, heartbeat.

`Session` drives the loop itself; `TrainingCore` is the same machinery for a driver that owns its loop.
"""

from supervisor.runtime.core import TrainingCore
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
from supervisor.runtime.session import Session

__all__ = ["PLAN_ENV", "LaunchPlan", "RestoreSpec", "Session", "TrainingCore"]
