"""The checkpoint catalogue as the decision engine sees it: one plain record per checkpoint."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint: id, step saved at, metrics logged with it, whether it verified, whether it is healthy."""

    id: str
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    valid: bool = True
    wall_time: float | None = None
    healthy: bool = True
    """False when the state held a NaN or an infinity when saved: no target unless checkpoint.allow_nonfinite."""


def to_records(infos: Iterable[Any], invalid: Iterable[str] = ()) -> list[CheckpointRecord]:
    """The store's checkpoint infos (`supervisor.checkpoint.CheckpointInfo`) as the engine's catalogue:
    abandoned or `invalid` ones not valid, unhealthy ones marked."""
    bad = set(invalid)
    return [
        CheckpointRecord(
            i.id,
            i.step,
            dict(i.metrics),
            valid=not i.abandoned and i.id not in bad,
            wall_time=i.wall_time,
            healthy=i.healthy,
        )
        for i in infos
    ]
