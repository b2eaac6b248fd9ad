"""Restore a TrainingState from a memory snapshot or a local checkpoint, verifying while reading."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xxhash

from supervisor.checkpoint.blobs import DTYPES, BlobEntry, BlobReader, digest_start
from supervisor.checkpoint.boundedjson import loads_bounded
from supervisor.checkpoint.catalog import Catalog, header_disagreement
from supervisor.checkpoint.fastcopy import THREADS, copy_tensors
from supervisor.checkpoint.manifest import CKPT_PREFIX, STATE, Manifest, TensorRef
from supervisor.checkpoint.memory import Snapshot
from supervisor.checkpoint.paths import LeavesStore
from supervisor.errors import CheckpointCorrupt
from supervisor.flatten import matches, tensor_paths, unflatten
from supervisor.stateful import CheckpointableState

#: state.json nests as deep as the registered state dicts do; far deeper is a planted file, not a state.
_MAX_STATE_DEPTH = 200


def _selected(skeleton: object, prefixes: Iterable[str] | None) -> list[tuple[str, str]]:
    return [(n, p) for n, p in tensor_paths(skeleton) if prefixes is None or matches(p, prefixes)]


def restore_snapshot(
    snap: Snapshot, state: CheckpointableState, prefixes: Iterable[str] | None, *, adopt: bool = False
) -> None:
    """Restore from a host-memory snapshot. Its buffers are copied into live tensors that fit them; the others
    get copies, so the buffers stay reusable, or with `adopt` (a snapshot restored once, then dropped: a
    standby's preload) the buffers themselves, which saves allocating and copying a fresh optimizer's state."""
    snap.ready()  # an overlapped capture may still be copying into them
    live = state.live_tensors()
    tensors: dict[str, torch.Tensor] = {}
    pairs = []
    for name, path in _selected(snap.skeleton, prefixes):
        src = snap.tensors[name]
        dst = live.get(name)
        if dst is not None and dst.shape == src.shape and dst.dtype == src.dtype:
            pairs.append((dst, src))
            tensors[name] = dst
        else:
            tensors[name] = src if adopt or state.copies_on_load(path) else src.clone()
    copy_tensors(pairs)
    state.load(unflatten(snap.skeleton, tensors), prefixes)


@dataclass
class _Read:
    """One stored tensor to read, the names that use it, and where its bytes go."""

    reader: BlobReader
    entry: BlobEntry
    ref: TensorRef
    names: list[str]
    target: torch.Tensor | None = None
    device_dst: torch.Tensor | None = None  # a live tensor off the CPU, copied to on the read thread
    reason: str | None = None


def restore_local(
    catalog: Catalog,
    manifest: Manifest,
    state: CheckpointableState,
    prefixes: Iterable[str] | None,
    verify: str,
) -> None:
    """Restore from a local checkpoint: each tensor is read once, straight into live memory where it fits.

    Sizes, blob headers (against the manifest) and state.json are checked before anything live changes.
    With verify="full" each tensor's xxh3-128 is computed chunk by chunk as it is read, on several threads;
    a mismatch is known only after the copy, so it raises CheckpointCorrupt with the live state partly
    overwritten and another checkpoint must be restored (restore("latest") does that by itself).
    """
    skeleton = _checked_skeleton(catalog, manifest, verify)
    if manifest.sharded:  # a sharded (DCP) checkpoint: its chunks are resharded for this one process
        _restore_sharded(catalog, manifest, state, skeleton, prefixes, verify)
        return
    tensors = _read_tensors(catalog, manifest, skeleton, prefixes, verify, state.live_tensors())
    state.load(unflatten(skeleton, tensors), prefixes)


class ReadCancelled(Exception):
    """`read_local` was cancelled before it read every tensor."""


def read_local(
    catalog: Catalog,
    manifest: Manifest,
    verify: str = "full",
    *,
    threads: int = THREADS,
    cancel: threading.Event | None = None,
) -> Snapshot:
    """A whole (unsharded) local checkpoint read into fresh host memory, checked as `restore_local` checks it:
    a snapshot that `restore_snapshot` restores as the checkpoint itself would be (a standby's preload).
    CheckpointCorrupt if a check fails; ValueError for a sharded checkpoint (its shards belong to ranks);
    ReadCancelled once `cancel` is set (it is looked at before each tensor)."""
    skeleton = _checked_skeleton(catalog, manifest, verify)
    if manifest.sharded:
        raise ValueError(f"checkpoint {manifest.id} is sharded: each rank reads its own shards of it")
    tensors = _read_tensors(catalog, manifest, skeleton, None, verify, {}, threads, cancel)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Snapshot(manifest.id, skeleton, tensors, nbytes)


def _checked_skeleton(catalog: Catalog, manifest: Manifest, verify: str) -> object:
    """state.json of the checkpoint, after the fast check of its files (unless verify="none")."""
    cid = manifest.id
    if verify != "none" and (reason := catalog.verify(cid, "fast", read=manifest)):
        raise CheckpointCorrupt(cid, reason)
    state_rel = f"{CKPT_PREFIX}{cid}/{STATE}"
    try:
        state_raw = catalog.read(state_rel)
    except LeavesStore as exc:
        raise CheckpointCorrupt(cid, str(exc)) from None
    except (OSError, ValueError) as exc:
        raise CheckpointCorrupt(cid, f"{state_rel}: {exc}") from None
    files = {e.path: e for e in manifest.files}
    if (
        verify == "full"
        and state_rel in files
        and xxhash.xxh3_64_hexdigest(state_raw) != files[state_rel].xxh3
    ):
        raise CheckpointCorrupt(cid, f"{state_rel} checksum mismatch: expected xxh3 {files[state_rel].xxh3}")
    try:
        return loads_bounded(state_raw, max_depth=_MAX_STATE_DEPTH, what=state_rel)
    except ValueError as exc:
        raise CheckpointCorrupt(cid, str(exc)) from None


def _read_tensors(
    catalog: Catalog,
    manifest: Manifest,
    skeleton: object,
    prefixes: Iterable[str] | None,
    verify: str,
    live: dict[str, torch.Tensor],
    threads: int = THREADS,
    cancel: threading.Event | None = None,
) -> dict[str, torch.Tensor]:
    """The selected tensors by name, read on several threads into `live` where they fit, else fresh memory."""
    cid = manifest.id
    readers: dict[str, BlobReader] = {}
    try:
        reads = _plan(cid, catalog, manifest, skeleton, prefixes, readers)
        for r in reads:
            dst = live.get(r.names[0])
            r.target = _target(r.entry, dst)
            if dst is not None and dst is not r.target and dst.device.type != "cpu" and _same(dst, r.target):
                r.device_dst = dst

        def read_share(share: list[_Read]) -> None:
            for r in share:
                if cancel is not None and cancel.is_set():
                    return
                _read(r, verify == "full")

        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-read") as pool:
            list(pool.map(read_share, _shares(reads, threads)))
        if cancel is not None and cancel.is_set():
            raise ReadCancelled(cid)
        tensors: dict[str, torch.Tensor] = {}
        for r in reads:
            tensors.update(_place(r, live))
        bad = next((r.reason for r in reads if r.reason), None)
        if bad:
            partly = " (found while copying: the live state is partly overwritten)" if live else ""
            raise CheckpointCorrupt(cid, bad + partly)
        return tensors
    finally:
        for reader in readers.values():
            reader.close()


def _restore_sharded(
    catalog: Catalog,
    manifest: Manifest,
    state: CheckpointableState,
    skeleton: object,
    prefixes: Iterable[str] | None,
    verify: str,
) -> None:
    # DCP's import is paid only by sharded restores.
    from supervisor.checkpoint.dcp_reader import restore_chunks

    try:
        names = [n for n, _ in _selected(skeleton, prefixes)]
    except (TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(manifest.id, f"{STATE} is malformed ({type(exc).__name__}: {exc})") from None
    tensors = restore_chunks(catalog, manifest, names, state.live_tensors(), verify)
    state.load(unflatten(skeleton, tensors), prefixes)


def _plan(
    cid: str,
    catalog: Catalog,
    manifest: Manifest,
    skeleton: object,
    prefixes: Iterable[str] | None,
    readers: dict[str, BlobReader],
) -> list[_Read]:
    """What to read, after checking every needed tensor's dtype, shape and size against the manifest."""
    by_location: dict[tuple[str, str], _Read] = {}
    try:
        selected = _selected(skeleton, prefixes)
    except (TypeError, ValueError, AttributeError) as exc:  # a skeleton our writer cannot have made
        raise CheckpointCorrupt(cid, f"{STATE} is malformed ({type(exc).__name__}: {exc})") from None
    for name, _ in selected:
        ref = manifest.tensors.get(name) if isinstance(name, str) else None
        if ref is None:
            raise CheckpointCorrupt(cid, f"{STATE} names tensor {name!r}, which the manifest does not list")
        if ref.blob not in readers:
            try:
                readers[ref.blob] = BlobReader(catalog.confined(ref.blob))
            except LeavesStore as exc:
                raise CheckpointCorrupt(cid, str(exc)) from None
            except (OSError, ValueError) as exc:
                raise CheckpointCorrupt(cid, f"{ref.blob}: {exc}") from None
        read = by_location.get((ref.blob, ref.key))
        if read is None:
            entry = readers[ref.blob].entries.get(ref.key)
            found = None if entry is None else (entry.dtype, entry.shape, entry.end - entry.start)
            if reason := header_disagreement(ref, found):
                raise CheckpointCorrupt(cid, reason)
            read = by_location[(ref.blob, ref.key)] = _Read(readers[ref.blob], entry, ref, [])
        read.names.append(name)
    return list(by_location.values())


def _target(entry: BlobEntry, dst: torch.Tensor | None) -> torch.Tensor:
    """The live tensor itself when the bytes can go straight into it, else fresh memory."""
    fits = (
        dst is not None
        and tuple(dst.shape) == entry.shape
        and dst.dtype == DTYPES[entry.dtype]
        and dst.device.type == "cpu"
        and dst.is_contiguous()
    )
    return dst if fits else torch.empty(entry.shape, dtype=DTYPES[entry.dtype])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype


def _shares(reads: list[_Read], threads: int = THREADS) -> list[list[_Read]]:
    """Split reads into `threads` lists of about equal bytes."""
    shares: list[list[_Read]] = [[] for _ in range(threads)]
    sizes = [0] * threads
    for r in sorted(reads, key=lambda r: -r.ref.nbytes):
        i = sizes.index(min(sizes))
        shares[i].append(r)
        sizes[i] += r.ref.nbytes
    return shares


def _read(r: _Read, check: bool) -> None:
    assert r.target is not None
    digest = digest_start(DTYPES[r.entry.dtype], r.entry.shape) if check and r.ref.digest else None
    try:
        r.reader.read_into(r.entry, r.target, digest)
    except (OSError, ValueError) as exc:
        r.reason = f"{r.ref.blob}: reading tensor {r.ref.key!r} failed ({exc})"
        return
    if digest is not None and digest.hexdigest() != r.ref.digest:
        r.reason = (
            f"{r.ref.blob}: tensor {r.ref.key!r} checksum mismatch: "
            f"expected xxh3-128 {r.ref.digest}, found {digest.hexdigest()}"
        )
    elif r.device_dst is not None:
        # On the read thread, so host-to-device copies overlap the other threads' reads (GPU restores).
        r.device_dst.copy_(r.target)


def _place(r: _Read, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hand the read bytes to every name using them; each name gets its own tensor."""
    assert r.target is not None
    out = {}
    for i, name in enumerate(r.names):
        dst = live.get(name)
        if dst is not None and dst is r.device_dst:
            out[name] = dst  # copied on the read thread
        elif dst is not None and dst is not r.target and _same(dst, r.target):
            out[name] = dst.copy_(r.target)  # a live tensor the bytes could not go into directly
        elif i == 0 or dst is r.target:
            out[name] = r.target
        else:
            out[name] = r.target.clone()
    return out
