"""Training-side API: attach to a launch plan, register state, loop, log, checkpoint, detect, heartbeat."""

from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
from supervisor.runtime.session import Session

__all__ = ["PLAN_ENV", "LaunchPlan", "RestoreSpec", "Session"]
