"""When to checkpoint: every N steps, every T seconds, or adaptively (Young/Daly). Pure; the caller passes time."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from supervisor.events import METRIC_EVENTS

#: The least lineage time the failure rate is estimated over: a run seconds old has not yet shown that it is
#: reliable, but checkpointing as if it failed every few seconds would cost more than it could save.
MIN_OBSERVED_S = 60.0


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal checkpoint interval, sqrt(2 * C * MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * max(save_cost_s, 1e-6) * max(mtbf_s, 1e-6))


def estimate_mtbf(observed_s: float, failures: int) -> float:
    """Mean time between failures from `failures` seen in `observed_s` seconds of the lineage.

    With no failure yet the estimate is the time observed so far: the run has lasted that long, and assuming
    more would stretch the interval on no evidence. It grows as the run keeps going, so a reliable machine
    checkpoints less and less often (up to the `every_steps` cap).
    """
    return max(observed_s, MIN_OBSERVED_S) / max(1, failures)


def failures_in(history: Any) -> int:
    """Failures for the MTBF: every event that ended a process (a preemption with an emergency checkpoint
    too: the restart is what costs), not metric anomalies (a rollback to a policy-chosen checkpoint, whatever
    the cadence). `history` holds the lineage's records, each with an `event`."""
    return sum(1 for e in history if e.event.type not in METRIC_EVENTS)


@dataclass
class Cadence:
    """Decides whether a checkpoint is due after a step.

    With `adaptive`, the interval in seconds is Young/Daly from the measured save cost (what training is
    blocked per save) and the failure rate (`failures` seen in the lineage's running time so far, of which
    `observed_s` passed in earlier segments), converted to steps with the measured step time and capped by
    `every_steps`. A segment that has not saved yet saves after its first timed step, to measure the cost.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    adaptive: bool = False
    failures: int = 0
    observed_s: float = 0.0
    _started: float | None = None
    _last_step: int = 0
    _last_time: float | None = None
    _save_cost: float | None = None
    _step_time: float | None = None
    _prev_time: float | None = field(default=None, repr=False)
    _recent: deque = field(default_factory=lambda: deque(maxlen=50), repr=False)

    def start(self, step: int, now: float) -> None:
        """(Re)start counting at `step` (after a restore); the segment's age keeps counting from the first start."""
        self._last_step, self._last_time, self._prev_time = step, now, now
        if self._started is None:
            self._started = now

    def mtbf_s(self, now: float) -> float:
        """The failure-rate estimate at `now` (see `estimate_mtbf`)."""
        since = now - self._started if self._started is not None else 0.0
        return estimate_mtbf(self.observed_s + max(0.0, since), self.failures)

    def observe_step(self, now: float) -> None:
        if self._prev_time is not None and now > self._prev_time:
            self._recent.append(now - self._prev_time)
            self._step_time = sum(self._recent) / len(self._recent)
        self._prev_time = now

    def observe_save(self, blocked_s: float) -> None:
        self._save_cost = blocked_s if self._save_cost is None else 0.7 * self._save_cost + 0.3 * blocked_s

    def interval_steps(self, now: float) -> int | None:
        """The step interval at `now` (adaptive or fixed); None when only time triggers saves."""
        if not self.adaptive or not self._step_time:
            return self.every_steps
        if self._save_cost is None:
            return 1  # save once now, to measure what a save costs, rather than wait for the cap
        seconds = young_daly_interval(self._save_cost, self.mtbf_s(now))
        steps = max(1, round(seconds / self._step_time))
        return min(steps, self.every_steps) if self.every_steps else steps

    def due(self, step: int, now: float) -> bool:
        interval = self.interval_steps(now)
        by_steps = interval is not None and step - self._last_step >= interval
        by_time = (
            self.every_seconds is not None
            and self._last_time is not None
            and now - self._last_time >= self.every_seconds
        )
        if self.adaptive or self.every_seconds is not None:
            return by_steps or by_time
        return interval is not None and step % interval == 0

    def saved(self, step: int, now: float) -> None:
        self._last_step, self._last_time = step, now
