"""The checkpoint catalogue as the decision engine sees it: one plain record per checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint: its id, the step it was saved at, the metrics logged with it, and whether it verified."""

    id: str
    step: int
    metrics: dict[str, float] = field(default_factory=dict)
    valid: bool = True
    wall_time: float | None = None
