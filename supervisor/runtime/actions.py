"""What the training-side core answers after a step: continue, save, rolled back, or stop."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Continue:
    """Train the next step."""


@dataclass(frozen=True)
class SaveDue:
    """A checkpoint of `step` is due: the driver calls `TrainingCore.save(step, metrics)` before going on."""

    step: int


@dataclass(frozen=True)
class Rollback:
    """The core rolled the state back in process to `target_id` (now at `step`): restart the data iterator."""

    target_id: str
    step: int
    skip_batches: int
    lr_scale: float


@dataclass(frozen=True)
class Stop:
    """Leave the loop; if `checkpoint`, the driver first writes the emergency checkpoint (`TrainingCore.save()`
    then `wait()`), and in any case reports the stop with `TrainingCore.stopped()`."""

    reason: str
    exit_code: int
    checkpoint: bool


Action = Continue | SaveDue | Rollback | Stop

#: The one Continue (it carries nothing).
CONTINUE = Continue()
