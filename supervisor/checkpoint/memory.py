"""Host-memory snapshots in a ring of reused, preallocated buffers (the blocking part of a save).

A `DTensor` (FSDP2's sharded parameters and optimizer state) is captured as its local shard, with what it
takes to rewrap the copy (`Snapshot.staged()`): no collective, each rank copies its own shards.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from supervisor.checkpoint.fastcopy import copy_tensors, nonfinite_in
from supervisor.checkpoint.overlap import OverlappedCopy


@dataclass(frozen=True)
class ShardLayout:
    """Where a captured local shard sits in its global DTensor: enough to rewrap the copy without a collective."""

    mesh: Any
    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    spec: Any = None
    """The live DTensor's spec: the copy is rewrapped with it as it is, on the host (see `Snapshot.staged`)."""


@dataclass
class Snapshot:
    """One captured state: its JSON skeleton and tensor copies that alias nothing live."""

    id: str
    skeleton: Any
    tensors: dict[str, torch.Tensor]
    nbytes: int
    meta: dict[str, Any] = field(default_factory=dict)
    checked: Callable[[str], bool] = field(default=lambda name: True, repr=False, compare=False)
    """Which tensors nonfinite() looks at."""
    layouts: dict[str, ShardLayout] = field(default_factory=dict, repr=False, compare=False)
    """The captured DTensors' layouts, by name; `tensors` holds their local shards."""
    ready: Callable[[], Any] = field(default=lambda: None, repr=False, compare=False)
    """Blocks until the copies are complete (a capture overlapped with the next step returns before)."""
    _nonfinite: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def nonfinite(self) -> tuple[str, ...]:
        """The checked tensors that hold a NaN or an infinity (the snapshot is unhealthy if any).

        Read from the copy once, by its first caller: the writer thread before it writes, so that the copy,
        which blocks training, does not pay for it; or the training thread if it needs the mark first (an
        in-process rollback deciding while the write waits). Call it only while the snapshot is held (busy
        or kept in the ring): a released slot's buffers are reused.
        """
        self.ready()
        with self._lock:
            if self._nonfinite is None:
                bad = nonfinite_in(((n, t) for n, t in self.tensors.items() if self.checked(n)), threads=1)
                self._nonfinite = tuple(n for n in self.tensors if n in bad)
            return self._nonfinite

    def staged(self) -> dict[str, Any]:
        """The copies as the live state had them: each DTensor's shard rewrapped over the reused buffer (no
        collective: `run_check=False`, the global shape and stride kept), plain tensors as they are."""
        from torch.distributed.tensor import DTensor

        self.ready()
        out: dict[str, Any] = {}
        for name, buf in self.tensors.items():
            lay = self.layouts.get(name)
            if lay is None:
                out[name] = buf
            elif lay.spec is not None:
                # Not DTensor.from_local: it moves a host buffer to the mesh's device (a CUDA mesh would get a
                # second copy of the shard on the GPU, on whichever device the writer thread has). DCP's own
                # stager keeps host copies inside DTensors in the same way (a host `_local_tensor`).
                out[name] = DTensor(buf, lay.spec, requires_grad=False)
            else:
                out[name] = DTensor.from_local(
                    buf, lay.mesh, lay.placements, run_check=False, shape=lay.shape, stride=lay.stride
                )
        return out


class _Slot:
    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.snapshot: Snapshot | None = None
        self.busy = False
        self.order = -1


