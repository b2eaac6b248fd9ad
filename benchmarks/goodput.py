"""`bench goodput` runs: the real supervisor core (LineageRunner) on the example, preempted at Poisson times.

Each configuration is one lineage under a generated policy (a fixed checkpoint interval, or `adaptive: true`)
that resumes from the latest checkpoint after every preemption. A thread delivers each preemption to the
live training process group (SIGKILL: no warning; or SIGTERM: emergency checkpoint) at times drawn from a
seeded RNG, the same times for every configuration. At the end of the wall-time budget the live process is
sent SIGTERM, so everything it did is saved; useful steps are the step of the last durable checkpoint.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.common import QUIET_ENV, REPO, BenchRunError
from benchmarks.goodput_accounting import SegmentSample, account, arrivals
from benchmarks.goodput_train import COUNTERS_ENV, counter_path, read_counter

if TYPE_CHECKING:
    from policies import Decision
    from supervisor.lineage import LineageRecord
    from supervisor.orchestrator import LineageRunner, Outcome

#: The final reason of a goodput lineage, whether its budget ran out or the run broke off.
BUDGET_SPENT = "goodput benchmark budget spent"
SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}


@dataclass(frozen=True)
class Config:
    """One checkpoint cadence to measure: every N steps, or adaptive (Young/Daly) capped at N."""

    every_steps: int
    adaptive: bool = False

    @property
    def name(self) -> str:
        return f"adaptive-cap{self.every_steps}" if self.adaptive else f"every-{self.every_steps}"


def policy_text(config: Config) -> str:
    """A spot-style policy: checkpoint per `config`, resume from the latest after any preemption, no delay."""
    return f"""\
version: 1
name: goodput-{config.name}
checkpoint:
  every_steps: {config.every_steps}
  adaptive: {str(config.adaptive).lower()}
  keep_last: 2
  async: true
  memory_slots: 1
  storage: ./checkpoints
  verify: fast
monitor:
  poll_seconds: 2
  detectors:
    - {{type: non_finite, metrics: [loss]}}
    - {{type: hang, seconds: 600}}
rules:
  - when: [preemption, hardware_fault, unknown_exit, hang]
    action: resume
    target: {{select: latest}}
    allow_scratch: true
  - when: [non_finite, oom, software_error]
    action: fail
limits:
  max_rollbacks: 0
  max_restarts: 100000
  backoff: {{initial_seconds: 0, max_seconds: 0, multiplier: 1, jitter: false}}
  escalation: null
