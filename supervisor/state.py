"""Training-state registry: named stateful parts, every RNG stream, counters and extras as one nested state.

Key paths name every leaf: "<part>.<key>..." ("model.encoder.weight", "optimizer.param_groups.0.lr"),
"rng.torch", "counters.step", "extras.<name>". Partial restores select leaves by key-path prefix.
Under DDP, "ranks.<rank>.<rng|part>..." holds what differs per rank; each rank restores its own entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from supervisor.errors import CheckpointError, UserError
from supervisor.flatten import child_path, could_match, flatten, leaf_paths, matches, overlay
from supervisor.rng import capture_rng, restore_rng
from supervisor.rng import rank_seed as rank_seed  # re-exported: the public place scripts import it from
from supervisor.stateful import Stateful

log = logging.getLogger("rollback_supervisor.checkpoint")

RESERVED = ("rng", "counters", "extras", "ranks")
COUNTERS = ("step", "epoch", "samples_seen")


class StateNameError(UserError, ValueError):
    """A part was registered under a name that cannot be used."""


class TrainingState:
    """Everything a bit-exact resume needs: registered parts, RNG streams, counters and extras.

    Register anything with state_dict()/load_state_dict(): models, optimizers, schedulers, GradScaler,
    the data loader (a torch DataLoader is kept in its exact form or refused: `supervisor.data.loader_part`).
    `state_dict()` returns tensors that alias live ones; a CheckpointManager copies them. It implements
    `CheckpointableState` by flattening everything on this rank. Not thread-safe: use it from the training thread.
    """

    def __init__(self) -> None:
        self._parts: dict[str, Stateful] = {}
        self.step = 0
        self.epoch = 0
        self.samples_seen = 0
        self.extras: dict[str, Any] = {}
        self.rank = 0

    def register(self, name: str, obj: Any) -> Any:
        """Register `obj` under `name`; returns `obj` (`self[name]` is what is saved: maybe a loader's wrapper)."""
        if not isinstance(name, str) or not name or "." in name or "#" in name:
            raise StateNameError(
                f"register(): name: expected a non-empty string without '.' or '#', got {name!r}"
            )
        if name in RESERVED:
            raise StateNameError(f"register(): name {name!r} is reserved ({', '.join(RESERVED)})")
        if name in self._parts:
            raise StateNameError(f"register(): {name!r} is already registered")
        part = obj
        if isinstance(obj, torch.utils.data.DataLoader):
            from supervisor.data import loader_part  # data.py builds on this module

            part = loader_part(name, obj)
        if not (
            callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))
        ):
            raise StateNameError(
                f"register({name!r}): expected an object with state_dict() and load_state_dict(), "
                f"got {type(obj).__qualname__}"
            )
        self._parts[name] = part
        return obj

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def __getitem__(self, name: str) -> Any:
        return self._parts[name]

    def counters(self) -> dict[str, int]:
        return {k: int(getattr(self, k)) for k in COUNTERS}

    def state_dict(self) -> dict[str, Any]:
        """The nested state: each part's state_dict(), "rng", "counters" and "extras"."""
        nested: dict[str, Any] = {name: obj.state_dict() for name, obj in self._parts.items()}
        nested["counters"] = self.counters()
        nested["extras"] = dict(self.extras)
        nested["rng"] = capture_rng()
        return nested

    def snapshot(
        self, step: int, extras: Mapping[str, Any] | None = None, rank_states: Mapping[str, Any] | None = None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """(skeleton, live tensors) of the state as checkpoint `step`, which becomes the state's step counter.

        `extras` are merged over the registered extras; `rank_states` (every rank's own share under DDP,
        {"<rank>": {...}}) is stored under "ranks".
        """
        self.step = int(step)  # saving "as step N" states where the loop is, as CheckpointManager.save did
        nested = self.state_dict()
        if extras:
            nested["extras"] = {**nested["extras"], **extras}
        if rank_states is not None:
            nested["ranks"] = dict(rank_states)
        return flatten(nested)

    def checked(self) -> Callable[[str], bool]:
        """Which tensors a snapshot's health covers: all of them but module buffers.

        Parameters and optimizer state must be finite; a buffer may hold an infinity on purpose (an additive
        attention mask), and a NaN in one comes with NaN parameters anyway.
        """
        buffers = set()
        for name, part in self._parts.items():
            if isinstance(part, torch.nn.Module):
                buffers |= {child_path(name, b) for b, _ in part.named_buffers(remove_duplicate=False)}
        return lambda tensor: tensor not in buffers

    def overlap_parts(self) -> tuple[list[torch.optim.Optimizer], Callable[[str], bool]]:
        """(the registered optimizers, which tensors only their step changes): the modules' parameters and the
        optimizers' state. An overlapped snapshot copies those beside the next forward and backward; module
        buffers (a forward may update them) and everything else are copied before save() returns."""
        optimizers = [p for p in self._parts.values() if isinstance(p, torch.optim.Optimizer)]
        owners = [n for n, p in self._parts.items() if isinstance(p, torch.nn.Module | torch.optim.Optimizer)]
        prefixes = tuple(f"{n}." for n in owners)
        buffers = set()
        for name, part in self._parts.items():
            if isinstance(part, torch.nn.Module):
                buffers |= {child_path(name, b) for b, _ in part.named_buffers(remove_duplicate=False)}
        return optimizers, lambda tensor: tensor.startswith(prefixes) and tensor not in buffers

    def load(self, nested: dict[str, Any], prefixes: Iterable[str] | None = None) -> None:
        """`load_state_dict` under the CheckpointableState name."""
        self.load_state_dict(nested, prefixes=prefixes)

    def rank_state_dict(self, parts: Iterable[str]) -> dict[str, Any]:
        """This rank's own share of the state: every RNG stream and the named parts (e.g. its data loader)."""
        return {"rng": capture_rng(), **{name: self._parts[name].state_dict() for name in parts}}

    def load_state_dict(self, nested: dict[str, Any], *, prefixes: Iterable[str] | None = None) -> None:
        """Restore from a nested state; with `prefixes`, only the leaves under them (e.g. "model.encoder.")."""
        prefixes = None if prefixes is None else [str(p) for p in prefixes]
        self._load(nested, prefixes)
        if self.rank or "ranks" in nested:
            self._load_own_rank(nested, prefixes)

    def _load(self, nested: dict[str, Any], prefixes: list[str] | None) -> None:
        if prefixes is not None:
            self._check_prefixes(nested, prefixes)
        for name, obj in self._parts.items():
            if not could_match(name, prefixes):
                continue
            if name not in nested:
                held = ", ".join(k for k in nested if k not in RESERVED) or "nothing"
                raise CheckpointError(
                    f"checkpoint has no state for registered part {name!r} (it holds: {held})"
                )
            saved = nested[name]
            obj.load_state_dict(
                saved if matches(name, prefixes) else overlay(obj.state_dict(), saved, name, prefixes)
            )
        for name in nested:
            if name not in self._parts and name not in RESERVED and could_match(name, prefixes):
                log.warning("Checkpoint holds state for %r, which is not registered; ignored", name)
        counters = nested.get("counters", {})
        for key in COUNTERS:
            if key in counters and matches(f"counters.{key}", prefixes):
                setattr(self, key, int(counters[key]))
        if "extras" in nested and could_match("extras", prefixes):
            self.extras = overlay(dict(self.extras), nested["extras"], "extras", prefixes or ["extras"])
        if "rng" in nested and could_match("rng", prefixes):
            restore_rng(
                nested["rng"] if matches("rng", prefixes) else overlay({}, nested["rng"], "rng", prefixes)
            )

    def _load_own_rank(self, nested: dict[str, Any], prefixes: list[str] | None) -> None:
        """Overlay this rank's own entry of "ranks" (its RNG streams and data position) on what was loaded."""
        own = (nested.get("ranks") or {}).get(str(self.rank))
        if own is None:
            if self.rank == 0:
                return
            held = ", ".join(sorted(nested.get("ranks") or {})) or "none (a single-process checkpoint)"
            raise CheckpointError(
                f"checkpoint has no state for rank {self.rank} (per-rank entries: {held}); "
                "restore it with the world size that wrote it"
            )
        wanted = list(own) if prefixes is None else [p for p in prefixes if p.split(".", 1)[0] in own]
        if wanted:
            self._load(own, wanted)

    @staticmethod
    def _check_prefixes(nested: dict[str, Any], prefixes: list[str]) -> None:
        paths = list(leaf_paths(nested))
        for prefix in prefixes:
            if not any(matches(p, [prefix]) for p in paths):
                tops = ", ".join(sorted(nested))
                raise CheckpointError(
                    f"restore prefix {prefix!r} selects nothing in the checkpoint (top level: {tops})"
                )

    def copies_on_load(self, path: str) -> bool:
        """True when restoring the leaf at `path` copies it (so a restore may pass a buffer it must keep)."""
        top = path.split(".", 1)[0]
        return top == "rng" or isinstance(self._parts.get(top), torch.nn.Module)

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Model and optimizer tensors by tensor name, so a restore can write into them instead of allocating.

        Loading a module from its own tensors copies nothing (torch skips a copy onto the same memory) and
        an optimizer keeps the tensors it is given, so writing here is the only copy a restore makes.
        """
        live: dict[str, torch.Tensor] = {}
        for name, obj in self._parts.items():
            if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
                live.update(flatten(obj.state_dict(), name)[1])
        return live
