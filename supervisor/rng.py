"""Every RNG stream of a process (Python, NumPy's global generator, torch CPU and CUDA) as JSON and tensors."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch
import xxhash

log = logging.getLogger("rollback_supervisor.checkpoint")


def rank_seed(seed: int, rank: int, world_size: int) -> int:
    """A distinct, reproducible seed per rank; `seed` itself for a single process."""
    if world_size <= 1:
        return seed
    return (seed * 1_000_003 + rank + 1) % (2**63)


def capture_rng(*, cuda: bool = True) -> dict[str, Any]:
    """Python `random`, NumPy's global generator, torch CPU and (`cuda`) every CUDA device: JSON and tensors."""
    version, internal, gauss_next = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if cuda and torch.cuda.is_available():
        rng["cuda"] = list(torch.cuda.get_rng_state_all())
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Set every RNG stream captured by capture_rng(); streams absent from `rng` are left alone."""
    if "python" in rng:
        py = rng["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    if "numpy" in rng:
        n = rng["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "torch" in rng:
        torch.set_rng_state(rng["torch"].to(dtype=torch.uint8, device="cpu"))
    if "cuda" in rng:
        states = list(rng["cuda"])
        if not torch.cuda.is_available():
            log.warning(
                "Checkpoint holds RNG state for %d CUDA devices; no CUDA here, so it was skipped", len(states)
            )
            return
        count = torch.cuda.device_count()
        if count != len(states):
            log.warning(
                "Checkpoint holds RNG state for %d CUDA devices, this process sees %d", len(states), count
            )
        for index, state in enumerate(states[:count]):
            torch.cuda.set_rng_state(state.to(dtype=torch.uint8, device="cpu"), index)


def rederive(seed: int, step: int, rank: int, world_size: int, stream: str = "rng") -> int:
    """The seed of rank `rank` of `world_size` for `stream`, re-derived from a run's `seed` and checkpoint `step`.

    Used where a checkpoint's own per-rank streams cannot be given back (a restore at another world size):
    xxh3 of all five, so it is the same on every restore of one checkpoint and distinct per rank and stream.
    """
    for name, value in (("seed", seed), ("step", step), ("rank", rank), ("world_size", world_size)):
        if type(value) is not int:
            raise ValueError(f"rederive(): {name}: expected an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"rederive(): expected 0 <= rank < world_size, got rank={rank}, world_size={world_size}"
        )
    return xxhash.xxh3_64_intdigest(f"{seed}:{step}:{rank}:{world_size}:{stream}".encode())


def seed_all(seed: int) -> list[str]:
    """Seed every stream of this process (Python, NumPy's global generator, torch CPU, every CUDA device) from
    `seed`; returns the streams seeded."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's legacy seed takes 32 bits
    torch.manual_seed(seed)  # also every CUDA device, lazily
    streams = ["python", "numpy", "torch"]
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
        streams.append("cuda")
    return streams
