"""Host-memory snapshots in a ring of reused, preallocated buffers (the blocking part of a save)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from supervisor.checkpoint.fastcopy import copy_tensors, nonfinite_in


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
    _nonfinite: tuple[str, ...] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def nonfinite(self) -> tuple[str, ...]:
        """The checked tensors that hold a NaN or an infinity (the snapshot is unhealthy if any).

        Read from the copy once, by its first caller: the writer thread before it writes, so that the copy,
        which blocks training, does not pay for it; or the training thread if it needs the mark first (an
        in-process rollback deciding while the write waits). Call it only while the snapshot is held (busy
        or kept in the ring): a released slot's buffers are reused.
        """
        with self._lock:
            if self._nonfinite is None:
                bad = nonfinite_in(((n, t) for n, t in self.tensors.items() if self.checked(n)), threads=1)
                self._nonfinite = tuple(n for n in self.tensors if n in bad)
            return self._nonfinite


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
    ) -> Snapshot:
        """Copy `live` tensors into the oldest free slot (waits for one) and mark it busy until release().

        `checked` selects the tensors whose finiteness `Snapshot.nonfinite()` reports (all by default).
        """
        with self._cond:
            self._cond.wait_for(lambda: any(not s.busy for s in self._slots))
            slot = min((s for s in self._slots if not s.busy), key=lambda s: s.order)
            slot.busy, slot.snapshot = True, None
            self._counter += 1
            slot.order = self._counter
        try:
            tensors = copy_into(slot.buffers, live)
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


def copy_into(buffers: dict[str, torch.Tensor], live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy each live tensor into `buffers` (reused when shape and dtype match) and return the copies."""
    for name in [n for n in buffers if n not in live]:
        del buffers[name]
    pairs = []
    for name, src in live.items():
        buf = buffers.get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            buffers[name] = buf
        pairs.append((buf, src))
    copy_tensors(pairs)
    return dict(buffers)
