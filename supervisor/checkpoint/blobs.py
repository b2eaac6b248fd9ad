"""Safetensors files written and read by hand so hashing streams with the write and restores copy once.

The `safetensors` package is used only to check interoperability in tests: its writer cannot hash while it
writes, and its reader allocates a new tensor per entry where we copy straight into live buffers.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from collections.abc import Mapping
from typing import Any, BinaryIO

import torch
import xxhash

from supervisor.checkpoint import safetensors_header
from supervisor.dtypes import DTYPE_NAMES as DTYPE_NAMES  # re-exported: the table lives below the store
from supervisor.dtypes import DTYPES

assert DTYPES.keys() == safetensors_header.ITEMSIZE.keys()
_CHUNK = 1 << 20  # read and hash a chunk while it is still in cache


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def digest_start(dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
    """An xxh3-128 state primed with a tensor's dtype and shape; feed it the bytes."""
    return xxhash.xxh3_128(f"{dtype}{tuple(shape)}".encode())


def tensor_digest(tensor: torch.Tensor) -> str:
    """Content hash of a CPU tensor: dtype, shape and bytes (xxh3-128)."""
    h = digest_start(tensor.dtype, tuple(tensor.shape))
    h.update(tensor_bytes(tensor))
    return h.hexdigest()


def write_blob(
    path: str, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> tuple[int, str]:
    """Write `tensors` (contiguous CPU) as a safetensors file, fsync it; returns (size, xxh3-64)."""
    # Largest elements first keeps every tensor aligned to its element size, as the reference writer does.
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = xxhash.xxh3_64()
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(raw)), raw):
            h.update(piece)
            f.write(piece)
        for name in order:
            data = tensor_bytes(tensors[name])
            h.update(data)
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset, h.hexdigest()


#: Where one tensor lies in a blob file: byte range in the data region, safetensors dtype name, shape.
BlobEntry = safetensors_header.HeaderEntry


def parse_header(head: bytes, file_size: int) -> tuple[int, dict[str, BlobEntry]]:
    """Parse and validate a safetensors header; returns (data start, entries). ValueError says what is wrong."""
    return safetensors_header.parse_header(head, file_size)


class BlobReader:
    """An open blob file: its header, and reads of single tensors straight into caller-owned memory."""

    def __init__(self, path: str):
        self.path = path
        # O_NONBLOCK: a FIFO planted under a blob's name must not hang the restore; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        self._f = open(fd, "rb", buffering=0)  # noqa: SIM115 - closed by close()
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            self.size = info.st_size
            self.head = _read_head(self._f, self.size)
            self.base, self.entries = parse_header(self.head, self.size)
        except BaseException:
            self._f.close()
            raise

    def read_into(self, entry: BlobEntry, dst: torch.Tensor, digest: Any = None) -> None:
        """Fill contiguous CPU tensor `dst` (same byte size as `entry`) from the file, feeding `digest`
        each chunk while it is still in cache."""
        view = tensor_bytes(dst)
        done, offset = 0, self.base + entry.start
        while done < len(view):
            n = os.preadv(self._f.fileno(), [view[done : done + _CHUNK]], offset + done)
            if n <= 0:
                raise ValueError(f"file ends inside tensor data at byte {offset + done}")
            if digest is not None:
                digest.update(view[done : done + n])
            done += n

    def close(self) -> None:
        self._f.close()


def _read_head(f: BinaryIO, size: int) -> bytes:
    """The first 8 + N bytes (N from the first 8), N checked against the file and the format's limit first."""
    head = f.read(8)
    n = safetensors_header.header_length(head, size)
    while len(head) < 8 + n and (chunk := f.read(8 + n - len(head))):
        head += chunk
    return head
