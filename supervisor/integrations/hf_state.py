"""The HF Trainer's `TrainerState` as a stateful part: JSON only, nothing the Trainer would pickle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerState

#: TrainerState fields a resume restores (the rest the Trainer computes from its arguments).
TRAINER_STATE_FIELDS = (
    "global_step",
    "epoch",
    "total_flos",
    "num_input_tokens_seen",
    "best_metric",
    "best_global_step",
    "best_model_checkpoint",
)
#: How many of the latest `log_history` entries a checkpoint keeps (all of them are in MLflow).
LOG_HISTORY_KEPT = 200


class TrainerStatePart:
    """The `TrainerState` as JSON (see TRAINER_STATE_FIELDS) and the exportable callbacks' attributes."""

    def __init__(self, state: TrainerState, callbacks: list[Any]):
        self.state, self.callbacks = state, callbacks

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {f: getattr(self.state, f) for f in TRAINER_STATE_FIELDS}
        out["log_history"] = [dict(entry) for entry in (self.state.log_history or [])[-LOG_HISTORY_KEPT:]]
        out["callbacks"] = {type(cb).__name__: cb.state()["attributes"] for cb in self.callbacks}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in TRAINER_STATE_FIELDS:
            setattr(self.state, field, state[field])
        self.state.log_history = [dict(entry) for entry in state["log_history"]]
        saved = state.get("callbacks") or {}
        for cb in self.callbacks:
            for key, value in (saved.get(type(cb).__name__) or {}).items():
                setattr(cb, key, value)
