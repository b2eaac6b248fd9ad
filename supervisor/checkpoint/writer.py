"""Write one snapshot as a checkpoint directory: dedup plan, blob, state.json, manifest, atomic commit."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from supervisor.checkpoint.blobs import write_blob
from supervisor.checkpoint.dedup import DedupIndex, plan
from supervisor.checkpoint.local import LocalStore, write_file
from supervisor.checkpoint.manifest import BLOBS, CKPT_PREFIX, STATE, FileEntry, Manifest


@dataclass(frozen=True)
class CheckpointMeta:
    """What a manifest records besides the data."""

    id: str
    seq: int
    step: int
    wall_time: float
    metrics: dict[str, float]
    parent_id: str | None
    versions: dict[str, str]
    git_commit: str | None
    config_hash: str | None
    nonfinite: tuple[str, ...] = ()


def write_checkpoint(
    store: LocalStore,
    meta: CheckpointMeta,
    skeleton: Any,
    tensors: Mapping[str, torch.Tensor],
    index: DedupIndex | None,
    before_commit: Callable[[], Any] | None = None,
) -> Manifest:
    """Write and commit a checkpoint from host tensors no one mutates meanwhile; returns its manifest.

    `before_commit` runs once the files are staged; if it raises, nothing is committed.
    """
    cid = meta.id
    staged = store.stage(cid)
    try:
        blob = f"{BLOBS}/{cid}.safetensors"
        layout = plan(tensors, blob, index)
        files = list(layout.reused_files.values())
        written = 0
        # The main blob and, for unchanged tensors copied out of mostly dead blobs, a shared one.
        for rel, part in layout.writes.items():
            size, digest = write_blob(os.path.join(staged, os.path.basename(rel)), part, {"checkpoint": cid})
            files.append(FileEntry(rel, size, digest))
            written += size
        state_raw = json.dumps(skeleton, separators=(",", ":"), allow_nan=False).encode()
        write_file(os.path.join(staged, STATE), state_raw)
        files.append(
            FileEntry(f"{CKPT_PREFIX}{cid}/{STATE}", len(state_raw), xxhash.xxh3_64_hexdigest(state_raw))
        )
        manifest = Manifest(
            id=cid,
            seq=meta.seq,
            step=meta.step,
            wall_time=meta.wall_time,
            metrics=dict(meta.metrics),
            parent_id=meta.parent_id,
            files=files,
            tensors=layout.refs,
            nbytes=sum(r.nbytes for r in layout.refs.values()),
            written_bytes=written,
            versions=dict(meta.versions),
            git_commit=meta.git_commit,
            config_hash=meta.config_hash,
            nonfinite=list(meta.nonfinite),
        )
        if before_commit is not None:
            before_commit()
        store.commit(cid, staged, manifest.to_bytes(), list(layout.writes))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return manifest


def host_tensors(live: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors for a synchronous write (copies only what is not already so)."""
    return {n: t.detach().to("cpu").contiguous() for n, t in live.items()}
