"""A segment a vanished supervisor left running: what the runner tells its launcher to find and end it by."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.launcher import LocalLauncher
from supervisor.lineage.record import SegmentRecord
from supervisor.runtime.plan import PLAN_ENV


def reclaim_details(seg: SegmentRecord, plan_dir: Path) -> dict[str, Any]:
    """`Launcher.reclaim`'s argument for `seg`: its launch details, and the plan directory it was started with."""
    return {**seg.launch_details(), "env_in_dir": {PLAN_ENV: str(plan_dir)}}


def kill_stale(seg: SegmentRecord | dict, plan_dir: Path) -> None:
    """Kill a local training process group left running on this host by a supervisor that died (see reclaim)."""
    if isinstance(seg, SegmentRecord):
        details = reclaim_details(seg, plan_dir)
    else:
        details = {**seg, "env_in_dir": {PLAN_ENV: str(plan_dir)}}
    LocalLauncher().reclaim(details)
