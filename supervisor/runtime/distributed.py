"""Supervision under torchrun (DDP): one writer, collective agreement, per-rank state in rank 0's checkpoint.

Rank 0 alone writes checkpoints, logs to MLflow, beats the heartbeat and reports events; every other rank
restores read-only the checkpoint rank 0 names. What differs per rank (every RNG stream, the data position)
is gathered to rank 0 as uint8 tensors (JSON skeleton + safetensors bytes, never pickle) and stored under
`ranks.<rank>.*`, so each rank gets its own stream back. Any choice one rank makes that the others must
follow (stop, save, anomaly) is agreed by one `all_reduce(MAX)` per step on a dedicated gloo group, so no
rank is ever left waiting in a collective the others skipped.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from supervisor.checkpoint import preload
from supervisor.checkpoint.catalog import open_store
from supervisor.checkpoint.options import CheckpointInfo
from supervisor.checkpoint.restore import restore_local
from supervisor.errors import CheckpointError, UserError
from supervisor.flatten import flatten, unflatten

if TYPE_CHECKING:
    from supervisor.runtime.plan import LaunchPlan
    from supervisor.state import TrainingState

log = logging.getLogger("rollback_supervisor.distributed")
_HEADER = struct.Struct("<Q")
_ERROR = "\0error:"


class DistributedSetupError(UserError):
    """torchrun started the process but no process group was initialized before the session attached."""


@dataclass
class Distributed:
    """This process's place in a multi-process job, and the collectives the session needs."""

    rank: int
    world_size: int
    group: Any
    #: The checkpoint writers' own gloo group (sharded saves), once `checkpoint_group()` made it.
    ckpt_group: Any = field(default=None, repr=False)

    @classmethod
    def detect(cls) -> Distributed | None:
        """The job this process is part of, or None for a single process (world size 1)."""
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if not (dist.is_available() and dist.is_initialized()):
            if world > 1:
                raise DistributedSetupError(
                    f"WORLD_SIZE={world} (torchrun), but torch.distributed is not initialized: call "
                    "dist.init_process_group() before Session.attach()"
                )
            return None
        if dist.get_world_size() == 1:
            return None
        # Our own group: the session's collectives never interleave with DDP's on the default group.
        return cls(dist.get_rank(), dist.get_world_size(), dist.new_group(backend="gloo"))

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def checkpoint_group(self, timeout_s: float) -> Any:
        """The gloo group the sharded checkpoint writers use (made on first call, with `timeout_s` per
        collective; collective: every rank calls it at the same point). A writer thread's collectives on the
        session's group would race the training thread's (FACTS.md: DCP in a thread on the training group
        hangs); `finish()` tears it down in order, before the session's group."""
        if self.ckpt_group is None:
            if not timeout_s > 0:
                raise CheckpointError(
                    f"checkpoint collective timeout: expected a number of seconds > 0, got {timeout_s!r}"
                )
            self.ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return self.ckpt_group

    def finish(self, timeout_s: float = 60.0) -> None:
        """Leave together: wait for every rank, then release the checkpoint group and the session's group, in
        that order on every rank (the store was closed before: no writer thread uses them any more).

        A rank that tears gloo down while a peer is still inside its last save or collective can die with
        SIGABRT ("terminate called without an active exception") after training finished; a finished run would
        then be classified as a crash. So can a group left to the final `destroy_process_group`.
        """
        try:
            dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s))
        finally:
            try:
                if self.ckpt_group is not None:
                    dist.destroy_process_group(self.ckpt_group)
                    self.ckpt_group = None
            finally:
                dist.destroy_process_group(self.group)

    def agree(self, *flags: int) -> tuple[int, ...]:
        """Element-wise maximum of `flags` over all ranks (every rank gets the same answer)."""
        t = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return tuple(int(v) for v in t.tolist())

    def gather_values(self, values: Sequence[float]) -> list[list[float]]:
        """Every rank's `values` (same length everywhere), indexed by rank."""
        mine = torch.tensor(list(values), dtype=torch.float64)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [t.tolist() for t in out]

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's `text` on every rank (others pass None)."""
        data = (text or "").encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.group)
        n = int(size.item())
        if n == 0:
            return ""
        buf = _as_tensor(data) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.group)
        return bytes(buf.numpy()).decode()

    def broadcast_outcome(self, value: str | None, error: BaseException | None = None) -> str | None:
        """Rank 0's result (`value`) or failure on every rank; a failure on rank 0 is raised everywhere else."""
        mine = f"{_ERROR}{type(error).__name__}: {error}" if error is not None else value
        text = self.broadcast_text(mine if self.rank == 0 else None)
        if text.startswith(_ERROR) and self.rank != 0:
            raise CheckpointError(f"rank 0 failed, so rank {self.rank} stops too: {text[len(_ERROR) :]}")
        return text or None

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's bytes on rank 0 (None elsewhere): sizes to all, then one padded gather to rank 0."""
        mine, sizes = self._padded(data)
        out = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(mine, out, dst=0, group=self.group)
        return None if out is None else _unpadded(out, sizes)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's bytes on every rank, by rank: sizes to all, then one padded all_gather."""
        mine, sizes = self._padded(data)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return _unpadded(out, sizes)

    def _padded(self, data: bytes) -> tuple[torch.Tensor, list[int]]:
        """`data` as a uint8 tensor padded to the longest of every rank's (collective), and every rank's size."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        mine = torch.zeros(max(int(s.item()) for s in sizes), dtype=torch.uint8)
        mine[: len(data)] = _as_tensor(data)
        return mine, [int(s.item()) for s in sizes]

    def exchange_bytes(self, data: bytes, peer: int) -> bytes:
        """`peer`'s bytes for this rank's (the peer calls it naming this rank); point to point, so the other
        ranks take no part; `peer` == this rank: `data` back."""
        if peer == self.rank:
            return data
        size, theirs = torch.tensor([len(data)], dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        for op in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, size, peer, self.group), dist.P2POp(dist.irecv, theirs, peer, self.group)]
        ):
            op.wait()
        out = torch.empty(int(theirs.item()), dtype=torch.uint8)
        ops = [dist.P2POp(dist.isend, _as_tensor(data), peer, self.group)] if data else []
        ops += [dist.P2POp(dist.irecv, out, peer, self.group)] if out.numel() else []
        for op in dist.batch_isend_irecv(ops) if ops else []:
            op.wait()
        return bytes(out.numpy())

    def gather_state(self, nested: dict[str, Any]) -> dict[str, Any] | None:
        """Every rank's nested state on rank 0 as {"<rank>": nested} (None elsewhere)."""
        packed = self.gather_bytes(pack_state(nested))
        return None if packed is None else {str(r): unpack_state(b) for r, b in enumerate(packed)}


