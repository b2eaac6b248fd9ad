"""Bulk tensor copies at memory bandwidth: plain memcpy on a few threads instead of torch's per-op OpenMP.

torch's copy_ opens an OpenMP parallel region per tensor; on a busy 2-core host each region waits for a
descheduled worker, and 193 copies of a 1.2 GB state ran 2.5x slower than one flat memcpy. NumPy's copy
releases the GIL, so chunks spread over Python threads copy in parallel with no per-tensor barrier.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

_CHUNK = 1 << 23
_MIN_PARALLEL = 1 << 26
THREADS = max(1, min(4, os.cpu_count() or 1))


def _flat_bytes(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _plain(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
        and not (src.is_conj() or src.is_neg() or dst.is_conj() or dst.is_neg())
        and dst.numel() > 0
    )


def copy_tensors(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], threads: int = THREADS) -> None:
    """dst.copy_(src) for every pair; plain CPU pairs go through chunked memcpy on `threads` threads."""
    jobs: list[tuple[np.ndarray, np.ndarray]] = []
    total = 0
    cuda = False
    for dst, src in pairs:
        if not _plain(dst, src):
            dst.copy_(src.detach(), non_blocking=src.is_cuda or dst.is_cuda)
            cuda = cuda or src.is_cuda or dst.is_cuda
            continue
        d, s = _flat_bytes(dst), _flat_bytes(src)
        jobs += [(d[i : i + _CHUNK], s[i : i + _CHUNK]) for i in range(0, len(s), _CHUNK)]
        total += len(s)
    if threads <= 1 or total < _MIN_PARALLEL:
        _run(jobs)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-copy") as pool:
            list(pool.map(_run, [jobs[i::threads] for i in range(threads)]))
    if cuda:
        torch.cuda.synchronize()


def _run(jobs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for d, s in jobs:
        np.copyto(d, s)
