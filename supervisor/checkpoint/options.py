"""The store's options and its per-checkpoint info record."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from supervisor.errors import UserError

VerifyMode = Literal["full", "fast", "none"]
VERIFY_MODES = ("full", "fast", "none")
TIERS = ("memory", "local", "remote")
#: The one default of `memory_slots`, here and in the policy schema's `checkpoint.memory_slots`.
MEMORY_SLOTS = 2
#: What `memory_slots` means, word for word the same in the policy schema.
MEMORY_SLOTS_DOC = (
    "Snapshots of the state kept in host memory after they are written, for in-process rollbacks "
    "(restore_memory); each costs one copy of the state. Asynchronous saves copy into the same buffers, so "
    "the ring holds max(memory_slots, max_in_flight) of them while writes are in flight."
)


class CheckpointOptionsError(UserError, ValueError):
    """A checkpoint option has a bad value."""


@dataclass(frozen=True)
class KeepBestSpec:
    """Keep the `count` best checkpoints by `metric` (`mode` "min" or "max")."""

    metric: str
    mode: Literal["min", "max"] = "min"
    count: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise CheckpointOptionsError(f"keep_best.metric: expected a metric name, got {self.metric!r}")
        if self.mode not in ("min", "max"):
            raise CheckpointOptionsError(f"keep_best.mode: expected 'min' or 'max', got {self.mode!r}")
        _positive("keep_best.count", self.count)


@dataclass(frozen=True)
class CheckpointOptions:
    """Everything the checkpoint store needs from the policy's `checkpoint:` section; checked on construction."""

    directory: str | os.PathLike[str]
    """Local directory of the store (created if missing)."""
    remote: str | None = None
    """Optional fsspec URL (s3://, gs://, file://, ...) that every committed checkpoint is uploaded to."""
    keep_last: int | None = None
    """Keep the newest K checkpoints."""
    keep_best: KeepBestSpec | tuple[str, str, int] | None = None
    """Keep the best K by a metric: KeepBestSpec or (metric, mode, count)."""
    keep_every_steps: int | None = None
    """Keep every checkpoint whose step is a multiple of N (milestones)."""
    async_save: bool = True
    """Write, checksum and commit in a background thread; save() blocks only for the host-memory snapshot."""
    max_in_flight: int = 1
    """Most saves written at once; save() blocks until the oldest finishes when this many are in flight."""
    overlap: bool = False
    """With async_save: copy the parameters and optimizer state into the ring beside the next forward and
    backward instead of before save() returns; the registered optimizers' next step waits for the copy
    (`OverlappedCopy`). Only for states whose parameters change in the optimizer's step alone."""
    memory_slots: int = MEMORY_SLOTS
    """Snapshots of the state kept in host memory after they are written, for in-process rollbacks.

    `restore_memory()` restores from them; each costs one copy of the state. Asynchronous saves copy into the
    same buffers, so the ring holds max(memory_slots, max_in_flight) of them while writes are in flight; 0
    keeps none once written (a policy asks for at least 1). The policy's `checkpoint.memory_slots` is this
    option, with this default (`MEMORY_SLOTS`) and this meaning (`MEMORY_SLOTS_DOC`).
    """
    verify: VerifyMode = "full"
    """Restore checks: full (sizes and xxh3 checksums), fast (sizes only) or none (commit marker only)."""
    dedup: bool = True
    """Reference a tensor already stored with the same content instead of writing it again."""
    config: object = field(default=None, compare=False)
    """Training config (JSON-able, str or bytes) whose hash goes in each manifest."""
    allow_nonfinite: bool = False
    """Let latest() and restore("latest") pick an unhealthy checkpoint (NaN or infinity in its state)."""

    def __post_init__(self) -> None:
        if not str(self.directory):
            raise CheckpointOptionsError("checkpoint.directory: expected a path, got an empty string")
        object.__setattr__(self, "directory", Path(self.directory))
        if self.remote is not None and (not isinstance(self.remote, str) or not self.remote):
            raise CheckpointOptionsError(
                f"checkpoint.remote: expected an fsspec URL or None, got {self.remote!r}"
            )
        for name in ("keep_last", "keep_every_steps"):
            if getattr(self, name) is not None:
                _positive(f"checkpoint.{name}", getattr(self, name))
        if isinstance(self.keep_best, tuple | list):
            if len(self.keep_best) != 3:
                raise CheckpointOptionsError(
                    f"checkpoint.keep_best: expected (metric, mode, count), got {self.keep_best!r}"
                )
            object.__setattr__(self, "keep_best", KeepBestSpec(*self.keep_best))
        elif self.keep_best is not None and not isinstance(self.keep_best, KeepBestSpec):
            raise CheckpointOptionsError(
                f"checkpoint.keep_best: expected (metric, mode, count), got {self.keep_best!r}"
            )
        if not isinstance(self.async_save, bool):
            raise CheckpointOptionsError(
                f"checkpoint.async_save: expected true or false, got {self.async_save!r}"
            )
        _positive("checkpoint.max_in_flight", self.max_in_flight)
        if type(self.memory_slots) is not int or self.memory_slots < 0:
            raise CheckpointOptionsError(
                f"checkpoint.memory_slots: expected an integer >= 0, got {self.memory_slots!r}"
            )
        if not isinstance(self.allow_nonfinite, bool):
            raise CheckpointOptionsError(
                f"checkpoint.allow_nonfinite: expected true or false, got {self.allow_nonfinite!r}"
            )
        if self.verify not in VERIFY_MODES:
            raise CheckpointOptionsError(
                f"checkpoint.verify: expected one of {', '.join(VERIFY_MODES)}, got {self.verify!r}"
            )


def _positive(name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise CheckpointOptionsError(f"{name}: expected an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint: identity, position in training, metrics at save time, where it is held."""

    id: str
    step: int
    wall_time: float
    metrics: dict[str, float] = field(default_factory=dict, hash=False)
    parent_id: str | None = None
    path: str = ""
    seq: int = 0
    """Commit order; the newest commit is the latest checkpoint, whatever its step."""
    tiers: tuple[str, ...] = ()
    abandoned: bool = False
    nbytes: int = 0
    """Bytes of tensor state the checkpoint holds."""
    written_bytes: int = 0
    """Bytes of tensor data this checkpoint wrote (the rest was deduplicated)."""
    nonfinite: tuple[str, ...] = ()
    """Tensors that held a NaN or an infinity when the snapshot was taken."""

    @property
    def healthy(self) -> bool:
        """False when the state was not all finite: never a rollback target or "latest" unless allowed."""
        return not self.nonfinite


def make_id(step: int, seq: int) -> str:
    """Checkpoint id: unique per commit even when a step is saved again on a new branch."""
    return f"{step:010d}-{seq:06d}"


def parse_id(checkpoint_id: str) -> tuple[int, int]:
    """(step, seq) of an id made by make_id; ValueError otherwise."""
    step, _, seq = checkpoint_id.partition("-")
    if not (step.isdigit() and seq.isdigit()):
        raise ValueError(f"{checkpoint_id!r} is not a checkpoint id (expected <step>-<seq>)")
    return int(step), int(seq)
