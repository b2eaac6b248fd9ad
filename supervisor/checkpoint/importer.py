"""Import a foreign .pt file into a store, loading it only with torch.load(weights_only=True)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from supervisor.checkpoint.dedup import DedupIndex
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import git_commit, library_versions
from supervisor.checkpoint.options import CheckpointInfo, make_id, parse_id
from supervisor.checkpoint.writer import CheckpointMeta, write_checkpoint
from supervisor.errors import CheckpointError
from supervisor.flatten import flatten

_STEP_KEYS = ("step", "global_step", "iter_num", "iteration")


def load_foreign(path: str | os.PathLike[str]) -> Any:
    """torch.load with weights_only=True: tensors and plain containers only; anything else is refused."""
    try:
        return torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{os.fspath(path)}: file not found") from None
    except Exception as exc:  # weights_only refusals arrive as UnpicklingError, RuntimeError and more
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"{os.fspath(path)}: refused; it cannot be loaded with torch.load(weights_only=True), which never "
            f"runs code from the file ({first})"
        ) from None


def to_nested(obj: Any) -> tuple[dict[str, Any], int]:
    """Shape a foreign object as a TrainingState nested state; returns it and the step it names (or 0)."""
    if not isinstance(obj, dict) or not obj:
        raise CheckpointError(
            f"expected a dict of state dicts or a model state dict, got {type(obj).__name__}"
        )
    if all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"model": dict(obj), "counters": {"step": 0, "epoch": 0, "samples_seen": 0}, "extras": {}}, 0
    parts = {str(k): v for k, v in obj.items() if isinstance(v, dict)}
    extras = {str(k): v for k, v in obj.items() if not isinstance(v, dict)}
    step = next((int(extras[k]) for k in _STEP_KEYS if type(extras.get(k)) is int), 0)
    epoch = extras.get("epoch") if type(extras.get("epoch")) is int else 0
    nested = {**parts, "counters": {"step": step, "epoch": epoch, "samples_seen": 0}, "extras": extras}
    return nested, step


def import_file(
    path: str | os.PathLike[str], directory: str | os.PathLike[str], *, step: int | None = None
) -> CheckpointInfo:
    """Store a foreign .pt file as a new checkpoint in `directory` (restore it with prefixes if partial)."""
    nested, found_step = to_nested(load_foreign(path))
    step = found_step if step is None else step
    store = LocalStore(directory)
    try:
        index = DedupIndex()
        index.rebuild(store.catalog.manifest(i.id) for i in store.catalog.list())
        seq = max((parse_id(i)[1] for i in store.catalog.ids()), default=0) + 1
        skeleton, tensors = flatten(nested)
        meta = CheckpointMeta(
            make_id(step, seq), seq, step, time.time(), {}, None, library_versions(), git_commit(), None
        )
        tensors = {n: t.detach().contiguous() for n, t in tensors.items()}
        write_checkpoint(store, meta, skeleton, tensors, index)
        return store.catalog.get(meta.id)
    finally:
        store.close()
