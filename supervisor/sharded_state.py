"""The sharded training state of one rank: an FSDP2 (or DDP, or plain) model and its optimizers through
`get_state_dict` / `set_state_dict`, never gathered onto one rank.

Tensors are named by key path, as in `TrainingState`: `model.<fqn>`, `optimizer.state.<fqn>.<key>` (FQNs, not
parameter indexes, so the names do not depend on the world size). Non-tensor leaves (param groups, counters)
go in the JSON skeleton; a `DTensor` is one tensor leaf, sharded as it lives.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from supervisor.flatten import flatten

#: Sharded state dicts (no gather, no CPU offload): each rank sees only its own shards.
_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def flatten_sharded(nested: Any) -> tuple[Any, dict[str, torch.Tensor | DTensor]]:
    """`flatten` for a state holding DTensors: each DTensor is a tensor leaf of the result, as it is."""
    stand_ins: dict[int, DTensor] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, DTensor):
            stand_in = torch.empty(0)  # a plain tensor flatten accepts; swapped back by identity below
            stand_ins[id(stand_in)] = value
            return stand_in
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(swap(v) for v in value)
        return value

    skeleton, tensors = flatten(swap(nested))
    return skeleton, {name: stand_ins.get(id(t), t) for name, t in tensors.items()}


class ShardedTrainingState:
    """One model and its optimizers, checkpointed shard by shard on every rank (FSDP2, DDP or a plain module)."""

    def __init__(
        self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
    ):
        self.model = model
        self.optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)

    def state_dicts(self) -> dict[str, Any]:
        """{"model": ..., "optimizer": ...}: sharded state dicts aliasing live memory (optimizer state is
        created first if no step has run)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=_OPTIONS)
        return {"model": model_sd, "optimizer": optim_sd}

    def snapshot(self) -> tuple[Any, dict[str, torch.Tensor | DTensor]]:
        """(JSON skeleton, {name: Tensor | DTensor}); the tensors alias live memory."""
        return flatten_sharded(self.state_dicts())

    def load(self, nested: dict[str, Any]) -> None:
        """Load what a restore rebuilt (tensors already filled in place) back into model and optimizers."""
        set_state_dict(
            self.model,
            self.optimizers,
            model_state_dict=nested["model"],
            optim_state_dict=nested["optimizer"],
            options=_OPTIONS,
        )

    def rank_state(self) -> dict[str, Any]:
        """This rank's own streams: the torch CPU RNG state, base64 in JSON (never a pickle)."""
        return {"torch_rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii")}

    def load_rank_state(self, saved: Any) -> None:
        """Put back what rank_state() gave (at the same world size)."""
        raw = base64.b64decode(saved["torch_rng"], validate=True)
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
