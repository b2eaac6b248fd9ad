"""A training process group left running by a supervisor that died on this host, and how to end it safely."""

from __future__ import annotations

import logging
import os
import signal
import socket
from pathlib import Path

from supervisor.launcher.local import process_started
from supervisor.lineage.record import SegmentRecord
from supervisor.runtime.plan import PLAN_ENV

log = logging.getLogger("rollback_supervisor.orchestrator")


def kill_stale(seg: SegmentRecord | dict, plan_dir: Path) -> None:
    """Kill a training process group left running by a supervisor that died on this same host.

    Only the very process the segment started (see `is_segment_process`): a PID reused since by an unrelated
    process is left alone.
    """
    if isinstance(seg, SegmentRecord):
        pid, started, host, index = seg.pid, seg.pid_started, seg.host, seg.index
    else:
        pid, started, host, index = seg.get("pid"), seg.get("pid_started"), seg.get("host"), seg.get("index")
    if not pid or host != socket.gethostname():
        return
    if not is_segment_process(pid, started, plan_dir):
        log.info("segment %d: pid %d is gone or was reused; nothing to kill", index, pid)
        return
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
            log.warning("killed stale training process group %d of segment %d", pid, index)
    except (ProcessLookupError, PermissionError):
        pass


def is_segment_process(pid: int, started: float | None, plan_dir: Path) -> bool:
    """Whether `pid` is still the training process a segment of this lineage started.

    Its start time must match the recorded one within a second (psutil derives it from the boot time, which
    can move by about that much when the clock is adjusted), and where its environment is readable it must
    carry a launch plan from this lineage's directory. A record from before start times were kept is judged
    by the environment alone.
    """
    import psutil

    now = process_started(pid)
    if now is None or (started is not None and abs(now - started) > 1.0):
        return False
    try:
        plan = psutil.Process(pid).environ().get(PLAN_ENV)
    except psutil.Error:
        return started is not None
    return plan is not None and Path(plan).parent == plan_dir
