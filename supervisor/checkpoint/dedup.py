"""Content-addressed tensor reuse: a tensor already stored with the same bytes is referenced, not rewritten."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from supervisor.checkpoint.blobs import DTYPE_NAMES, tensor_digest
from supervisor.checkpoint.manifest import FileEntry, Manifest, TensorRef


class DedupIndex:
    """Where each tensor content (xxh3-128 of dtype, shape and bytes) is already stored, from live manifests."""

    def __init__(self) -> None:
        self._refs: dict[str, TensorRef] = {}
        self._files: dict[str, FileEntry] = {}

    def rebuild(self, manifests: Iterable[Manifest]) -> None:
        """Forget everything and index `manifests` (call after deletions so no ref outlives its blob)."""
        self._refs, self._files = {}, {}
        for m in manifests:
            self.add(m)

    def add(self, manifest: Manifest) -> None:
        for entry in manifest.files:
            self._files[entry.path] = entry
        for ref in manifest.tensors.values():
            if ref.digest and ref.blob in self._files:
                self._refs.setdefault(ref.digest, ref)

    def find(self, digest: str) -> tuple[TensorRef, FileEntry] | None:
        ref = self._refs.get(digest)
        return None if ref is None else (ref, self._files[ref.blob])


@dataclass
class WritePlan:
    """Which tensors go into this checkpoint's new blob, and references for all of them."""

    new: dict[str, torch.Tensor]
    refs: dict[str, TensorRef]
    reused_files: dict[str, FileEntry]


def plan(tensors: Mapping[str, torch.Tensor], blob: str, index: DedupIndex | None) -> WritePlan:
    """Split `tensors` into new ones (written to `blob`) and ones already stored (referenced; no index: none)."""
    out = WritePlan({}, {}, {})
    fresh: dict[str, TensorRef] = {}
    for name, t in tensors.items():
        nbytes, kind, shape = t.numel() * t.element_size(), DTYPE_NAMES[t.dtype], tuple(t.shape)
        digest = tensor_digest(t)  # also what a restore verifies each tensor against
        if digest in fresh:
            out.refs[name] = TensorRef(blob, fresh[digest].key, digest, nbytes, kind, shape)
            continue
        found = index.find(digest) if index is not None else None
        if found is None:
            out.new[name] = t
            out.refs[name] = TensorRef(blob, name, digest, nbytes, kind, shape)
            if index is not None:
                fresh[digest] = out.refs[name]
        else:
            ref, entry = found
            out.refs[name] = TensorRef(ref.blob, ref.key, digest, nbytes, kind, shape)
            out.reused_files[entry.path] = entry
    return out
