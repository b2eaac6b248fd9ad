"""Checkpoint selectors: small callables `(catalogue, event) -> record | None` that read like English.

    latest()                                   the newest valid checkpoint
    best("val_loss", "min")                    the valid checkpoint with the lowest val_loss
    before(100)                                the newest valid checkpoint at least 100 steps before onset
    best_before("val_loss", "min", 100)        the best of those

None of them ever returns an invalid checkpoint. "Onset" is the event's `onset_step`, else its `step`;
an event with neither is measured from the newest valid checkpoint.

Steps: checkpoint step s is the state after s optimizer updates, saved after step s. The metrics logged at step s
were computed before step s's update, from the state after s - 1 updates, i.e. by checkpoint s - 1. So an
anomaly whose first bad metric is at step `onset` came from the state of checkpoint onset - 1: a rollback
target is at most step onset - 2 (`last_clean_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from policies.records import CheckpointRecord
from supervisor.events import Event

Selector = Callable[[Sequence[CheckpointRecord], Event], "CheckpointRecord | None"]


def onset_of(event: Event) -> int | None:
    """The first step of the anomaly: `onset_step`, else the step it was noticed at, else None."""
    return event.onset_step if event.onset_step is not None else event.step


def last_clean_step(onset: int) -> int:
    """The newest checkpoint step whose state did not produce the anomaly first seen at step `onset`."""
    return onset - 2


def _valid(catalogue: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    return [c for c in catalogue if c.valid]


def _newest(records: Sequence[CheckpointRecord]) -> CheckpointRecord | None:
    # ties on step go to the larger id so the choice never depends on catalogue order
    return max(records, key=lambda c: (c.step, c.id), default=None)


def _best(records: Sequence[CheckpointRecord], metric: str, mode: str) -> CheckpointRecord | None:
    scored = [c for c in records if _finite(c.metrics.get(metric))]
    sign = 1.0 if mode == "min" else -1.0
    # among equal scores prefer the newest: it loses the least work
    return min(scored, key=lambda c: (sign * c.metrics[metric], -c.step, c.id), default=None)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def cutoff_step(catalogue: Sequence[CheckpointRecord], event: Event, lookback_steps: int) -> int | None:
    """The newest step a checkpoint may have to count as `lookback_steps` before the onset."""
    anchor = onset_of(event)
    if anchor is None:
        newest = _newest(_valid(catalogue))
        if newest is None:
            return None
        anchor = newest.step
    return anchor - lookback_steps


@dataclass(frozen=True)
class latest:
    """Select the newest valid checkpoint."""

    def __call__(self, catalogue: Sequence[CheckpointRecord], event: Event) -> CheckpointRecord | None:
        return _newest(_valid(catalogue))

    def __str__(self) -> str:
        return "latest()"


@dataclass(frozen=True)
class best:
    """Select the valid checkpoint with the best value of `metric`."""

    metric: str
    mode: Literal["min", "max"] = "min"

    def __call__(self, catalogue: Sequence[CheckpointRecord], event: Event) -> CheckpointRecord | None:
        return _best(_valid(catalogue), self.metric, self.mode)

    def __str__(self) -> str:
        return f"best({self.metric}, {self.mode})"


@dataclass(frozen=True)
class before:
    """Select the newest valid checkpoint at least `lookback_steps` before the anomaly's onset."""

    lookback_steps: int

    def __call__(self, catalogue: Sequence[CheckpointRecord], event: Event) -> CheckpointRecord | None:
        cutoff = cutoff_step(catalogue, event, self.lookback_steps)
        if cutoff is None:
            return None
        return _newest([c for c in _valid(catalogue) if c.step <= cutoff])

    def __str__(self) -> str:
        return f"before(lookback_steps={self.lookback_steps})"


@dataclass(frozen=True)
class best_before:
    """Select the best valid checkpoint by `metric` among those at least `lookback_steps` before the onset."""

    metric: str
    mode: Literal["min", "max"] = "min"
    lookback_steps: int = 0

    def __call__(self, catalogue: Sequence[CheckpointRecord], event: Event) -> CheckpointRecord | None:
        cutoff = cutoff_step(catalogue, event, self.lookback_steps)
        if cutoff is None:
            return None
        return _best([c for c in _valid(catalogue) if c.step <= cutoff], self.metric, self.mode)

    def __str__(self) -> str:
        return f"best_before({self.metric}, {self.mode}, lookback_steps={self.lookback_steps})"


@dataclass(frozen=True)
class custom:
    """A user selector named in YAML as "module:function", called as `function(catalogue, event, **options)`."""

    name: str
    function: Callable[..., CheckpointRecord | None] = field(compare=False)
    options: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, catalogue: Sequence[CheckpointRecord], event: Event) -> CheckpointRecord | None:
        return self.function(catalogue, event, **self.options)

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{self.name}({opts})" if opts else f"{self.name}()"
