"""Pure, incremental anomaly detectors driven by `(metric, step, value, wall_time)` points.

Settings that come from a policy have no defaults here (only internal tuning, such as `rel_sigma_floor`,
does): the policy schema (`policies/monitor_schema.py`) is the one place that defines and checks them, and
`build_detectors` passes every one of them in.

Every detector keeps bounded memory per metric, reads no clock and does no I/O, so the same
code runs out of process (the MLflow watcher) and in process (the training loop's fast path).
A detector raises one event per anomaly: it latches after firing and re-arms only when the
metric is healthy again (or on `reset()`, which starts a new segment after a rollback).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from supervisor.events import Event

#: MAD -> sigma for normally distributed noise.
_MAD_TO_SIGMA = 1.4826
#: Phases in which a slow step is expected (checkpoint save, validation) rather than a stall.
TRAIN_PHASE = "train"

#: What rank 0 logs each step under torchrun for the straggler detector (`rank_step_metrics`): the slowest
#: rank's step time, the median of the other ranks' and which rank was slowest.
SLOWEST_STEP_S = "ranks/slowest_step_s"
OTHERS_STEP_S = "ranks/others_median_step_s"
SLOWEST_RANK = "ranks/slowest_rank"
RANK_METRICS = (SLOWEST_STEP_S, OTHERS_STEP_S, SLOWEST_RANK)


@dataclass(frozen=True, slots=True)
class Point:
    """One logged metric value; `segment` counts rollbacks seen by the watcher (0 before any)."""

    metric: str
    step: int
    value: float
    wall_time: float
    segment: int = 0


@runtime_checkable
class Detector(Protocol):
    """The interface every detector shares."""

    type: str
    #: Metrics this detector consumes; empty means every metric (progress for `hang`).
    metrics: frozenset[str]

    def observe(self, point: Point) -> Event | None: ...

    def reset(self) -> None: ...


def _event(kind: str, point: Point, onset: int, reason: str, evidence: dict[str, Any]) -> Event:
    return Event(
        type=kind,
        reason=reason,
        metric=point.metric,
        onset_step=onset,
        step=point.step,
        value=point.value,
        wall_time=point.wall_time,
        evidence=evidence,
    )


class NonFiniteDetector:
    """Fires on the first NaN or Inf of each metric; re-arms after a finite value."""

    type = "non_finite"

    def __init__(self, metrics: Iterable[str]):
        self.metrics = frozenset(metrics)
        self._bad: set[str] = set()

    def observe(self, point: Point) -> Event | None:
        if point.metric not in self.metrics:
            return None
        if math.isfinite(point.value):
            self._bad.discard(point.metric)
            return None
        if point.metric in self._bad:
            return None
        self._bad.add(point.metric)
        return _event(
            self.type,
            point,
            point.step,
            f"{point.metric} is {point.value} at step {point.step}",
            {"value": repr(point.value)},
        )

    def reset(self) -> None:
        self._bad.clear()


class SpikeDetector:
    """Fires when a value rises more than `sigmas` robust sigmas (median/MAD) above its rolling window.

    Outliers never enter the window, so a spike cannot widen the band that judges the next point.
    """

    type = "spike"

    def __init__(
        self,
        metric: str,
        *,
        window: int,
        sigmas: float,
        warmup_steps: int,
        min_history: int,
        rel_sigma_floor: float = 1e-3,
    ):
        self.metric = metric
        self.metrics = frozenset({metric})
        self.window, self.sigmas = window, sigmas
        self.warmup_steps, self.min_history = warmup_steps, min_history
        # A flat curve has MAD 0; without a floor any wiggle at all would count as a spike.
        self.rel_sigma_floor = rel_sigma_floor
        self._hist: deque[float] = deque(maxlen=window)
        self._onset: int | None = None

    def observe(self, point: Point) -> Event | None:
        if point.metric != self.metric or not math.isfinite(point.value):
            return None
        if len(self._hist) >= self.min_history and point.step >= self.warmup_steps:
            median = statistics.median(self._hist)
            mad = statistics.median(abs(x - median) for x in self._hist)
            sigma = max(_MAD_TO_SIGMA * mad, self.rel_sigma_floor * abs(median), 1e-12)
            score = (point.value - median) / sigma
            if score > self.sigmas:
                if self._onset is not None:
                    return None
                self._onset = point.step
                return _event(
                    self.type,
                    point,
                    point.step,
                    f"{point.metric}={point.value:.6g} at step {point.step} is {score:.1f} sigma above "
                    f"the rolling median {median:.6g} (sigma {sigma:.3g}, threshold {self.sigmas:g})",
                    {"median": median, "sigma": sigma, "score": score, "window": len(self._hist)},
                )
        self._onset = None
        self._hist.append(point.value)
        return None

    def reset(self) -> None:
        self._hist.clear()
        self._onset = None


class DivergenceDetector:
    """Fires when the rolling mean stays above `factor` x its best value for `patience` points.

    A single outlier moves a `window`-point mean by little, so only a sustained rise fires.
    Meant for positive metrics (losses): the test is a ratio to the best rolling mean.
    """

    type = "divergence"

    def __init__(self, metric: str, *, window: int, factor: float, patience: int):
        self.metric = metric
        self.metrics = frozenset({metric})
        self.window, self.factor, self.patience = window, factor, patience
        self._hist: deque[tuple[int, float]] = deque(maxlen=window)
        self._best = math.inf
        self._best_step: int | None = None
        self._streak = 0
        self._fired = False

    def observe(self, point: Point) -> Event | None:
        if point.metric != self.metric or not math.isfinite(point.value):
            return None
        self._hist.append((point.step, point.value))
        if len(self._hist) < self.window:
            return None
        mean = math.fsum(v for _, v in self._hist) / len(self._hist)
        if mean < self._best:
            self._best, self._best_step = mean, point.step
        limit = self.factor * self._best
        if mean <= limit:
            self._streak, self._fired = 0, False
            return None
        self._streak += 1
        if self._streak < self.patience or self._fired:
            return None
        self._fired = True
        onset = self._onset(limit)
        return _event(
            self.type,
            point,
            onset,
            f"rolling mean of {point.metric} ({mean:.6g} over {self.window} points) has stayed above "
            f"{self.factor:g} x best ({self._best:.6g} at step {self._best_step}) for {self._streak} points",
            {
                "rolling_mean": mean,
                "best_mean": self._best,
                "best_step": self._best_step,
                "limit": limit,
                "window": self.window,
                "streak": self._streak,
            },
        )

    def _onset(self, limit: float) -> int:
        """Earliest step above `limit` from which the mean of the rest of the window stays above it."""
        onset = self._hist[-1][0]
        total, count = 0.0, 0
        for step, value in reversed(self._hist):
            total += value
            count += 1
            if value > limit and total / count > limit:
                onset = step
        return onset

    def reset(self) -> None:
        self._hist.clear()
        self._best, self._best_step = math.inf, None
        self._streak, self._fired = 0, False


class ThresholdDetector:
    """Fires when a value leaves `[below, above]`; re-arms once it is back inside."""

    type = "threshold"

    def __init__(self, metric: str, *, above: float | None, below: float | None):
        self.metric = metric
        self.metrics = frozenset({metric})
        self.above, self.below = above, below
        self._onset: int | None = None

    def observe(self, point: Point) -> Event | None:
        if point.metric != self.metric or not math.isfinite(point.value):
            return None
        if self.above is not None and point.value > self.above:
            bound = f"above {self.above:g}"
        elif self.below is not None and point.value < self.below:
            bound = f"below {self.below:g}"
        else:
            self._onset = None
            return None
        if self._onset is not None:
            return None
        self._onset = point.step
        return _event(
            self.type,
            point,
            point.step,
            f"{point.metric}={point.value:.6g} at step {point.step} is {bound}",
            {"above": self.above, "below": self.below},
        )

    def reset(self) -> None:
        self._onset = None


class PlateauDetector:
    """Fires after `patience` observations of a metric without an improvement larger than `min_delta`."""

    type = "plateau"

    def __init__(self, metric: str, *, mode: str, patience: int, min_delta: float):
        self.metric = metric
        self.metrics = frozenset({metric})
        self.mode, self.patience, self.min_delta = mode, patience, min_delta
        self._best: float | None = None
        self._best_step: int | None = None
        self._wait = 0
        self._onset: int | None = None
        self._fired = False

    def _improves(self, value: float) -> bool:
        if self._best is None:
            return True
        if self.mode == "min":
            return value < self._best - self.min_delta
        return value > self._best + self.min_delta

    def observe(self, point: Point) -> Event | None:
        if point.metric != self.metric or not math.isfinite(point.value):
            return None
        if self._improves(point.value):
            self._best, self._best_step = point.value, point.step
            self._wait, self._onset, self._fired = 0, None, False
            return None
        self._wait += 1
        if self._onset is None:
            self._onset = point.step
        if self._wait < self.patience or self._fired:
            return None
        self._fired = True
        return _event(
            self.type,
            point,
            self._onset,
            f"{point.metric} has not improved by more than {self.min_delta:g} on its best "
            f"{self._best:.6g} (step {self._best_step}) for {self._wait} observations",
            {"best": self._best, "best_step": self._best_step, "observations": self._wait, "mode": self.mode},
        )

    def reset(self) -> None:
        self._best = self._best_step = self._onset = None
        self._wait, self._fired = 0, False


def rank_step_metrics(step_s: Sequence[float]) -> dict[str, float]:
    """The straggler detector's three metrics from every rank's step time (none for fewer than 2 ranks)."""
    if len(step_s) < 2:
        return {}
    slowest = max(range(len(step_s)), key=step_s.__getitem__)
    others = [t for rank, t in enumerate(step_s) if rank != slowest]
    return {
        SLOWEST_STEP_S: step_s[slowest],
        OTHERS_STEP_S: statistics.median(others),
        SLOWEST_RANK: float(slowest),
    }


class StragglerDetector:
    """Fires when one rank's step time is `factor` x the other ranks' median for `patience` consecutive steps.

    Reads the three `RANK_METRICS` of each step (in any order; a step missing one is skipped). The slowest
    rank must also be `min_gap_seconds` slower than the median, since tiny steps jitter by large factors.
    Latches after firing; re-arms once that rank keeps up again (or another rank is the slow one).
    """

    type = "straggler"

    def __init__(self, *, factor: float, patience: int, min_gap_seconds: float):
        self.metrics = frozenset(RANK_METRICS)
        self.factor, self.patience, self.min_gap_seconds = factor, patience, min_gap_seconds
        self.reset()

    def reset(self) -> None:
        self._step: int | None = None
        self._values: dict[str, float] = {}
        self._rank: int | None = None  # the rank of the current streak
        self._onset: int | None = None
        self._streak = 0
        self._fired = False

    def observe(self, point: Point) -> Event | None:
        if point.metric not in self.metrics:
            return None
        if point.step != self._step:
            self._step, self._values = point.step, {}
        self._values[point.metric] = point.value
        if len(self._values) < len(self.metrics):
            return None
        step_s, median = self._values[SLOWEST_STEP_S], self._values[OTHERS_STEP_S]
        rank = int(self._values[SLOWEST_RANK])
        self._values = {}  # judged: a repeated point of this step is not judged twice
        slow = step_s >= self.factor * median and step_s - median >= self.min_gap_seconds
        if not slow:
            self._rank, self._onset, self._streak, self._fired = None, None, 0, False
            return None
        if rank != self._rank:
            self._rank, self._onset, self._streak, self._fired = rank, point.step, 0, False
        self._streak += 1
        if self._streak < self.patience or self._fired:
            return None
        self._fired = True
        ratio = step_s / median if median > 0 else math.inf
        return Event(
            type=self.type,
            reason=f"rank {rank} took {step_s:.3g} s per step, {ratio:.1f} x the other ranks' median "
            f"({median:.3g} s), for {self._streak} steps (factor {self.factor:g})",
            metric=SLOWEST_STEP_S,
            onset_step=self._onset,
            step=point.step,
            value=step_s,
            wall_time=point.wall_time,
            evidence={
                "rank": rank,
                "step_s": step_s,
                "median_s": median,
                "ratio": ratio,
                "factor": self.factor,
                "streak": self._streak,
            },
        )


class HangDetector:
    """Fires when no progress has been seen for `seconds` (`phase_grace_seconds` outside phase "train").

    Progress is any observed point or an explicit `progress(now, ...)` (a heartbeat). The detector
    never reads a clock: points are credited at the next `check(now)`, on the caller's clock.
    """

    type = "hang"

    def __init__(self, seconds: float, phase_grace_seconds: float | None = None):
        self.metrics: frozenset[str] = frozenset()
        self.seconds = seconds
        # Checkpoint saves and validation are slow but not stuck; they get a longer leash.
        self.phase_grace_seconds = phase_grace_seconds if phase_grace_seconds is not None else 3 * seconds
        self.reset()

    def reset(self) -> None:
        self._last_progress: float | None = None
        self._pending = True
        self._last_step: int | None = None
        self._phase: str | None = None
        self._fired = False

    def observe(self, point: Point) -> Event | None:
        self._pending = True
        if self._last_step is None or point.step > self._last_step:
            self._last_step = point.step
        return None

    def progress(self, now: float, *, step: int | None = None, phase: str | None = None) -> None:
        """Record progress seen at `now` (e.g. a changed heartbeat), optionally with its step and phase."""
        self._last_progress, self._pending, self._fired = now, False, False
        if step is not None and (self._last_step is None or step > self._last_step):
            self._last_step = step
        if phase is not None:
            self._phase = phase

    def timeout(self) -> float:
        """The silence allowed in the current phase."""
        if self._phase in (None, TRAIN_PHASE):
            return self.seconds
        return max(self.seconds, self.phase_grace_seconds)

    def check(self, now: float) -> Event | None:
        if self._pending or self._last_progress is None:
            self._last_progress, self._pending, self._fired = now, False, False
            return None
        silent = now - self._last_progress
        limit = self.timeout()
        if silent <= limit or self._fired:
            return None
        self._fired = True
        phase = self._phase or TRAIN_PHASE
        return Event(
            type=self.type,
            reason=f"no progress for {silent:.0f} s (limit {limit:g} s in phase {phase}); "
            f"last step seen {self._last_step}",
            onset_step=self._last_step,
            step=self._last_step,
            value=silent,
            evidence={"silent_seconds": silent, "timeout_seconds": limit, "phase": phase},
        )