def job_plan(
    run_name: str, workdir: Path | None, policy: Path | None, dist: Distributed | None
) -> LaunchPlan:
    """This rank's launch plan: the supervisor's (every rank reads the same file), or stand-alone rank 0's,
    broadcast so that every rank writes to and restores from the same place."""
    from supervisor.runtime.plan import LaunchPlan, load_plan

    plan = load_plan(run_name, workdir, policy)
    if dist is not None and not plan.supervised:
        shared = dist.broadcast_text(json.dumps(plan.to_dict()) if dist.is_writer else None)
        plan = LaunchPlan.from_dict(json.loads(shared))
    return plan


def _unpadded(tensors: list[torch.Tensor], sizes: list[int]) -> list[bytes]:
    return [bytes(t[:n].numpy()) for t, n in zip(tensors, sizes, strict=True)]


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def pack_state(nested: dict[str, Any]) -> bytes:
    """A nested state as bytes: 8-byte length, JSON skeleton, safetensors tensors (no pickle)."""
    skeleton, tensors = flatten(nested)
    head = json.dumps(skeleton).encode()
    body = st_save({k: v.detach().cpu().contiguous().clone() for k, v in tensors.items()})
    return _HEADER.pack(len(head)) + head + body


def unpack_state(data: bytes) -> dict[str, Any]:
    """The inverse of pack_state."""
    (n,) = _HEADER.unpack_from(data)
    skeleton = json.loads(data[_HEADER.size : _HEADER.size + n])
    return unflatten(skeleton, st_load(data[_HEADER.size + n :]))


class ReadOnlyCheckpoints:
    """The checkpoint store as a non-zero rank sees it: restores what rank 0 names; never writes or deletes."""

    def __init__(self, directory: str | os.PathLike[str], state: TrainingState, verify: str = "full"):
        self.directory, self.state, self.verify = Path(directory), state, verify

    def restore(self, which: str) -> CheckpointInfo:
        """Restore the checkpoint rank 0 named (its id), verified, read-only."""
        catalog = open_store(self.directory)
        info = catalog.get(which)
        preloaded = preload.restore_preloaded(str(self.directory), which, self.state, None)  # read ahead
        if not preloaded:
            restore_local(catalog, catalog.manifest(which), self.state, None, self.verify)
        log.info("rank restored checkpoint %s (read-only%s)", which, ", preloaded" if preloaded else "")
        return info

    def save(
        self,
        step: int,
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        before_commit: Callable[[], Any] | None = None,
        rank_states: dict[str, Any] | None = None,
    ) -> None:
        """Rank 0 writes; this rank only took part in gathering its state."""

    def writing(self) -> bool:
        """Never: this rank writes nothing."""
        return False

    def wait(self) -> None:
        """Nothing is ever pending on a read-only rank."""

    def close(self) -> None:
        """Nothing to release: a read-only rank holds no lock."""
