"""A snapshot copy that overlaps the next step: the copy into host buffers runs beside the next forward and
backward, and the only wait is before the next `optimizer.step()`, the first thing that changes a copied
tensor.

What it may copy late: tensors that only an optimizer step changes (parameters, optimizer state). A module
buffer that the forward pass updates (BatchNorm's running statistics) or a parameter changed in place outside
the optimizer (weight clipping, an EMA written into the model) must be copied before `start` returns; the
caller passes those as `now`.

On the CPU the late copy is the chunked memcpy of `fastcopy` on a thread. On a GPU it is a device-to-host copy
into pinned buffers on a side stream that first waits for the current stream (so it reads the values the step
wrote); `wait()` synchronizes on its event. Whether it pays on a host is measured by `benchmarks/overlap.py`
(README, "Checkpoint speed").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from supervisor.checkpoint.fastcopy import copy_tensors
from supervisor.errors import CheckpointError

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]


class OverlappedCopy:
    """Copies (dst, src) pairs into host buffers behind the training thread; one copy in flight at a time.

    `guard(optimizers)` makes every optimizer's step wait for the copy in flight. `threads` is the number of
    memcpy threads on the CPU path (1 leaves a core to the training when there are 2). `on_chunk` is called
    by the copy thread before each group of pairs (a seam for tests that slow the copy down).
    """

    def __init__(self, *, threads: int = 1, on_chunk: Callable[[int], None] | None = None):
        self._threads = threads
        self._on_chunk = on_chunk
        self._thread: threading.Thread | None = None
        self._event: Any = None
        self._error: BaseException | None = None
        self._hooks: list[Any] = []
        self._lock = threading.Lock()  # wait() is called by the training thread and by a writer thread
        self.waited_s = 0.0
        """Seconds the training thread has spent in wait() so far (what the overlap failed to hide)."""

    @property
    def pending(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()) or self._event is not None

    def start(self, late: Pairs, now: Pairs = ()) -> None:
        """Copy `now` before returning and `late` in the background; waits for a copy still in flight."""
        self.wait()
        copy_tensors(now)
        cuda = [p for p in late if p[1].is_cuda]
        host = [p for p in late if not p[1].is_cuda]
        if cuda:
            self._start_cuda(cuda)
        if host:
            self._error = None
            self._thread = threading.Thread(target=self._copy, args=(host,), name="ckpt-overlap", daemon=True)
            self._thread.start()

    def _start_cuda(self, pairs: Pairs) -> None:
        stream = torch.cuda.Stream(device=pairs[0][1].device)
        stream.wait_stream(torch.cuda.current_stream(pairs[0][1].device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src.detach(), non_blocking=True)
                src.record_stream(stream)
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def _copy(self, pairs: Pairs) -> None:
        try:
            groups = _groups(pairs, 1 << 26)
            for i, group in enumerate(groups):
                if self._on_chunk is not None:
                    self._on_chunk(i)
                copy_tensors(group, threads=self._threads)
        except BaseException as exc:  # re-raised on the training thread by wait()
            self._error = exc

    def wait(self) -> float:
        """Block until the copy in flight is done; returns the seconds waited. A failed copy raises here."""
        t0 = time.perf_counter()
        with self._lock:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            if self._event is not None:
                self._event.synchronize()
                self._event = None
            waited = time.perf_counter() - t0
            self.waited_s += waited
            if self._error is not None:
                error, self._error = self._error, None
                raise CheckpointError(f"the overlapped snapshot copy failed: {type(error).__name__}: {error}")
        return waited

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make each optimizer's step wait for the copy first (a step pre-hook); `unguard` removes them."""

        def before_step(*_: Any) -> None:
            self.wait()

        for opt in optimizers:
            self._hooks.append(opt.register_step_pre_hook(before_step))

    def unguard(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.unguard()


def _groups(pairs: Pairs, size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """The pairs in order, cut into groups of about `size` bytes (one on_chunk call each)."""
    groups: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    filled = 0
    for pair in pairs:
        if filled >= size:
            groups.append([])
            filled = 0
        groups[-1].append(pair)
        filled += pair[1].numel() * pair[1].element_size()
    return groups
