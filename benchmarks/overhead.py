"""The supervisor's own CPU time beside a training run: what supervising costs per training step.

One lineage of the example runs under the real supervisor core (`LineageRunner`: monitor, metric shipper,
heartbeat, lease keeper) with the live progress line refreshed every second, and no fault. The supervisor's
CPU time is this process's user+system time over `supervise()` (every thread of it), the training's is that
of the children it reaped (the training process and anything it started). The lineage's MLflow store is
created before the clock starts: that is once per lineage, not per step.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import CHARLM, QUIET_ENV, REPO, target

#: The issue's bound: supervising adds at most 2% to the training's CPU time.
TARGET = 0.02


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def supervisor_cpu(
    workdir: Path, size: str, steps: int, threads: int | None = None, policy: Path | None = None
) -> dict[str, Any]:
    """Supervise `steps` steps of the example at `size`; the CPU seconds of each side and their ratio."""
    from supervisor.commands.progress import for_run
    from supervisor.orchestrator import LineageRunner, RunOptions

    policy = policy or REPO / "policies" / "presets" / "palm-spike.yaml"
    command = [sys.executable, str(CHARLM), "--size", size, "--steps", str(steps), "--eval-every", "50"]
    if threads:
        command += ["--threads", str(threads)]
    lineage = f"overhead-{size}"
    options = RunOptions(
        command=tuple(command),
        policy_path=str(policy),
        lineage=lineage,
        workdir=workdir,
        env={**QUIET_ENV, "ROLLBACK_SUPERVISOR_FAULTS": ""},
        cwd=str(REPO),
    )
    with LineageRunner(options, sleep=lambda _: None) as runner:
        runner.open()
        progress = for_run(command, policy, lineage, workdir, every=1.0)
        sup0, child0, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
        progress.start()
        try:
            record = runner.supervise()
        finally:
            progress.stop()
        wall = time.perf_counter() - t0
        sup, train = _cpu(resource.RUSAGE_SELF) - sup0, _cpu(resource.RUSAGE_CHILDREN) - child0
    done = record.segments[-1].last_step if record.segments else None
    if record.status != "finished" or not done:
        raise RuntimeError(
            f"{lineage}: the supervised run did not finish: {record.status} ({record.final_reason})"
        )
    ratio = sup / train if train > 0 else None
    return {
        "size": size,
        "steps": done,
        "wall_s": wall,
        "supervisor_cpu_s": sup,
        "training_cpu_s": train,
        "supervisor_cpu_per_step_s": sup / done,
        "training_cpu_per_step_s": train / done,
        "targets": {"supervisor_cpu_s/training_cpu_s": target(ratio, TARGET)},
        "note": "the supervisor's CPU time over supervise() (monitor, shipper, heartbeat, lease keeper, the "
        "progress line at 1 s), against the CPU time of the training process it reaped (its imports included)",
    }