"""


class Preemptor(threading.Thread):
    """Signals the live training process at each arrival; at the deadline sends SIGTERM to end the budget.

    Each arrival goes to a process not yet signalled (it waits for the next one to start if needed), so a
    preemption is never spent on a process that is already going away.
    """

    def __init__(self, runner: LineageRunner, t0: float, offsets: list[float], deadline: float, sig: int):
        super().__init__(name="preemptor", daemon=True)
        self.runner, self.t0, self.offsets, self.deadline, self.sig = runner, t0, offsets, deadline, sig
        self.signalled: dict[int, float] = {}  # pid -> first signal time
        self.delivered: list[dict[str, Any]] = []
        self.over = threading.Event()
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def _live_pid(self, fresh: bool) -> int | None:
        segments = self.runner.record.segments
        seg = segments[-1] if segments else None
        pid = seg.pid if seg is not None and seg.ended is None else None
        return None if pid is None or (fresh and pid in self.signalled) else pid

    def _send(self, pid: int, sig: int) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        self.signalled.setdefault(pid, time.time())

    def run(self) -> None:
        for offset in self.offsets:
            if self._stop_event.wait(max(0.0, self.t0 + offset - time.time())):
                return
            while (pid := self._live_pid(fresh=True)) is None:
                if time.time() >= self.deadline or self._stop_event.wait(0.05):
                    break
            if pid is None:
                continue
            self._send(pid, self.sig)
            self.delivered.append({"at_s": time.time() - self.t0, "scheduled_s": offset, "pid": pid})
        if self._stop_event.wait(max(0.0, self.deadline - time.time())):
            return
        self.over.set()
        ended: set[int] = set()
        while not self._stop_event.is_set():
            pid = self._live_pid(fresh=False)
            if pid is not None and pid not in ended:
                self._send(pid, signal.SIGTERM)
                ended.add(pid)
            self._stop_event.wait(0.1)


def run_config(
    config: Config,
    *,
    workdir: Path,
    variant: str,
    minutes: float,
    rate_per_min: float,
    seed: int,
    size: str,
    threads: int | None,
) -> dict[str, Any]:
    """One lineage for `minutes` of wall time under Poisson preemptions; its steps and time buckets."""
    from supervisor.orchestrator import LineageRunner, Outcome, RunOptions

    lineage = f"{config.name}-{variant}"
    counters = workdir / "counters" / lineage
    counters.mkdir(parents=True, exist_ok=True)
    policy = workdir / f"{lineage}.yaml"
    policy.write_text(policy_text(config))
    command = (
        sys.executable,
        "-m",
        "benchmarks.goodput_train",
        "--size",
        size,
        "--steps",
        "1000000000",
        "--eval-every",
        "100",
    )
    if threads:
        command += ("--threads", str(threads))
    env = {
        **QUIET_ENV,
        COUNTERS_ENV: str(counters),
        "ROLLBACK_SUPERVISOR_FAULTS": "",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    options = RunOptions(
        command=command,
        policy_path=str(policy),
        lineage=lineage,
        workdir=workdir,
        env=env,
        stop_grace_seconds=60,
        cwd=str(REPO),
        max_segments=sys.maxsize,  # unbounded, as before: the time budget ends the loop, not a segment count
    )
    budget = minutes * 60.0
    offsets = arrivals(rate_per_min, budget, random.Random(seed))
    with LineageRunner(options, sleep=lambda _: None) as runner:
        runner.open()
        t0 = time.time()
        preemptor = Preemptor(runner, t0, offsets, t0 + budget, SIGNALS[variant])

        def after_segment(decision: Decision | None, record: LineageRecord) -> Outcome | None:
            if preemptor.over.is_set() or time.time() >= t0 + budget:
                return Outcome("stopped", BUDGET_SPENT)
            if decision is None or decision.action != "resume":
                raise BenchRunError(f"{lineage}: expected a resume after a preemption, got {decision}")
            return None

        preemptor.start()
        failed = True
        try:
            record = runner.supervise(on_decision=after_segment)
            failed = False
        finally:
            preemptor.stop()
            preemptor.join()
            if failed:  # as before: an error still closes the MLflow run and the record, then propagates
                runner.finish("stopped", BUDGET_SPENT)
    t_end = t0 + budget
    catalog = runner.catalog()
    latest = catalog.latest() if catalog is not None else None
    samples = [
        SegmentSample(
            launched=seg.started,
            ended=seg.ended,
            signalled=preemptor.signalled.get(seg.pid),
            counter=read_counter(counter_path(counters, seg.pid)),
        )
        for seg in record.segments
        if seg.pid
    ]
    figures = account(
        samples,
        t0,
        t_end,
        graceful=variant == "term",
        useful_steps=latest.step if latest else 0,
        rate_per_min=rate_per_min,
    )
    return {
        "config": config.name,
        "every_steps": config.every_steps,
        "adaptive": config.adaptive,
        "signal": variant,
        "preemptions": len(preemptor.delivered),
        "segments": len(samples),
        **figures,
        "preemption_times_s": [round(d["at_s"], 2) for d in preemptor.delivered],
    }


def run(
    workdir: Path,
    *,
    configs: list[Config],
    variants: list[str],
    minutes: float,
    rate_per_min: float,
    seed: int,
    size: str,
    threads: int | None,
    say=lambda _: None,
) -> list[dict[str, Any]]:
    """Every (signal variant, configuration) pair in turn, all with the same preemption times."""
    quiet = logging.getLogger("rollback_supervisor")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a warning per preemption and decision is the point here, not news
    results = []
    try:
        for variant in variants:
            for config in configs:
                say(f"{config.name} ({variant}): {minutes:g} min at {rate_per_min:g} preemptions/min")
                res = run_config(
                    config,
                    workdir=workdir,
                    variant=variant,
                    minutes=minutes,
                    rate_per_min=rate_per_min,
                    seed=seed,
                    size=size,
                    threads=threads,
                )
                say(
                    f"  goodput {res['goodput']:.3f}: {res['useful_steps']} useful of "
                    f"{res['executed_steps']} steps, {res['preemptions']} preemptions"
                )
                results.append(res)
    finally:
        quiet.setLevel(level)
    return results
