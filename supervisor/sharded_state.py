"""The sharded training state of one rank: an FSDP2 (or DDP, or plain) model and its optimizers through
`get_state_dict` / `set_state_dict`, never gathered onto one rank.

Tensors are named by key path, as in `TrainingState`: `model.<fqn>`, `optimizer.state.<fqn>.<key>` (FQNs, not
parameter indexes, so the names do not depend on the world size). Non-tensor leaves (param groups, counters)
go in the JSON skeleton; a `DTensor` is one tensor leaf, sharded as it lives.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from supervisor.data import LoaderError, Resplit, ResumableLoader
from supervisor.errors import CheckpointError
from supervisor.flatten import flatten, unflatten
from supervisor.rng import rederive, restore_rng, seed_all
from supervisor.state import TrainingState

log = logging.getLogger("rollback_supervisor.checkpoint")

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

    def checked(self) -> Callable[[str], bool]:
        """Which tensors the health mark covers: all but the model's buffers (an infinity there may be on
        purpose, as in `TrainingState.checked`)."""
        buffers = {f"model.{b}" for b in buffer_names(self.model)}
        return lambda name: name not in buffers

    def overlap_parts(self) -> tuple[list[torch.optim.Optimizer], Callable[[str], bool]]:
        """(the optimizers, which tensors only their step changes): an overlapped snapshot copies those beside
        the next forward and backward, and the rest (module buffers, which a forward may update) at once."""
        buffers = {f"model.{b}" for b in buffer_names(self.model)}
        return list(
            self.optimizers
        ), lambda name: name.startswith(("model.", "optimizer.")) and (name not in buffers)

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


def buffer_names(model: torch.nn.Module) -> set[str]:
    """The model's buffer FQNs as `get_model_state_dict` names them (DDP's "module." prefix dropped too)."""
    names = {b for b, _ in model.named_buffers(remove_duplicate=False)}
    return names | {n.removeprefix("module.") for n in names}


def pack_json(nested: Any) -> dict[str, Any]:
    """A nested state with tensors as JSON: the skeleton plus the tensors as base64 safetensors (no pickle)."""
    skeleton, tensors = flatten(nested)
    body = st_save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})
    return {"skeleton": skeleton, "tensors": base64.b64encode(body).decode("ascii")}


def unpack_json(packed: Any) -> Any:
    """The inverse of pack_json."""
    return unflatten(packed["skeleton"], st_load(base64.b64decode(packed["tensors"], validate=True)))


class SessionShardedState:
    """A Session's registered parts around one sharded model, for `ShardedCheckpoints`.

    The model (`model_name`) and every registered optimizer go through `get_*_state_dict` / `set_*_state_dict`
    (sharded, each rank its own shards); the other parts (schedulers), the counters and the extras are the
    same on every rank and go in the global state; every RNG stream and the `rank_parts` (the data loader)
    differ per rank and go in `ranks.<r>.json`.
    """

    def __init__(self, state: TrainingState, model_name: str, rank_parts: Sequence[str]):
        self.state, self.model_name, self.rank_parts = state, model_name, rank_parts
        self.model: torch.nn.Module = state[model_name]

    def _optimizers(self) -> list[str]:
        return [n for n in self.state.names if isinstance(self.state[n], torch.optim.Optimizer)]

    def state_dicts(self) -> dict[str, Any]:
        """The global nested state; the model's and optimizers' tensors are DTensors aliasing live memory."""
        nested: dict[str, Any] = {}
        optimizers = self._optimizers()
        for name in self.state.names:
            part = self.state[name]
            if name == self.model_name:
                nested[name] = get_model_state_dict(self.model, options=_OPTIONS)
            elif name in optimizers:
                nested[name] = get_optimizer_state_dict(self.model, part, options=_OPTIONS)
            elif name not in self.rank_parts:
                nested[name] = part.state_dict()
        nested["counters"] = self.state.counters()
        nested["extras"] = dict(self.state.extras)
        return nested

    def snapshot(self) -> tuple[Any, dict[str, torch.Tensor | DTensor]]:
        return flatten_sharded(self.state_dicts())

    def checked(self) -> Callable[[str], bool]:
        """Which tensors the health mark covers: all but module buffers (as `TrainingState.checked`)."""
        return self.state.checked()

    def overlap_parts(self) -> tuple[list[torch.optim.Optimizer], Callable[[str], bool]]:
        """(the registered optimizers, which tensors only their step changes: the sharded model's parameters
        and the optimizers' state); everything else (module buffers, other parts) is copied at once."""
        optimizers = self._optimizers()
        buffers = {f"{self.model_name}.{b}" for b in buffer_names(self.model)}
        prefixes = tuple(f"{n}." for n in [self.model_name, *optimizers])
        return [
            self.state[n] for n in optimizers
        ], lambda name: name.startswith(prefixes) and (name not in buffers)

    def load(self, nested: dict[str, Any]) -> None:
        """Load what a restore rebuilt into every part, the counters and the extras."""
        optimizers = self._optimizers()
        for name in self.state.names:
            if name in self.rank_parts:
                continue
            if name not in nested:
                raise CheckpointError(f"sharded checkpoint has no state for registered part {name!r}")
            if name == self.model_name:
                set_model_state_dict(self.model, nested[name], options=_OPTIONS)
            elif name in optimizers:
                set_optimizer_state_dict(self.model, self.state[name], nested[name], options=_OPTIONS)
            else:
                self.state[name].load_state_dict(nested[name])
        for key, value in nested.get("counters", {}).items():
            setattr(self.state, key, int(value))
        self.state.extras = dict(nested.get("extras", {}))

    def rank_state(self) -> dict[str, Any]:
        """This rank's RNG streams, its own parts (the data position) and its samples_seen, as JSON."""
        own = self.state.rank_state_dict(self.rank_parts)
        own["counters"] = {
            "samples_seen": int(self.state.samples_seen)
        }  # per rank: Session.loop counts its own
        return pack_json(own)

    def load_rank_state(self, saved: Any) -> None:
        own = unpack_json(saved)
        restore_rng(own["rng"])
        for name in self.rank_parts:
            self.state[name].load_state_dict(own[name])
        if "counters" in own:
            self.state.samples_seen = int(own["counters"]["samples_seen"])

    def load_rank_states_resharded(
        self, saved: Sequence[Any], saved_world: int, rank: int, world: int, step: int
    ) -> None:
        """At another world size: re-derive this rank's RNG streams and re-split the data position.

        `saved` is every saving rank's `rank_state()` (None where one wrote none). Every stream is seeded from
        `rederive(seed, step, rank, world)`; the seed is `extras["seed"]` when the run put it there, else the
        xxh3 of saved rank 0's torch RNG state, so every restore of one checkpoint at one world size draws the
        same. Each data loader reads its `resplit` share of what the saving ranks had not read this epoch, in
        as many batches as every other rank (see `supervisor.data.resplit`).
        """
        owns = []
        for old_rank, packed in enumerate(saved):
            if packed is None:
                raise CheckpointError(
                    f"the checkpoint holds no rank state for saving rank {old_rank} of {saved_world}, so its data "
                    "position cannot be re-split; restore it at the world size that saved it"
                )
            owns.append(unpack_json(packed))
        seed, seed_from = self._run_seed(owns)
        streams = seed_all(rederive(seed, step, rank, world))
        shares: list[str] = []
        for name in self.rank_parts:
            part = self.state[name]
            if not isinstance(part, ResumableLoader):
                raise LoaderError(
                    f"data part {name!r} ({type(part).__qualname__}): the checkpoint was saved by {saved_world} "
                    f"ranks and is restored on {world}, and only a supervisor.data.ResumableLoader can re-split "
                    "its position to another world size; build it as ResumableLoader(dataset, ..., rank=, "
                    "world_size=), or restore at the world size that saved it"
                )
            plan = part.resume_resplit(
                [own[name] for own in owns], saved_world, rederive(seed, step, rank, world, "data")
            )
            shares.append(_describe(name, plan, world, part.batch_size))
        counts = [int(own.get("counters", {}).get("samples_seen", -1)) for own in owns]
        self.state.samples_seen = _split_count(counts, self.state.samples_seen, rank, world)
        if rank == 0:
            log.warning(
                "Checkpoint of step %d was saved by %d ranks and is restored on %d: each rank's RNG streams (%s) "
                "are re-derived from seed %d (%s), the step, its rank and the world size; %s; from the next "
                "epoch each rank reads its own shard at world size %d; samples_seen is split so that its sum "
                "over the ranks is unchanged%s",
                step,
                saved_world,
                world,
                ", ".join(streams),
                seed,
                seed_from,
                "; ".join(shares) or "no data loader registered",
                world,
                " (the checkpoint predates per-rank counts: each saving rank is taken to have read what the "
                "saved counter, rank 0's own count, says)"
                if min(counts) < 0
                else "",
            )

    def _run_seed(self, owns: Sequence[dict[str, Any]]) -> tuple[int, str]:
        """(the run's seed, where it came from): extras["seed"], else the xxh3 of saved rank 0's torch RNG."""
        seed = self.state.extras.get("seed")
        if type(seed) is int:
            return seed, 'extras["seed"]'
        raw = owns[0]["rng"]["torch"].to(dtype=torch.uint8).numpy().tobytes()
        return xxhash.xxh3_64_intdigest(raw), "no extras['seed']: the xxh3 of saved rank 0's torch RNG state"


def _describe(name: str, plan: Resplit, world: int, batch_size: int) -> str:
    """What the re-split of data part `name` decided, with the reasons, for the one warning line."""
    q, r = plan.per_rank, plan.unread
    if not plan.in_epoch:
        said = f"data part {name!r}: the saving ranks were between epochs, so each rank starts a new one"
    elif q == 0 and r:
        said = (
            f"data part {name!r}: the {r} samples of the epoch not yet read (indices {list(plan.skipped)}) are "
            f"fewer than the {world} ranks, so no rank could read a batch of them while another read none "
            "(the ranks would end the epoch at different steps): they are SKIPPED, the re-split epoch is "
            "empty on every rank and every rank starts the next epoch"
        )
    elif q == 0:
        said = f"data part {name!r}: the saving ranks had read all of the epoch, which ends at once on every rank"
    else:
        nb = len(plan.batches)
        said = (
            f"data part {name!r}: the {r} samples of the epoch not yet read are shared out, {q} per rank"
            + (f" and one more to each of the first {r % world} ranks" if r % world else "")
            + f"; every rank reads them in {nb} batches (ceil({q}/{batch_size})), cut as evenly as possible, so "
            f"a batch holds at most {batch_size + 1} samples and every rank ends the epoch at the same step; no "
            "sample of the epoch is skipped or read twice"
        )
    if plan.dropped:
        said += (
            f"; with drop_last, the {len(plan.dropped)} samples the saving ranks' epoch ends would have dropped "
            f"are dropped (indices {list(plan.dropped)})"
        )
    return said


def _split_count(saved: Sequence[int], fallback: int, rank: int, world: int) -> int:
    """This rank's share of the saving ranks' total (their per-rank counts; -1 where a checkpoint predates
    them: `fallback`, the saved counter, is rank 0's own count, as `Session.loop` counts per rank, so each
    saving rank is taken to have read as much): the shares sum to the total."""
    total = sum(fallback if n < 0 else n for n in saved)
    return total // world + (1 if rank < total % world else 0)
