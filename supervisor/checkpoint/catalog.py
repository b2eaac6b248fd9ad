"""Read-only view of a store (local directory or fsspec URL): list, verify, latest, best, and gc."""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import fsspec
import xxhash
from fsspec.implementations.local import LocalFileSystem

from supervisor.checkpoint.dcp_format import sharded_problem
from supervisor.checkpoint.lock import lock_probe
from supervisor.checkpoint.manifest import (
    ABANDONED,
    BLOBS,
    CKPT_PREFIX,
    MANIFEST,
    MARKER,
    MAX_MARKER,
    Manifest,
    TensorRef,
    check_marker,
    marker_disagreement,
    marker_pin,
)
from supervisor.checkpoint.options import VERIFY_MODES, CheckpointInfo, parse_id
from supervisor.checkpoint.paths import LeavesStore, name_leaves, resolves_outside
from supervisor.checkpoint.retention import RetentionPolicy, RetentionResult, apply_retention
from supervisor.checkpoint.safetensors_header import HeaderEntry, header_length, parse_header
from supervisor.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from supervisor.smallfile import FileTooLarge, NotRegularFile, read_small_file

log = logging.getLogger("rollback_supervisor.checkpoint")
_CHUNK = 1 << 24
#: The most a manifest or state.json may hold: a 100k-tensor state's is about 30 MB.
MAX_JSON = 256 << 20


@dataclass(frozen=True)
class Listing:
    """One listing of a store: its committed checkpoints and what reading each one's manifest gave.

    A call that lists, verifies and restores passes this down, so each manifest is read once per call (on an
    object store every read is a request).
    """

    infos: list[CheckpointInfo]
    reads: dict[str, Manifest | CheckpointError] = field(default_factory=dict)

    def manifest(self, checkpoint_id: str) -> Manifest | CheckpointError | None:
        """The listed manifest, or the error reading it gave; None when this listing did not read it."""
        return self.reads.get(checkpoint_id)


