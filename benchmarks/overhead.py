"""The supervisor's own CPU time beside a training run: what supervising costs per training step.

One lineage of the example runs under the real supervisor core (`LineageRunner`: monitor, metric shipper,
heartbeat, lease keeper) with the live progress line refreshed every second, and no fault. The supervisor's
CPU time is this process's user+system time over `supervise()` (every thread of it), the training's is that
of the children it reaped (the training process and anything it started). The lineage's MLflow store is
created before the clock starts: that is once per lineage, not per step.

The example trains where the rest of `bench rollback` does (`--device`, `--batch-size`). A time budget bounds
the phase: when it runs out the training's process group is killed, the lineage ends as stopped, and the
figures cover the steps it managed (`timed_out: true`).
"""

from __future__ import annotations

import resource
import signal
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.common import CHARLM, QUIET_ENV, REPO, BenchRunError, target

#: The issue's bound: supervising adds at most 2% to the training's CPU time.
TARGET = 0.02
#: How long a killed training process group gets to be reaped.
KILL_WAIT_S = 10.0
#: How long the training gets to stop on SIGTERM when the benchmark itself is stopped (its emergency save).
STOP_GRACE_S = 15.0


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


class BudgetLauncher:
    """A launcher that kills the process group of its segment once `seconds` have passed since `arm()`.

    `expire` runs on the timer's thread; `start` on the runner's. Either sees the other's work: a segment
    started after the budget ran out is killed at once."""

    def __init__(self, launcher: Any, seconds: float | None):
        self.launcher = launcher
        self.seconds = seconds
        self.expired = threading.Event()
        self._lock = threading.Lock()
        self._handle: Any = None
        self._timer: threading.Timer | None = None

    def arm(self) -> None:
        """Start counting the budget (no budget: never expires)."""
        if self.seconds is not None:
            self._timer = threading.Timer(self.seconds, self.expire)
            self._timer.daemon = True
            self._timer.start()

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def start(self, spec: Any, on_line: Any = None) -> Any:
        with self._lock:
            self._handle = handle = self.launcher.start(spec, on_line)
            late = self.expired.is_set()
        if late:
            handle.stop(KILL_WAIT_S, sig=signal.SIGKILL)
        return handle

    def reclaim(self, details: Mapping[str, Any]) -> None:
        self.launcher.reclaim(details)

    def expire(self) -> None:
        """The budget ran out: SIGKILL the running segment's process group (and its strays) and reap it."""
        with self._lock:
            self.expired.set()
            handle = self._handle
        if handle is not None:
            handle.stop(KILL_WAIT_S, sig=signal.SIGKILL)


def supervisor_cpu(
    workdir: Path,
    size: str,
    steps: int,
    threads: int | None = None,
    policy: Path | None = None,
    *,
    device: str = "cpu",
    batch_size: int | None = None,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Supervise `steps` steps of the example at `size` on `device`, for at most `timeout_s` seconds from its
    launch; the CPU seconds of each side and their ratio."""
    from supervisor.commands.progress import for_run
    from supervisor.launcher import LocalLauncher
    from supervisor.orchestrator import LineageRunner, RunOptions
    from supervisor.orchestrator.options import Outcome

    policy = policy or REPO / "policies" / "presets" / "palm-spike.yaml"
    command = [sys.executable, str(CHARLM), "--size", size, "--steps", str(steps), "--eval-every", "50"]
    command += ["--device", device]
    if batch_size:
        command += ["--batch-size", str(batch_size)]
    if threads:
        command += ["--threads", str(threads)]
    lineage = f"overhead-{size}"
    budget = BudgetLauncher(LocalLauncher(), timeout_s)
    options = RunOptions(
        command=tuple(command),
        policy_path=str(policy),
        lineage=lineage,
        workdir=workdir,
        env={**QUIET_ENV, "ROLLBACK_SUPERVISOR_FAULTS": ""},
        cwd=str(REPO),
        launcher=budget,
        stop_grace_seconds=STOP_GRACE_S,
    )

    def over_budget(decision: Any, record: Any) -> Outcome | None:
        if budget.expired.is_set():  # whatever the policy says of a killed segment, the phase is over
            return Outcome("stopped", f"the overhead phase's budget of {timeout_s:g} s ran out")
        return None

    with LineageRunner(options, sleep=lambda _: None) as runner:
        runner.open()
        progress = for_run(command, policy, lineage, workdir, every=1.0)
        sup0, child0, t0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN), time.perf_counter()
        progress.start()
        budget.arm()
        try:
            record = runner.supervise(on_decision=over_budget)
        finally:
            budget.disarm()
            progress.stop()
        wall = time.perf_counter() - t0
        sup, train = _cpu(resource.RUSAGE_SELF) - sup0, _cpu(resource.RUSAGE_CHILDREN) - child0
    done = (record.segments[-1].last_step if record.segments else None) or 0
    timed_out = record.status != "finished" and budget.expired.is_set()
    if not timed_out and (record.status != "finished" or not done):
        raise BenchRunError(
            f"{lineage}: the supervised run did not finish: {record.status} ({record.final_reason}); "
            f"see {workdir}"
        )
    ratio = sup / train if train > 0 else None
    return {
        "size": size,
        "device": device,
        "batch_size": batch_size,
        "steps_asked": steps,
        "steps": done,
        "timed_out": timed_out,
        "timeout_s": timeout_s,
        "wall_s": wall,
        "supervisor_cpu_s": sup,
        "training_cpu_s": train,
        "supervisor_cpu_per_step_s": sup / done if done else None,
        "training_cpu_per_step_s": train / done if done else None,
        "targets": {"supervisor_cpu_s/training_cpu_s": target(ratio, TARGET)},
        "note": "the supervisor's CPU time over supervise() (monitor, shipper, heartbeat, lease keeper, the "
        "progress line at 1 s), against the CPU time of the training process it reaped (its imports included); "
        "timed_out: the budget ran out first, the training was killed, and the figures cover `steps` steps",
    }
