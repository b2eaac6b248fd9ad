"""When to checkpoint: every N steps, every T seconds, or adaptively (Young/Daly). Pure; the caller passes time."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal checkpoint interval, sqrt(2 * C * MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * max(save_cost_s, 1e-6) * max(mtbf_s, 1e-6))


@dataclass
class Cadence:
    """Decides whether a checkpoint is due after a step.

    With `adaptive`, the interval in seconds is Young/Daly from the measured save cost (what training is
    blocked per save) and the failure rate (`mtbf_s`, from the lineage history), converted to steps with the
    measured step time and capped by `every_steps`.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    adaptive: bool = False
    mtbf_s: float = 3600.0
    _last_step: int = 0
    _last_time: float | None = None
    _save_cost: float | None = None
    _step_time: float | None = None
    _prev_time: float | None = field(default=None, repr=False)
    _recent: deque = field(default_factory=lambda: deque(maxlen=50), repr=False)

    def start(self, step: int, now: float) -> None:
        self._last_step, self._last_time, self._prev_time = step, now, now

    def observe_step(self, now: float) -> None:
        if self._prev_time is not None and now > self._prev_time:
            self._recent.append(now - self._prev_time)
            self._step_time = sum(self._recent) / len(self._recent)
        self._prev_time = now

    def observe_save(self, blocked_s: float) -> None:
        self._save_cost = blocked_s if self._save_cost is None else 0.7 * self._save_cost + 0.3 * blocked_s

    def interval_steps(self) -> int | None:
        """The current step interval (adaptive or fixed); None when only time triggers saves."""
        if not self.adaptive or self._save_cost is None or not self._step_time:
            return self.every_steps
        steps = max(1, round(young_daly_interval(self._save_cost, self.mtbf_s) / self._step_time))
        return min(steps, self.every_steps) if self.every_steps else steps

    def due(self, step: int, now: float) -> bool:
        interval = self.interval_steps()
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