class Catalog:
    """The committed checkpoints of one store, read without a live training state.

    Reads are safe while a writer saves to the same store; `gc` is not (it refuses a locked local store).
    Nothing outside the store root is ever opened: names are checked (`confined`), and on a local disk so
    are the symlinks they resolve through.
    """

    def __init__(self, fs: Any, root: str, *, tier: str = "local", url: str | None = None):
        self.fs, self.root, self.tier = fs, root.rstrip("/") or "/", tier
        self.url = url or root
        self.writer_lock: Callable[[], contextlib.AbstractContextManager[None]] | None = None
        self.on_disk = isinstance(fs, LocalFileSystem)
        # Parsed manifests by id, with the xxh3-128 of the bytes they came from: list(), verify() and a
        # restore each read the same manifest, and checking every field of a 100k-tensor one takes a while.
        self._parsed: dict[str, tuple[str, Manifest]] = {}

    def path(self, rel: str) -> str:
        """Where `rel` is, by name alone (for names the store wrote itself; `confined` for names it read)."""
        return posixpath.join(self.root, rel)

    def leaves(self, rel: str) -> str | None:
        """Why `rel` leads out of the store (its name, or on a local disk a symlink); None when it stays in."""
        why = name_leaves(rel)
        if why is None and self.on_disk:
            why = resolves_outside(self.root, self.path(rel))
        return why

    def confined(self, rel: str) -> str:
        """path(rel) after checking that it stays inside the store; LeavesStore (a ValueError) if not."""
        if why := self.leaves(rel):
            raise LeavesStore(rel, why)
        return self.path(rel)

    def read(self, rel: str, limit: int = MAX_JSON) -> bytes:
        """A whole small file of the store, at most `limit` bytes; OSError if absent, ValueError if refused."""
        path = self.confined(rel)
        if self.on_disk:  # a FIFO planted in the store must not hang a reader
            try:
                return read_small_file(path, limit)
            except NotRegularFile:
                raise ValueError(f"{rel} is not a regular file") from None
            except FileTooLarge:
                raise ValueError(f"{rel} is over {limit} bytes, more than this store ever writes") from None
        raw = self.fs.cat_file(path, start=0, end=limit + 1)
        if len(raw) > limit:
            raise ValueError(f"{rel} is over {limit} bytes, more than this store ever writes")
        return raw

    def location(self, rel: str) -> str:
        """User-facing location of `rel` (a local path or a URL)."""
        return self.path(rel) if self.tier == "local" else posixpath.join(self.url.rstrip("/"), rel)

    def ids(self) -> list[str]:
        """Ids of every checkpoint directory (committed or not), oldest commit first."""
        self.fs.invalidate_cache(self.root)  # object stores cache listings; another process may have written
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = []
        for entry in entries:
            name = posixpath.basename(str(entry).rstrip("/"))
            if name.startswith(CKPT_PREFIX):
                try:
                    parse_id(name[len(CKPT_PREFIX) :])
                except ValueError:
                    continue
                found.append(name[len(CKPT_PREFIX) :])
        return sorted(found, key=lambda i: parse_id(i)[1])

    def _read(self, rel: str, limit: int = MAX_JSON) -> bytes | None:
        """read(), or None when the file is absent; LeavesStore and other ValueErrors pass through."""
        try:
            return self.read(rel, limit)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    def _names(self, checkpoint_id: str) -> set[str]:
        ckpt = CKPT_PREFIX + checkpoint_id
        if self.leaves(ckpt):
            return set()
        try:
            return {posixpath.basename(str(p)) for p in self.fs.ls(self.path(ckpt), detail=False)}
        except (FileNotFoundError, NotADirectoryError):
            return set()

    def committed(self, checkpoint_id: str) -> bool:
        """True when the checkpoint's commit marker is whole (the commit finished).

        A checkpoint whose directory or marker leads out of the store counts as committed, so that it is
        listed and reported invalid (manifest() says why) instead of silently hidden or deleted.
        """
        try:
            marker = self._read(f"{CKPT_PREFIX}{checkpoint_id}/{MARKER}", MAX_MARKER)
        except LeavesStore:
            return True
        except ValueError:
            return False
        return marker_pin(marker) is not None

    def abandoned_ids(self) -> set[str]:
        """Committed checkpoints marked abandoned (no manifest is read)."""
        return {cid for cid in self.ids() if self.committed(cid) and ABANDONED in self._names(cid)}

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The parsed manifest of a committed checkpoint; CheckpointCorrupt if it is unreadable or edited,
        or if it, or a file it lists, leads out of the store."""
        ckpt = CKPT_PREFIX + checkpoint_id
        if why := self.leaves(ckpt):
            raise CheckpointCorrupt(checkpoint_id, str(LeavesStore(ckpt, why)))
        try:
            raw = self._read(f"{CKPT_PREFIX}{checkpoint_id}/{MANIFEST}")
            marker = self._read(f"{CKPT_PREFIX}{checkpoint_id}/{MARKER}", MAX_MARKER)
        except ValueError as exc:
            raise CheckpointCorrupt(checkpoint_id, str(exc)) from None
        if marker is None:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} not found in {self.url} (no commit marker)")
        reason = check_marker(marker, raw)
        if reason:
            raise CheckpointCorrupt(checkpoint_id, reason)
        digest = xxhash.xxh3_128_hexdigest(raw)  # type: ignore[arg-type]
        cached = self._parsed.get(checkpoint_id)
        if cached is not None and cached[0] == digest:
            manifest = cached[1]
        else:
            try:
                manifest = Manifest.from_bytes(raw)  # type: ignore[arg-type]
            except ValueError as exc:
                raise CheckpointCorrupt(checkpoint_id, str(exc)) from None
            if len(self._parsed) >= 256:  # a long-lived catalog of a store that retention turns over
                self._parsed.clear()
            self._parsed[checkpoint_id] = (digest, manifest)
        if manifest.id != checkpoint_id:
            raise CheckpointCorrupt(checkpoint_id, f"{MANIFEST} names checkpoint {manifest.id!r}")
        if reason := marker_disagreement(marker, manifest):  # type: ignore[arg-type]
            raise CheckpointCorrupt(checkpoint_id, reason)
        if self.on_disk:  # names were checked by from_bytes; on a disk, symlinks can still lead out
            for rel in [f.path for f in manifest.files] + sorted(manifest.blobs()):
                if why := resolves_outside(self.root, self.path(rel)):
                    raise CheckpointCorrupt(checkpoint_id, str(LeavesStore(rel, why)))
        return manifest

    def info(self, checkpoint_id: str) -> CheckpointInfo | None:
        """Info of a committed checkpoint (from its id alone when its manifest is bad); None if uncommitted."""
        return self._info(checkpoint_id, {})

    def _info(
        self, checkpoint_id: str, reads: dict[str, Manifest | CheckpointError]
    ) -> CheckpointInfo | None:
        """info(), recording in `reads` what reading the manifest gave."""
        if not self.committed(checkpoint_id):
            return None
        abandoned = ABANDONED in self._names(checkpoint_id)
        where = self.location(CKPT_PREFIX + checkpoint_id)
        try:
            m = self.manifest(checkpoint_id)
        except CheckpointCorrupt as exc:
            reads[checkpoint_id] = exc
            step, seq = parse_id(checkpoint_id)
            return CheckpointInfo(checkpoint_id, step, 0.0, {}, None, where, seq, (self.tier,), abandoned)
        reads[checkpoint_id] = m
        return info_from_manifest(m, where, (self.tier,), abandoned)

    def listing(self) -> Listing:
        """Every committed checkpoint, oldest commit first, with each manifest read once."""
        reads: dict[str, Manifest | CheckpointError] = {}
        infos = [i for cid in self.ids() if (i := self._info(cid, reads)) is not None]
        return Listing(infos, reads)

    def list(self) -> list[CheckpointInfo]:
        """Every committed checkpoint, oldest commit first (abandoned ones included and flagged)."""
        return self.listing().infos

    def get(self, checkpoint_id: str) -> CheckpointInfo:
        found = self.info(checkpoint_id)
        if found is None:
            raise CheckpointNotFound(f"checkpoint {checkpoint_id} not found in {self.url}")
        return found

    def verify(
        self, checkpoint_id: str, mode: str = "full", *, read: Manifest | CheckpointError | None = None
    ) -> str | None:
        """None when the checkpoint is valid, else the first reason found.

        Every mode checks the commit marker, the manifest, and that nothing it names leads out of the store;
        "fast" adds file sizes; "full" adds checksums and each blob's header against the manifest. `read` is
        what this call's caller already got from manifest() (a Listing's), so it is not read again.
        """
        if mode not in VERIFY_MODES:
            raise CheckpointError(f"verify mode: expected one of {', '.join(VERIFY_MODES)}, got {mode!r}")
        try:
            manifest = self.known_manifest(checkpoint_id, read)
        except CheckpointCorrupt as exc:
            return exc.reason
        except CheckpointNotFound:
            return f"not committed: {MARKER} marker missing"
        if mode == "none":
            return None
        if reason := sharded_problem(manifest):  # every chunk listed, and together they tile each tensor
            return reason
        listed = {f.path for f in manifest.files}
        for blob in sorted(manifest.blobs() - listed):
            return f"{MANIFEST} references {blob} without a checksum"
        for entry in manifest.files:
            reason = self._check_file(entry.path, entry.size, entry.xxh3 if mode == "full" else None)
            if reason:
                return reason
        return self._check_headers(manifest) if mode == "full" else None

    def known_manifest(self, checkpoint_id: str, read: Manifest | CheckpointError | None) -> Manifest:
        """`read` when it is a manifest, raised when it is an error; read now when None."""
        if read is None:
            return self.manifest(checkpoint_id)
        if isinstance(read, CheckpointError):
            raise read
        return read

    def _check_headers(self, manifest: Manifest) -> str | None:
        """The first tensor whose dtype, shape or byte count in the manifest disagrees with its blob's header."""
        headers: dict[str, dict[str, HeaderEntry]] = {}
        for ref in manifest.tensors.values():
            if ref.blob not in headers:
                try:
                    headers[ref.blob] = self._header(ref.blob)
                except (OSError, ValueError) as exc:
                    return f"{ref.blob}: {exc}"
            entry = headers[ref.blob].get(ref.key)
            found = None if entry is None else (entry.dtype, entry.shape, entry.end - entry.start)
            if reason := header_disagreement(ref, found):
                return reason
        return None

    def _header(self, rel: str) -> dict[str, HeaderEntry]:
        """A blob's safetensors header entries, read (at most the format's limit) and validated."""
        path = self.confined(rel)
        size = self.fs.size(path)
        with self.fs.open(path, "rb") as f:
            head = f.read(8)
            head += f.read(header_length(head, size))
        return parse_header(head, size)[1]

    def _check_file(self, rel: str, size: int, digest: str | None) -> str | None:
        try:
            found = self.fs.size(self.path(rel))
        except FileNotFoundError:
            return f"{rel} is missing"
        if found != size:
            return (
                f"{rel} is truncated: expected {size} bytes, found {found}"
                if found < size
                else (f"{rel} has the wrong size: expected {size} bytes, found {found}")
            )
        if digest is None:
            return None
        h = xxhash.xxh3_64()
        with self.fs.open(self.path(rel), "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != digest:
            return f"{rel} checksum mismatch: expected xxh3 {digest}, found {h.hexdigest()}"
        return None

    def latest(self, mode: str = "fast") -> CheckpointInfo | None:
        """The newest commit that is not abandoned and passes `mode` verification (reasons are logged)."""
        listing = self.listing()
        for info in reversed(listing.infos):
            if info.abandoned:
                continue
            reason = self.verify(info.id, mode, read=listing.manifest(info.id))
            if reason is None:
                return info
            log.warning("Skipping checkpoint %s (%s)", info.id, reason)
        return None

    def best(self, metric: str, mode: str = "min") -> CheckpointInfo | None:
        """The live checkpoint with the lowest (mode="min") or highest `metric`; ties go to the newest."""
        return best_of(self.list(), metric, mode)

    def referenced_blobs(self, infos: list[CheckpointInfo] | None = None) -> set[str]:
        """Blob files referenced by committed checkpoints (all of them when `infos` is None)."""
        refs: set[str] = set()
        for info in self.list() if infos is None else infos:
            try:
                refs |= self.manifest(info.id).blobs()
            except CheckpointError:
                continue
        return refs

    def blob_files(self) -> list[str]:
        if why := self.leaves(BLOBS):  # gc must never list, let alone delete, another directory's files
            log.warning("Not listing blobs of %s: %s", self.url, LeavesStore(BLOBS, why))
            return []
        try:
            return sorted(
                f"{BLOBS}/{posixpath.basename(str(p))}" for p in self.fs.ls(self.path(BLOBS), detail=False)
            )
        except FileNotFoundError:
            return []

    def delete(self, checkpoint_id: str) -> None:
        """Remove a checkpoint; its marker goes first so a half-finished delete never looks committed."""
        ckpt = self.path(CKPT_PREFIX + checkpoint_id)
        if self.on_disk and os.path.islink(ckpt):  # a planted link: remove it, never what it points to
            os.unlink(ckpt)
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(f"{CKPT_PREFIX}{checkpoint_id}/{MARKER}"))
        self.fs.rm(ckpt, recursive=True)

    def gc(self, policy: RetentionPolicy | None) -> RetentionResult:
        """Delete what `policy` does not keep, then blobs no remaining checkpoint references."""
        with self.writer_lock() if self.writer_lock else contextlib.nullcontext():
            result = apply_retention(policy, self.list())
            for info, reason in result.delete:
                log.info("Deleting checkpoint %s from %s (%s)", info.id, self.url, reason)
                self.delete(info.id)
            self.gc_blobs()
        return result

    def gc_blobs(self) -> list[str]:
        """Delete blob files no committed checkpoint references; returns what was deleted."""
        keep = self.referenced_blobs()
        gone = [b for b in self.blob_files() if b not in keep]
        for blob in gone:
            log.info("Deleting blob %s from %s (no checkpoint references it)", blob, self.url)
            self.fs.rm(self.path(blob))
        return gone


