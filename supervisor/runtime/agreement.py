"""Under DDP, what every rank does after a step is agreed by one all_reduce(MAX): no rank is left behind.

Each rank brings its own view (an anomaly seen, a stop requested, a save due, its write in flight: rank 0's
alone, or with sharded checkpoints each rank's own writer); every rank gets the same merged answer (the maximum
of each flag), so all of them stop, save or go on together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from supervisor.runtime.stops import StopMode

#: The element-wise maximum of the flags over every rank (`Distributed.agree`).
Reduce = Callable[..., tuple[int, ...]]


@dataclass(frozen=True)
class StepView:
    """One rank's view of the step that ended (or, from `agree`, every rank's merged)."""

    anomaly: bool = False
    stop: StopMode | None = None
    save_due: bool = False
    writing: bool = False

    def flags(self) -> tuple[int, int, int, int]:
        stop = 0 if self.stop is None else int(self.stop)
        return int(self.anomaly), stop, int(self.save_due), int(self.writing)

    @classmethod
    def from_flags(cls, anomaly: int, stop: int, save_due: int, writing: int) -> StepView:
        return cls(bool(anomaly), StopMode(stop) if stop else None, bool(save_due), bool(writing))

    @property
    def save(self) -> bool:
        """Whether the ranks save now: one wants to, no rank is still writing, and nobody stops."""
        return self.save_due and not self.writing and self.stop is None and not self.anomaly


class Agreement:
    """The one collective per step; `stopped` once the ranks agreed to stop (they leave the loop together)."""

    def __init__(self, reduce: Reduce):
        self._reduce = reduce
        self.stopped = False

    def agree(self, mine: StepView) -> StepView:
        merged = StepView.from_flags(*self._reduce(*mine.flags()))
        if merged.anomaly or merged.stop is not None:
            self.stopped = True
        return merged
