"""Content-addressed tensor reuse: a tensor already stored with the same bytes is referenced, not rewritten.

Reuse is bounded, so that a small shared tensor never keeps a large dead blob on disk. The policy:

- A checkpoint references an existing blob only if the tensors it takes from that blob make up at least
  MIN_SHARE (80%) of the blob's bytes on disk. Otherwise it writes those tensors again.
- What it writes again goes to a second blob of its own, `<id>.shared.safetensors`. That blob holds only
  tensors that were already stored unchanged, so the next checkpoint needs all of it and references it.
  Frozen weights are therefore written twice: once as new, once copied out of the first blob, which mostly
  holds tensors that change. After that they are never written again.
- Copies under SMALL_COPIES in total go into the main blob instead, because an extra file is not worth a
  few kilobytes.

Why disk use stays bounded: at least MIN_SHARE of every blob that a kept checkpoint references is bytes
that this checkpoint needs, and the blobs it writes itself hold nothing else. Charge each blob on disk to
one kept checkpoint that references it. The blobs charged to checkpoint c then total at most
state(c) / MIN_SHARE, plus headers. With K checkpoints kept (K + 1 between a commit and its retention),
the blobs take at most K x state / 0.8 = 1.25 K x state. This holds for any retention policy and any
order in which tensors change. Typically the total is K x state or less: frozen weights are stored once,
and a blob that two kept checkpoints reference is paid for by both. The old rule referenced any blob that
held the bytes, so a 5 KB tensor kept a whole 37.8 MB blob alive for as long as the run went on.

Why 80% and not lower: a lower share would pin more dead bytes for good. Copying a tensor out once costs
one write. Keeping the blob instead would cost its dead part for as long as the run goes on.

Nothing committed is ever rewritten: a blob that is mostly dead loses its references as the checkpoints
that use it are retired, and then gc deletes it. So a crash at any moment leaves every committed
checkpoint exactly as it was.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from supervisor.checkpoint.blobs import DTYPE_NAMES, tensor_digest
from supervisor.checkpoint.manifest import FileEntry, Manifest, TensorRef

log = logging.getLogger("rollback_supervisor.checkpoint")

#: A checkpoint references a stored blob only when it needs at least this share of the blob's bytes.
MIN_SHARE = 0.8
#: Copies smaller than this in total go in the checkpoint's main blob, not in a shared blob of their own.
SMALL_COPIES = 1 << 16
_SUFFIX = ".safetensors"

Location = tuple[TensorRef, FileEntry]


class DedupIndex:
    """Every blob of the live manifests that holds each tensor content (xxh3-128 of dtype, shape, bytes)."""

    def __init__(self) -> None:
        self._where: dict[str, dict[str, TensorRef]] = {}  # digest -> blob path -> ref
        self._files: dict[str, FileEntry] = {}

    def rebuild(self, manifests: Iterable[Manifest]) -> None:
        """Forget everything and index `manifests` (call after deletions so no ref outlives its blob)."""
        self._where, self._files = {}, {}
        for m in manifests:
            self.add(m)

    def add(self, manifest: Manifest) -> None:
        for entry in manifest.files:
            self._files[entry.path] = entry
        for ref in manifest.tensors.values():
            if ref.digest and ref.blob in self._files:
                self._where.setdefault(ref.digest, {}).setdefault(ref.blob, ref)

    def find(self, digest: str) -> list[Location]:
        """Each blob that holds `digest`, with its ref and file entry (empty when none does)."""
        return [(ref, self._files[blob]) for blob, ref in self._where.get(digest, {}).items()]


@dataclass
class WritePlan:
    """The new blobs of this checkpoint with the tensors each gets, and references for every tensor."""

    writes: dict[str, dict[str, torch.Tensor]]
    refs: dict[str, TensorRef]
    reused_files: dict[str, FileEntry]


def shared_blob(blob: str) -> str:
    """The name of the blob that holds a checkpoint's copies of unchanged tensors, next to its main `blob`."""
    return (blob[: -len(_SUFFIX)] if blob.endswith(_SUFFIX) else blob) + ".shared" + _SUFFIX