class SnapshotRing:
    """`slots` reusable snapshot buffers: new captures take the oldest slot not being written.

    Reusing buffers is what keeps the copy at memory bandwidth: allocating (clone) costs page faults on
    every save. Thread-safe: the training thread captures, the writer thread releases.
    """

    def __init__(self, slots: int):
        self._slots = [_Slot() for _ in range(slots)]
        self._cond = threading.Condition()
        self._counter = 0

    def __len__(self) -> int:
        return len(self._slots)

    def capture(
        self,
        checkpoint_id: str,
        skeleton: Any,
        live: Mapping[str, torch.Tensor],
        meta: dict[str, Any],
        checked: Callable[[str], bool] | None = None,
        *,
        copier: OverlappedCopy | None = None,
        late: Callable[[str], bool] | None = None,
    ) -> Snapshot:
        """Copy `live` tensors into the oldest free slot (waits for one) and mark it busy until release().

        A DTensor's local shard is copied (`to_local()`), and its layout kept for `Snapshot.staged()`.

        `checked` selects the tensors whose finiteness `Snapshot.nonfinite()` reports (all by default).
        With a `copier`, the tensors `late` names (those only an optimizer step changes) are copied by it in
        the background, the others before this returns; the snapshot's `ready()` waits for the copy.
        """
        with self._cond:
            self._cond.wait_for(lambda: any(not s.busy for s in self._slots))
            slot = min((s for s in self._slots if not s.busy), key=lambda s: s.order)
            slot.busy, slot.snapshot = True, None
            self._counter += 1
            slot.order = self._counter
        try:
            local, layouts = local_shards(live)
            if copier is None or late is None:
                tensors = copy_into(slot.buffers, local)
                ready: Callable[[], Any] = lambda: None  # noqa: E731
            else:
                pairs = buffers_for(slot.buffers, local)
                handle = copier.start(
                    [pairs[n] for n in pairs if late(n)], [pairs[n] for n in pairs if not late(n)]
                )
                tensors, ready = dict(slot.buffers), handle.result
        except BaseException:
            self._free(slot)
            raise
        snap = Snapshot(
            checkpoint_id,
            skeleton,
            tensors,
            sum(t.numel() * t.element_size() for t in tensors.values()),
            meta,
            checked or (lambda name: True),
            layouts=layouts,
            ready=ready,
        )
        with self._cond:
            slot.snapshot = snap
        return snap

    def release(self, snap: Snapshot) -> None:
        """The snapshot is written; its slot may be reused by a later capture."""
        for slot in self._slots:
            if slot.snapshot is snap:
                self._free(slot)

    def _free(self, slot: _Slot) -> None:
        with self._cond:
            slot.busy = False
            self._cond.notify_all()

    def snapshots(self) -> list[Snapshot]:
        """Snapshots held, oldest first."""
        with self._cond:
            held = [s for s in self._slots if s.snapshot is not None]
            return [s.snapshot for s in sorted(held, key=lambda s: s.order)]  # type: ignore[misc]

    def get(self, checkpoint_id: str) -> Snapshot | None:
        return next((s for s in self.snapshots() if s.id == checkpoint_id), None)

    def drop(self, checkpoint_id: str) -> None:
        """Forget a snapshot (its buffers stay allocated for reuse)."""
        with self._cond:
            for s in self._slots:
                if s.snapshot is not None and s.snapshot.id == checkpoint_id and not s.busy:
                    s.snapshot = None


def local_shards(live: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, ShardLayout]]:
    """Each DTensor of `live` as its local shard (a view, no copy) plus its layout; plain tensors as they are."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist: skip the import's cost
        return dict(live), {}
    from torch.distributed.tensor import DTensor

    local: dict[str, torch.Tensor] = {}
    layouts: dict[str, ShardLayout] = {}
    for name, t in live.items():
        if isinstance(t, DTensor):
            local[name] = t.to_local()
            layouts[name] = ShardLayout(
                t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()), getattr(t, "_spec", None)
            )
        else:
            local[name] = t
    return local, layouts


def buffers_for(
    buffers: dict[str, torch.Tensor], live: Mapping[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (buffer, live tensor)}: `buffers` made to fit `live` (reused when shape and dtype match)."""
    for name in [n for n in buffers if n not in live]:
        del buffers[name]
    pairs = {}
    for name, src in live.items():
        buf = buffers.get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            buffers[name] = buf
        pairs[name] = (buf, src)
    return pairs


def copy_into(buffers: dict[str, torch.Tensor], live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy each live tensor into `buffers` (reused when shape and dtype match) and return the copies."""
    copy_tensors(buffers_for(buffers, live).values())
    return dict(buffers)
