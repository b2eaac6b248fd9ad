"""The protocols of checkpointed state: a part's `state_dict()` / `load_state_dict()`, and the whole state's view.

`Stateful` is what one registered part follows (model, optimizer, loader). `CheckpointableState` is what the
checkpoint manager and the restore path ask of the whole training state, and nothing more: today's
`TrainingState` flattens everything on one rank; a sharded (DCP-backed) state can provide the same verbs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


@runtime_checkable
class CheckpointableState(Protocol):
    """What a checkpoint manager snapshots and loads back; used from the training thread only."""

    def snapshot(
        self, step: int, extras: Mapping[str, Any] | None, rank_states: Mapping[str, Any] | None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """(JSON skeleton, named live tensors) of the state as checkpoint `step` (now its step counter); aliases live tensors."""
        ...

    def checked(self) -> Callable[[str], bool]:
        """Which tensor names a snapshot's health (finiteness) covers; evaluated later, off the training thread."""
        ...

    def load(self, nested: dict[str, Any], prefixes: Iterable[str] | None) -> None:
        """Load a nested state back (only the leaves under `prefixes` when given)."""
        ...

    def live_tensors(self) -> dict[str, torch.Tensor]:
        """Live tensors by tensor name that a restore may write into instead of allocating."""
        ...

    def copies_on_load(self, path: str) -> bool:
        """True when loading the leaf at `path` copies it (so a restore may pass a buffer it must keep)."""
        ...
