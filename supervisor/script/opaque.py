"""A file's bytes as a blob of the store: a safetensors file holding one U8 tensor, streamed, never parsed.

The store keeps tensors in safetensors blobs and verifies them by size, xxh3 and header. Holding a script's
file as one `U8` tensor of its bytes lets every reader of the store (verification, retention, gc, `checkpoints
list`) treat it like any other blob, while the bytes stay opaque: nothing here, or anywhere, unpickles them.
Copies stream in chunks, so a file larger than memory costs one read and one write. The digest is the one
`blobs.tensor_digest` gives a uint8 tensor of the same bytes (xxh3-128 primed with dtype and shape), so a
version's tensors are checked the way a training checkpoint's are.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from supervisor.checkpoint.safetensors_header import header_length, parse_header

DTYPE = "U8"
CHUNK = 1 << 22


def digest_start(nbytes: int) -> Any:
    """An xxh3-128 state primed as `blobs.digest_start(torch.uint8, (nbytes,))` primes it."""
    return xxhash.xxh3_128(f"torch.uint8{(nbytes,)}".encode())


def file_digest(path: Path | str) -> tuple[str, int]:
    """(digest, size) of a file's bytes, read once."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h = digest_start(size)
        read = _copy(f, None, h, size)
    if read != size:
        raise OSError(f"{path} changed size while it was read ({size} -> {read} bytes)")
    return h.hexdigest(), size


def write_blob(
    src: Path | str, dst: Path | str, key: str, metadata: dict[str, str]
) -> tuple[str, int, str, int]:
    """Copy `src` into a new blob `dst` as tensor `key`, fsynced; returns (digest, nbytes, blob xxh3-64, blob size).

    OSError if `src` changes size while it is copied (the caller checks its signature again afterwards).
    """
    with open(src, "rb") as f:
        nbytes = os.fstat(f.fileno()).st_size
        header = {
            "__metadata__": metadata,
            key: {"dtype": DTYPE, "shape": [nbytes], "data_offsets": [0, nbytes]},
        }
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        whole, digest = xxhash.xxh3_64(head), digest_start(nbytes)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, head)
            copied = _copy(f, fd, digest, nbytes, whole)
            os.fsync(fd)
        finally:
            os.close(fd)
    if copied != nbytes:
        raise OSError(f"{src} changed size while it was copied ({nbytes} -> {copied} bytes)")
    return digest.hexdigest(), nbytes, whole.hexdigest(), len(head) + nbytes


def read_blob(blob: Path | str, key: str, dst_fd: int) -> tuple[str, int]:
    """Write tensor `key` of `blob` to `dst_fd`; returns (digest, bytes). ValueError on a malformed blob."""
    with open(blob, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        head += f.read(header_length(head, size))
        base, entries = parse_header(head, size)
        entry = entries.get(key)
        if entry is None or entry.dtype != DTYPE:
            raise ValueError(f"{blob}: no {DTYPE} tensor {key!r}")
        nbytes = entry.end - entry.start
        f.seek(base + entry.start)
        digest = digest_start(nbytes)
        copied = _copy(f, dst_fd, digest, nbytes)
    if copied != nbytes:
        raise ValueError(f"{blob}: tensor {key!r} is cut short ({copied} of {nbytes} bytes)")
    return digest.hexdigest(), nbytes


def _copy(src: BinaryIO, dst_fd: int | None, digest: Any, limit: int, also: Any = None) -> int:
    """Copy up to `limit` bytes from `src` to `dst_fd` (None: only hash), feeding the hashes; bytes copied."""
    done = 0
    while done < limit:
        chunk = src.read(min(CHUNK, limit - done))
        if not chunk:
            break
        digest.update(chunk)
        if also is not None:
            also.update(chunk)
        if dst_fd is not None:
            _write_all(dst_fd, chunk)
        done += len(chunk)
    if done == limit and src.read(1):
        done += 1  # it grew while we read: report a size that differs
    return done


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
