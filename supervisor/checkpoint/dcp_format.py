"""Sharded checkpoints in our manifest: chunk keys, coverage checks, and DCP `Metadata` to and from JSON.

A sharded tensor is stored as chunks (offsets, sizes), each one an ordinary `TensorRef` of `Manifest.tensors`
under the key `"<name>@<o0>,<o1>,..."`. Everything here is pure; torch is imported only by the functions that
build DCP objects, so `Catalog.verify` (which checks coverage) stays torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from math import prod
from typing import TYPE_CHECKING, Any

from supervisor.checkpoint.boundedjson import preview
from supervisor.checkpoint.manifest import (
    CKPT_PREFIX,
    MANIFEST,
    SHARDED_FORMAT_VERSION,
    Chunk,
    Manifest,
    ShardedTensor,
    TensorRef,
)

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def chunk_key(name: str, offsets: Iterable[int]) -> str:
    """The key of one stored chunk of tensor `name` ("model.w@0,6")."""
    return f"{name}@{','.join(str(int(o)) for o in offsets)}"


def coverage(size: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """None when `boxes` tile a tensor of `size` exactly (in bounds, no overlap, no hole), else why not."""
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or len(sizes) != len(size):
            return f"chunk at {list(offsets)} has {len(offsets)} dimensions, the tensor has {len(size)}"
        if any(o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
            return f"chunk at {list(offsets)} of size {list(sizes)} lies outside the tensor's {list(size)}"
    starts = [tuple(o) for o, _ in boxes]
    if len(set(starts)) != len(starts):  # DCP addresses a chunk by (tensor, offsets): they must be unique
        dup = next(o for o in starts if starts.count(o) > 1)
        return f"two chunks start at {list(dup)}"
    nonempty = [b for b in boxes if prod(b[1]) > 0]
    if size:  # a 0-d tensor has one start, so at most one chunk (checked above)
        # A sweep along dimension 0: a chunk can only overlap those still open where it starts, so sharding
        # along dimension 0 (FSDP) costs n log n, a 2-D grid n times a row of chunks, not n squared.
        nonempty.sort(key=lambda b: b[0][0])
        open_: list[Box] = []
        for box in nonempty:
            open_ = [a for a in open_ if a[0][0] + a[1][0] > box[0][0]]
            for a in open_:
                if _overlap(a, box):
                    return f"chunks at {list(a[0])} and {list(box[0])} overlap"
            open_.append(box)
    covered = sum(prod(n) for _, n in nonempty)
    if covered != prod(size):
        return f"chunks cover {covered} of the tensor's {prod(size)} elements (a hole)"
    return None


def _overlap(a: Box, b: Box) -> bool:
    return all(
        max(oa, ob) < min(oa + na, ob + nb) for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def sharded_problem(manifest: Manifest) -> str | None:
    """Why a sharded manifest is inconsistent (a chunk's ref, its coverage, a rank file); None if it is not."""
    if not manifest.sharded:
        return None
    if manifest.format_version != SHARDED_FORMAT_VERSION:
        return f"{MANIFEST}: sharded tensors need format_version {SHARDED_FORMAT_VERSION}, found {manifest.format_version}"
    if manifest.world_size < 1:
        return f"{MANIFEST}: world_size: expected an integer >= 1, found {manifest.world_size}"
    for name, st in manifest.sharded.items():
        for c in st.chunks:
            ref = manifest.tensors.get(c.key)
            if ref is None:
                return f"{MANIFEST}: sharded[{preview(name)}] names chunk {preview(c.key)}, which tensors does not list"
            if ref.dtype != st.dtype or ref.shape != c.sizes:
                return (
                    f"{MANIFEST}: chunk {preview(c.key)} is {ref.dtype}{list(ref.shape)}, "
                    f"sharded[{preview(name)}] says {st.dtype}{list(c.sizes)}"
                )
        if reason := coverage(st.size, [(c.offsets, c.sizes) for c in st.chunks]):
            return f"{MANIFEST}: sharded[{preview(name)}]: {reason}"
    listed = {f.path for f in manifest.files}
    for rank, rel in manifest.rank_files.items():
        if not rel.startswith(f"{CKPT_PREFIX}{manifest.id}/") or rel not in listed:
            return f"{MANIFEST}: rank_files[{preview(rank)}] {preview(rel)} is not a listed file of this checkpoint"
    return None


def sharded_view(manifest: Manifest) -> dict[str, ShardedTensor]:
    """Every tensor of `manifest` as chunks: a v1 tensor is one whole chunk at offset 0, keyed by its name."""
    if manifest.sharded:
        return manifest.sharded
    return {
        name: ShardedTensor(ref.dtype, ref.shape, [Chunk((0,) * len(ref.shape), ref.shape, name)])
        for name, ref in manifest.tensors.items()
    }


def to_metadata(sharded: Mapping[str, ShardedTensor]) -> tuple[Metadata, dict[MetadataIndex, str]]:
    """DCP `Metadata` for `sharded`, and the chunk key of each stored chunk by DCP's index."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from supervisor.dtypes import DTYPES

    entries: dict[str, Any] = {}
    keys: dict[MetadataIndex, str] = {}
    for name, st in sharded.items():
        chunks = []
        for c in st.chunks:
            chunks.append(ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)))
            keys[MetadataIndex(name, c.offsets)] = c.key
        entries[name] = TensorStorageMetadata(
            TensorProperties(dtype=DTYPES[st.dtype]), torch.Size(st.size), chunks
        )
    return Metadata(state_dict_metadata=entries), keys


def from_metadata(metadata: Metadata) -> dict[str, ShardedTensor]:
    """Our JSON form of DCP's global `Metadata` (tensors only; anything else is a ValueError)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from supervisor.dtypes import DTYPE_NAMES

    out = {}
    for name, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{name}: only tensors can be stored without pickle, found {type(md).__name__}")
        dtype = DTYPE_NAMES[md.properties.dtype]
        chunks = [
            Chunk(tuple(c.offsets), tuple(c.sizes), chunk_key(name, c.offsets))
            for c in sorted(md.chunks, key=lambda c: tuple(c.offsets))
        ]
        out[name] = ShardedTensor(dtype, tuple(md.size), chunks)
    return out


def chunk_refs(sharded: Mapping[str, ShardedTensor], refs: Mapping[str, TensorRef]) -> str | None:
    """Why the written chunk `refs` do not match the planned chunks of `sharded` one to one; None if they do."""
    planned = {c.key for st in sharded.values() for c in st.chunks}
    if missing := sorted(planned - refs.keys()):
        return f"no rank wrote chunk {preview(missing[0])} ({len(missing)} missing)"
    if extra := sorted(refs.keys() - planned):
        return f"chunk {preview(extra[0])} was written but is not in the global plan"
    return None
