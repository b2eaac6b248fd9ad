"""What the engine decided about one event, as a plain immutable record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.events import Event

ActionName = Literal["resume", "rollback", "stop", "fail", "warn"]


@dataclass(frozen=True, kw_only=True)
class Decision:
    """One decision: what to do, from which checkpoint, with what data skip, LR factor and delay, and why.

    `lr_scale` is this decision's own factor, applied on top of the learning rate restored from the target
    checkpoint (1.0 = unchanged); it is not a product over earlier rollbacks.
    A relaunch (`resume`/`rollback`) with `target_id` None restarts from scratch at step 0. `warn` names no
    target: training goes on where it is.
    `fallback` is True when the rule's target matched no checkpoint and the newest one the rule may relaunch from
    was taken instead (the reason says why); it is written only when True, so older records read back unchanged.
    """

    action: ActionName
    target_id: str | None = None
    target_step: int | None = None
    skip_batches: int = 0
    lr_scale: float = 1.0
    delay_seconds: float = 0.0
    reason: str
    rule_index: int | None = None
    event: Event
    fallback: bool = False

    @property
    def relaunches(self) -> bool:
        """True for resume and rollback: the run goes on in a new process."""
        return self.action in ("resume", "rollback")

    @property
    def from_scratch(self) -> bool:
        """True when the run relaunches with no checkpoint to restore."""
        return self.relaunches and self.target_id is None

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["event"] = self.event.to_dict()
        if not self.fallback:
            del data["fallback"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Decision:
        names = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in names}
        fields["event"] = Event.from_dict(data["event"])
        return cls(**fields)
