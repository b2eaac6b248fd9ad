"""The replay's second stage moves one rank's work to another rank's device: batches and RNG streams swapped.

Two ranks (the suspect and its buddy) exchange, point to point, each step's batch together with the RNG streams
as they stand once the batch was drawn: each computes the other's batch with the other's streams, as the other
did the first time. At the step's end they give the streams back, so that each draws its next batch from its own
stream again (a loader drawing from the process's RNG, an augmentation or a collate-time mask, sees what it saw
the first time). The other ranks keep their own batches and take no part. Batches and RNG streams travel as the
checkpoints' own format (a JSON skeleton and safetensors bytes, never pickle); a batch holding something else (an
object the checkpoint format cannot carry) is refused with its key path.
"""

from __future__ import annotations

from typing import Any

import torch

from supervisor.flatten import flatten, unflatten
from supervisor.rng import capture_rng, restore_rng
from supervisor.runtime.distributed import pack_state, unpack_state
from supervisor.runtime.seams import Collective


def take_over(dist: Collective, batch: Any, peer: int) -> Any:
    """`peer`'s batch, each tensor on the device its counterpart in this rank's batch is on, and `peer`'s RNG
    streams as they stood once it drew that batch (this rank's own go to `peer`). `peer` == this rank: `batch`."""
    if peer == dist.rank:
        return batch
    received = unpack_state(dist.exchange_bytes(pack_state({"batch": batch, "rng": _own_streams()}), peer))
    _set_streams(received["rng"])
    _, mine = flatten({"batch": batch})
    skeleton, theirs = flatten({"batch": received["batch"]})
    placed = {n: t.to(mine[n].device) if n in mine else t for n, t in theirs.items()}
    return unflatten(skeleton, placed)["batch"]


def give_back(dist: Collective, peer: int) -> None:
    """At a swapped step's end: the streams this rank used go back to `peer`, and its own come back."""
    if peer != dist.rank:
        _set_streams(unpack_state(dist.exchange_bytes(pack_state(_own_streams()), peer)))


def describe(dist: Collective, host: str, device: str) -> tuple[list[str], list[str]]:
    """Every rank's host and device, by rank (collective)."""
    rows = [b.decode().split("\0", 1) for b in dist.all_gather_bytes(f"{host}\0{device}".encode())]
    return [r[0] for r in rows], [r[1] if len(r) > 1 else "?" for r in rows]


def _own_streams() -> dict[str, Any]:
    """Every RNG stream of this process; of CUDA's only the current device's (the receiver sets it on its own)."""
    streams = capture_rng(cuda=False)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        streams["own_cuda"] = torch.cuda.get_rng_state()
    return streams


def _set_streams(streams: dict[str, Any]) -> None:
    own_cuda = streams.pop("own_cuda", None)
    restore_rng(streams)
    if own_cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own_cuda)
