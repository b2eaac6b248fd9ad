"""The save cadence's record: last save, step time, save cost and failure rate, fed to a SavePolicy.

Pure: the caller passes the time. What decides is `supervisor.runtime.save_policy`; this keeps what the
decision context is built from.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from supervisor.events import METRIC_EVENTS
from supervisor.runtime.save_policy import (
    MIN_OBSERVED_S,
    SaveContext,
    SavePolicy,
    build_save_policy,
    young_daly_interval,
)

if TYPE_CHECKING:
    from policies import History

__all__ = ["MIN_OBSERVED_S", "Cadence", "estimate_mtbf", "failures_in", "young_daly_interval"]

#: How many recent steps the step time is averaged over.
STEP_WINDOW = 50
#: Weight of the newest measurement in the smoothed save cost.
SAVE_COST_WEIGHT = 0.3


def estimate_mtbf(observed_s: float, failures: int) -> float:
    """Mean time between failures from `failures` seen in `observed_s` seconds of the lineage.

    With no failure yet the estimate is the time observed so far: the run has lasted that long, and assuming
    more would stretch the interval on no evidence. It grows as the run keeps going, so a reliable machine
    checkpoints less and less often (up to the `every_steps` cap).
    """
    return max(observed_s, MIN_OBSERVED_S) / max(1, failures)


def failures_in(history: History) -> int:
    """Failures for the MTBF: every event that ended a process (a preemption with an emergency checkpoint
    too: the restart is what costs), not metric anomalies (a rollback to a policy-chosen checkpoint, whatever
    the cadence). `history` holds the lineage's records, each with an `event`."""
    return sum(1 for e in history if e.event.type not in METRIC_EVENTS)


class Cadence:
    """Decides whether a checkpoint is due after a step, by a SavePolicy over what it has measured.

    `policy` (default: built from the other arguments, the policy file's `checkpoint:` section) is the one
    place that decides, the "still writing" deferral included: the caller always says whether a write is in
    flight.

    With `adaptive`, the interval is Young/Daly from the measured save cost (what training is blocked per
    save) and the failure rate (`failures` seen in the lineage's running time so far, of which `observed_s`
    passed in earlier segments), converted to steps with the measured step time and capped by `every_steps`.
    Not thread-safe: the training thread owns it.
    """

    def __init__(
        self,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        adaptive: bool = False,
        failures: int = 0,
        observed_s: float = 0.0,
        *,
        keep_every_steps: int | None = None,
        policy: SavePolicy | None = None,
    ):
        self.every_steps, self.every_seconds, self.adaptive = every_steps, every_seconds, adaptive
        self.failures, self.observed_s = failures, observed_s
        self.policy = policy or build_save_policy(every_steps, every_seconds, adaptive, keep_every_steps)
        self._started: float | None = None
        self._last_step = 0
        self._last_time: float | None = None
        self._save_cost: float | None = None
        self._step_time: float | None = None
        self._prev_time: float | None = None
        self._recent: deque[float] = deque(maxlen=STEP_WINDOW)

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
        """A step ended at `now`."""
        if self._prev_time is not None and now > self._prev_time:
            self._recent.append(now - self._prev_time)
            self._step_time = sum(self._recent) / len(self._recent)
        self._prev_time = now

    def observe_save(self, blocked_s: float) -> None:
        """A save blocked training for `blocked_s`."""
        if self._save_cost is None:
            self._save_cost = blocked_s
        else:
            self._save_cost = (1 - SAVE_COST_WEIGHT) * self._save_cost + SAVE_COST_WEIGHT * blocked_s

    def saved(self, step: int, now: float) -> None:
        self._last_step, self._last_time = step, now

    def context(
        self, step: int, now: float, *, writing: bool = False, stopping: bool = False, final: bool = False
    ) -> SaveContext:
        """The decision context for `step` ending at `now`."""
        return SaveContext(
            step=step,
            now=now,
            last_save_step=self._last_step,
            last_save_time=self._last_time,
            writing=writing,
            stopping=stopping,
            final=final,
            step_time_s=self._step_time,
            save_cost_s=self._save_cost,
            mtbf_s=self.mtbf_s(now),
        )

    def interval_steps(self, now: float) -> int | None:
        """The policy's step interval at `now` (adaptive or fixed); None when only time triggers saves."""
        return self.policy.interval_steps(self.context(self._last_step, now))

    @property
    def defers_while_writing(self) -> bool:
        """Whether a write in flight alone holds a save back (rank 0 tells the other ranks under DDP)."""
        return self.policy.defers_while_writing

    def due(
        self, step: int, now: float, *, writing: bool = False, stopping: bool = False, final: bool = False
    ) -> bool:
        return self.policy.should_save(
            self.context(step, now, writing=writing, stopping=stopping, final=final)
        )
