"""Full-state checkpoints: pickle-free, atomic, verified, async, tiered and deduplicated.

`open_store`, `Catalog`, the options and the retention policies import without torch, so a supervisor
process that never holds the model stays light; `CheckpointManager` loads torch on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from supervisor.checkpoint.catalog import Catalog, open_store
from supervisor.checkpoint.options import (
    CheckpointInfo,
    CheckpointOptions,
    CheckpointOptionsError,
    KeepBestSpec,
)
from supervisor.checkpoint.retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepProtected,
    RetentionPolicy,
    RetentionResult,
    apply_retention,
)
from supervisor.errors import UnsupportedStateError

if TYPE_CHECKING:
    from supervisor.checkpoint.manager import CheckpointManager
    from supervisor.checkpoint.sharded import ShardedCheckpoints

__all__ = [
    "AnyOf",
    "Catalog",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointOptions",
    "CheckpointOptionsError",
    "KeepBest",
    "KeepBestSpec",
    "KeepEvery",
    "KeepLast",
    "KeepProtected",
    "RetentionPolicy",
    "RetentionResult",
    "ShardedCheckpoints",
    "UnsupportedStateError",
    "apply_retention",
    "open_store",
]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from supervisor.checkpoint.manager import CheckpointManager

        return CheckpointManager
    if name == "ShardedCheckpoints":
        from supervisor.checkpoint.sharded import ShardedCheckpoints

        return ShardedCheckpoints
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
