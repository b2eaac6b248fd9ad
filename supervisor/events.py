"""The event vocabulary shared by detectors, the classifier, the policy engine and the flow."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

EventType = Literal[
    "non_finite",
    "spike",
    "divergence",
    "threshold",
    "plateau",
    "hang",
    "straggler",
    "preemption",
    "hardware_fault",
    "oom",
    "software_error",
    "unknown_exit",
]

#: Every event type a policy may name in `when:`.
EVENT_TYPES: tuple[str, ...] = EventType.__args__  # type: ignore[attr-defined]

#: Events found in metrics (the training math went wrong, or, for `straggler`, one rank's step times).
METRIC_EVENTS = frozenset({"non_finite", "spike", "divergence", "threshold", "plateau", "straggler"})
#: Events found from the process (the machine or the program went wrong).
PROCESS_EVENTS = frozenset({"hang", "preemption", "hardware_fault", "oom", "software_error", "unknown_exit"})


@dataclass(frozen=True)
class Event:
    """One anomaly or fault, with the evidence that decided it."""

    type: str
    reason: str
    metric: str | None = None
    onset_step: int | None = None  # first step of the anomaly, not the step it was noticed at
    step: int | None = None  # step at which it was noticed
    value: float | None = None
    wall_time: float | None = None
    source: str = "monitor"  # monitor | in_process | exit | notice
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Event:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
