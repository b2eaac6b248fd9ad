"""The safetensors header, read as the format says and no further: bounded, validated, torch-free.

Layout: 8 bytes little-endian header length N, N bytes of JSON, then the data region. The JSON is an object:
`__metadata__` (optional, a str -> str map) and, per tensor, `{"dtype", "shape", "data_offsets": [b, e]}`
with offsets relative to the data region. The format also says the entries cover the data region exactly,
with no holes and no overlaps; anything else is refused here with a one-line reason (ValueError).
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from supervisor.checkpoint.boundedjson import loads_bounded, preview

#: Bytes per element, by the format's dtype names (those this store writes and reads).
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "C64": 8,
    "U16": 2,
    "U32": 4,
    "U64": 8,
}
#: The reference implementation refuses headers over 100 MB; so do we, before reading them.
MAX_HEADER = 100_000_000
#: {tensor: {"shape": [...]}} is three levels; `__metadata__` is two.
MAX_DEPTH = 3
METADATA = "__metadata__"
_HUGE = 1 << 64


class HeaderEntry(NamedTuple):
    """One tensor as the header describes it: its byte range in the data region, dtype name and shape.

    A tuple, ordered by position, because a large model's header has tens of thousands of them.
    """

    start: int
    end: int
    dtype: str
    shape: tuple[int, ...]


def header_length(prefix: bytes, file_size: int) -> int:
    """The JSON header's length from a file's first 8 bytes; ValueError when it cannot be a valid header."""
    if len(prefix) < 8:
        raise ValueError(f"file is {file_size} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER:
        raise ValueError(f"header length {n} is over the format's limit of {MAX_HEADER} bytes")
    if 8 + n > file_size:
        raise ValueError(f"header length {n} runs past the end of the file ({file_size} bytes)")
    return n


def parse_header(head: bytes, file_size: int) -> tuple[int, dict[str, HeaderEntry]]:
    """Parse and validate a header (`head`: the file's first 8 + N bytes); returns (data start, entries)."""
    n = header_length(head, file_size)
    if len(head) < 8 + n:
        raise ValueError(f"header is cut short: {len(head) - 8} of {n} bytes")
    raw = loads_bounded(bytes(head[8 : 8 + n]), max_depth=MAX_DEPTH, what="header")
    if not isinstance(raw, dict):
        raise ValueError(f"header: expected a JSON object, found {_kind(raw)}")
    base, data_size = 8 + n, file_size - 8 - n
    entries: dict[str, HeaderEntry] = {}
    for name, e in raw.items():
        if name == METADATA:
            _check_metadata(e)
        else:
            entries[name] = _entry(name, e, data_size)
    _check_coverage(entries, data_size)
    return base, entries


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _check_metadata(meta: Any) -> None:
    if meta is None:
        return
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"header: {METADATA} must map strings to strings, found {_kind(meta)}")


def shape_bytes(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    """Bytes of a tensor of `shape` and safetensors `dtype`; saturates past 2**64 (no file is that large)."""
    numel = 1
    for d in shape:
        numel = min(numel * d, _HUGE)  # a planted shape of 4000-digit dims must not cost bignum time
    return numel * ITEMSIZE[dtype]


def _entry(name: str, e: Any, data_size: int) -> HeaderEntry:
    # Written for speed as much as clarity: a large model's header has tens of thousands of entries.
    if type(e) is not dict:
        raise ValueError(f"header: tensor {preview(name)}: expected an object, found {_kind(e)}")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if type(dtype) is not str or dtype not in ITEMSIZE:
        raise ValueError(
            f"header: tensor {preview(name)}: dtype {preview(dtype)} is not one of {', '.join(ITEMSIZE)}"
        )
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"header: tensor {preview(name)}: shape {preview(shape)} is not a list of counts")
    if type(offsets) is not list or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise ValueError(
            f"header: tensor {preview(name)}: data_offsets {preview(offsets)} is not a pair of integers"
        )
    start, end = offsets
    if not 0 <= start <= end <= data_size:
        raise ValueError(
            f"header: tensor {preview(name)}: data_offsets {preview(offsets)} lie outside the "
            f"{data_size}-byte data region"
        )
    nbytes = shape_bytes(dtype, shape)
    if nbytes != end - start:
        raise ValueError(
            f"header: tensor {preview(name)}: shape {preview(shape)} x {dtype} is "
            f"{nbytes if nbytes < _HUGE else 'over 2**64'} bytes, its data_offsets span {end - start}"
        )
    return HeaderEntry(start, end, dtype, tuple(shape))


def _check_coverage(entries: dict[str, HeaderEntry], data_size: int) -> None:
    """The entries tile the data region: no overlap, no hole, nothing after the last one."""
    at, previous = 0, None
    for e in sorted(entries.values()):  # by start, then end: tuples, so no key function per entry
        if e.start < at:
            raise ValueError(
                f"header: tensor {preview(_name(entries, e))} overlaps tensor {preview(_name(entries, previous))} "
                f"(bytes {e.start} < {at})"
            )
        if e.start > at:
            raise ValueError(
                f"header: a hole in the data region before tensor {preview(_name(entries, e))} (bytes {at}-{e.start})"
            )
        at, previous = e.end, e
    if at != data_size:
        raise ValueError(f"header: the tensors end at byte {at} of a {data_size}-byte data region")


def _name(entries: dict[str, HeaderEntry], entry: HeaderEntry | None) -> str | None:
    return next((n for n, e in entries.items() if e is entry), None)
