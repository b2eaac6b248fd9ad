"""The checkpoint catalogue as the decision engine sees it: one plain record per checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field


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