def info_from_manifest(m: Manifest, where: str, tiers: tuple[str, ...], abandoned: bool) -> CheckpointInfo:
    return CheckpointInfo(
        m.id,
        m.step,
        m.wall_time,
        dict(m.metrics),
        m.parent_id,
        where,
        m.seq,
        tiers,
        abandoned,
        m.nbytes,
        m.written_bytes,
        tuple(m.nonfinite),
    )


def header_disagreement(ref: TensorRef, found: tuple[str, tuple[int, ...], int] | None) -> str | None:
    """Why a blob header's (dtype name, shape, byte count) for `ref` disagrees with the manifest; None if not."""
    expected = (ref.dtype, ref.shape, ref.nbytes)
    if found == expected:
        return None
    what = "is not in the blob" if found is None else f"is {_describe(*found)}"
    return f"{ref.blob}: tensor {ref.key!r} {what}, the manifest records {_describe(*expected)}"


def _describe(dtype: str, shape: tuple[int, ...], nbytes: int) -> str:
    return f"{dtype}{list(shape)} ({nbytes} bytes)"


def best_of(infos: list[CheckpointInfo], metric: str, mode: str = "min") -> CheckpointInfo | None:
    """Best live checkpoint by `metric`; None when none has it."""
    if mode not in ("min", "max"):
        raise CheckpointError(f"best(): mode: expected 'min' or 'max', got {mode!r}")
    sign = 1.0 if mode == "min" else -1.0
    scored = [
        i for i in infos if not i.abandoned and metric in i.metrics and i.metrics[metric] == i.metrics[metric]
    ]
    return min(scored, key=lambda i: (sign * i.metrics[metric], -i.seq)) if scored else None


def open_store(directory_or_url: str | os.PathLike[str]) -> Catalog:
    """A read-only Catalog of a local directory or an fsspec URL (file://, s3://, ...)."""
    target = url = os.fspath(directory_or_url)
    if "://" in target:
        fs, root = fsspec.core.url_to_fs(target)
        if not isinstance(fs, LocalFileSystem):
            return Catalog(fs, root, tier="remote", url=target)
        target = root  # a file:// URL names a local directory: the same store, so the same writer lock
    catalog = Catalog(fsspec.filesystem("file"), os.path.abspath(target), tier="local", url=url)
    catalog.writer_lock = lock_probe(os.path.abspath(target))
    return catalog