def plan(tensors: Mapping[str, torch.Tensor], blob: str, index: DedupIndex | None) -> WritePlan:
    """Decide where each tensor of `tensors` goes: into `blob`, into its shared blob, or a reference.

    With no index, every tensor is written.
    """
    digests: dict[str, str] = {}
    first: dict[str, str] = {}  # digest -> the first name with it: tied tensors are stored once
    for name, t in tensors.items():
        digests[name] = tensor_digest(t)  # also what a restore verifies each tensor against
        first.setdefault(digests[name], name)
    size = {d: _nbytes(tensors[n]) for d, n in first.items()}
    found = {d: locs for d in first if index is not None and (locs := index.find(d))}
    source = choose_sources(found, size)
    copies = [d for d in found if d not in source]
    copied = sum(size[d] for d in copies)
    copy_to = shared_blob(blob) if copied >= SMALL_COPIES else blob
    _log_copies(found, copies, size, copy_to)
    out = WritePlan({}, {}, {})
    where: dict[str, tuple[str, str]] = {}  # digest -> (blob, key)
    for d, name in first.items():
        if d in source:
            ref, entry = source[d]
            where[d] = (ref.blob, ref.key)
            out.reused_files[entry.path] = entry
        else:
            target = copy_to if d in found else blob
            out.writes.setdefault(target, {})[name] = tensors[name]
            where[d] = (target, name)
    for name, t in tensors.items():
        d = digests[name]
        out.refs[name] = TensorRef(*where[d], d, size[d], DTYPE_NAMES[t.dtype], tuple(t.shape))
    return out


def choose_sources(found: Mapping[str, list[Location]], size: Mapping[str, int]) -> dict[str, Location]:
    """Pick a stored location for each digest from blobs this checkpoint needs at least MIN_SHARE of.

    A blob that could not reach the share even if it gave every tensor it holds is dropped first. Each
    digest then goes to the blob offering the most bytes. While some blob in use falls short (its digests
    went to others), the one furthest short is dropped and the rest are ranked again. A digest left
    without a location is written again.
    """
    files = {e.path: e for locs in found.values() for _, e in locs}
    usable = set(files)
    while True:
        offered: dict[str, int] = defaultdict(int)
        for d, locs in found.items():
            for _, e in locs:
                if e.path in usable:
                    offered[e.path] += size[d]
        hopeless = {p for p in usable if offered[p] < MIN_SHARE * _size(files[p])}
        if hopeless:
            usable -= hopeless
            continue
        # The blob offering the most bytes first (fewest copies), then the densest.
        ranked = sorted(usable, key=lambda p: (-offered[p], -offered[p] / _size(files[p]), p))
        rank = {p: i for i, p in enumerate(ranked)}
        chosen: dict[str, Location] = {}
        for d, locs in found.items():
            held = [loc for loc in locs if loc[1].path in usable]
            if held:
                chosen[d] = min(held, key=lambda loc: rank[loc[1].path])
        taken: dict[str, int] = defaultdict(int)
        for d, (_, e) in chosen.items():
            taken[e.path] += size[d]
        short = [p for p in usable if taken[p] < MIN_SHARE * _size(files[p])]
        if not short:
            return chosen
        usable.remove(min(short, key=lambda p: (taken[p] / _size(files[p]), p)))


def _log_copies(
    found: Mapping[str, list[Location]], copies: list[str], size: Mapping[str, int], copy_to: str
) -> None:
    """Say, for each blob passed over, why its tensors are written again instead of referenced."""
    offered: dict[str, int] = defaultdict(int)
    files: dict[str, FileEntry] = {}
    for d in copies:
        for _, e in found[d]:
            offered[e.path] += size[d]
            files[e.path] = e
    level = logging.INFO if sum(size[d] for d in copies) >= SMALL_COPIES else logging.DEBUG
    for path, n in sorted(offered.items()):
        log.log(
            level,
            "Writing %.1f kB again into %s instead of referencing %s: this checkpoint would need only %.3g%% "
            "of its %.3f MB (under %.0f%%), and the rest would stay on disk for as long as it is referenced",
            n / 1e3,
            copy_to,
            path,
            100 * n / _size(files[path]),
            files[path].size / 1e6,
            100 * MIN_SHARE,
        )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(entry: FileEntry) -> int:
    return max(entry.size, 1)
