"""The replay's second stage moves one rank's work to another rank's device: batches and RNG streams swapped.

Every rank takes part in each exchange (an all-gather on the session's gloo group), also a rank that keeps its
own batches: a rank outside the swapped pair takes its own back. Batches and RNG streams travel as the
checkpoints' own format (a JSON skeleton and safetensors bytes, never pickle); a batch holding something else
(an object the checkpoint format cannot carry) is refused with its key path.
"""

from __future__ import annotations

from typing import Any

import torch

from supervisor.flatten import flatten, unflatten
from supervisor.rng import capture_rng, restore_rng
from supervisor.runtime.distributed import pack_state, unpack_state
from supervisor.runtime.seams import Collective


def swap_batch(dist: Collective, batch: Any, source: int) -> Any:
    """Rank `source`'s batch on this rank (collective: every rank calls it with its own batch), each tensor on
    the device its counterpart in this rank's batch is on."""
    received = dist.all_gather_bytes(pack_state({"batch": batch}))[source]
    if source == dist.rank:
        return batch
    _, mine = flatten({"batch": batch})
    skeleton, theirs = flatten(unpack_state(received))
    placed = {n: t.to(mine[n].device) if n in mine else t for n, t in theirs.items()}
    return unflatten(skeleton, placed)["batch"]


def swap_rng(dist: Collective, source: int) -> None:
    """Take rank `source`'s RNG streams (collective: every rank calls it). Of CUDA's, only the stream of each
    rank's own device travels, onto the receiving rank's own device."""
    mine = capture_rng(cuda=False)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mine["own_cuda"] = torch.cuda.get_rng_state()
    packed = dist.all_gather_bytes(pack_state(mine))
    if source == dist.rank:
        return
    theirs = unpack_state(packed[source])
    own_cuda = theirs.pop("own_cuda", None)
    restore_rng(theirs)
    if own_cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own_cuda)


def describe(dist: Collective, host: str, device: str) -> tuple[list[str], list[str]]:
    """Every rank's host and device, by rank (collective)."""
    rows = [b.decode().split("\0", 1) for b in dist.all_gather_bytes(f"{host}\0{device}".encode())]
    return [r[0] for r in rows], [r[1] if len(r) > 1 else "?" for r in rows]
