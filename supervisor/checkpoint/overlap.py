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
(docs/benchmarks.md, "Checkpoints").
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


class CopyHandle:
    """One started copy: `result()` waits for it and raises its failure to every caller, each time."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._event: Any = None  # a CUDA event, for the device-to-host part
        self.error: BaseException | None = None

    def result(self) -> None:
        self._done.wait()
        if self._event is not None:
            self._event.synchronize()
        if self.error is not None:
            raise CheckpointError(
                f"the overlapped snapshot copy failed: {type(self.error).__name__}: {self.error}"
            ) from self.error

    def wait(self) -> None:
        """Wait for it, raising nothing (the training thread's wait: the save's writer reports a failure)."""
        self._done.wait()
        if self._event is not None:
            self._event.synchronize()


class OverlappedCopy:
    """Copies (dst, src) pairs into host buffers behind the training thread; one copy in flight at a time.

    `guard(optimizers)` makes every optimizer's step wait for the copy in flight. `threads` is the number of
    memcpy threads on the CPU path (1 leaves a core to the training when there are 2). `on_chunk` is called
    by the copy thread before each group of pairs (a seam for tests that slow the copy down). A failed copy
    never raises in the training thread: its handle's `result()` raises it, for the save's writer to report.
    """

    def __init__(self, *, threads: int = 1, on_chunk: Callable[[int], None] | None = None):
        self._threads = threads
        self._on_chunk = on_chunk
        self._current: CopyHandle | None = None
        self._hooks: list[Any] = []
        self._guarded: set[int] = set()  # ids of the optimizers whose step waits already
        self.waited_s = 0.0
        """Seconds the training thread has spent in wait() so far (what the overlap failed to hide)."""

    @property
    def pending(self) -> bool:
        current = self._current
        return current is not None and not current._done.is_set()

    def start(self, late: Pairs, now: Pairs = ()) -> CopyHandle:
        """Copy `now` before returning and `late` in the background; waits for a copy still in flight."""
        self.wait()
        copy_tensors(now)
        handle = CopyHandle()
        cuda = [p for p in late if p[1].is_cuda]
        host = [p for p in late if not p[1].is_cuda]
        if cuda:
            handle._event = _start_cuda(cuda)
        self._current = handle
        if host:
            threading.Thread(target=self._copy, args=(host, handle), name="ckpt-overlap", daemon=True).start()
        else:
            handle._done.set()
        return handle

    def _copy(self, pairs: Pairs, handle: CopyHandle) -> None:
        try:
            for i, group in enumerate(_groups(pairs, 1 << 26)):
                if self._on_chunk is not None:
                    self._on_chunk(i)
                copy_tensors(group, threads=self._threads)
        except BaseException as exc:  # raised by handle.result(), in the save's writer
            handle.error = exc
        finally:
            handle._done.set()

    def wait(self) -> float:
        """Block until the copy in flight is done; returns the seconds waited. Never raises (see the class)."""
        t0 = time.perf_counter()
        current = self._current
        if current is not None:
            current.wait()
        waited = time.perf_counter() - t0
        self.waited_s += waited
        return waited

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make each optimizer's step wait for the copy first (a step pre-hook, once per optimizer, so it may
        be called at every save); `unguard` removes them."""

        def before_step(*_: Any) -> None:
            self.wait()

        for opt in optimizers:
            if id(opt) not in self._guarded:
                self._guarded.add(id(opt))
                self._hooks.append(opt.register_step_pre_hook(before_step))

    def unguard(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._guarded.clear()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.unguard()


def _start_cuda(pairs: Pairs) -> Any:
    """Device-to-host copies on a side stream that first waits for the current one; the event that ends them."""
    device = pairs[0][1].device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for dst, src in pairs:
            dst.copy_(src.detach(), non_blocking=True)
            src.record_stream(stream)
        event = torch.cuda.Event()
        event.record(stream)
    return event


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
