"""json.loads for store files a hostile writer may have shaped: nesting is bounded before anything recurses.

`json.loads` recurses once per nesting level, so `[[[[...]]]]` 100k deep raises RecursionError (or worse,
inside a caller that catches only ValueError). The check below runs as a few C-speed passes over the bytes
(about 2 ms for a 2 MB safetensors header): strings are cut out, every byte but brackets is dropped, and
innermost `{}`/`[]` pairs are removed once per level allowed.
"""

from __future__ import annotations

import json
import re
from typing import Any

#: Everything but brackets, quotes and backslashes: deleted first, so the scan works on a small string.
_NOISE = bytes(sorted(set(range(256)) - set(b'{}[]"\\')))
_INNERMOST = re.compile(rb"\{\}|\[\]")


def nesting_within(raw: bytes, limit: int) -> bool:
    """True when no object or array in JSON text `raw` nests more than `limit` deep (and brackets balance).

    Escaped backslashes, then escaped quotes, are dropped; the quotes left delimit strings, whose brackets
    do not count. Only `"`, `\\` and brackets survive the first `translate`, so this stays a few C passes.
    """
    text = raw.translate(None, _NOISE)
    if b"\\" in text:
        text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOISE)
    shape = b"".join(text.split(b'"')[::2])
    for _ in range(limit):
        if not shape:
            return True
        shape = _INNERMOST.sub(b"", shape)
    return not shape


def loads_bounded(raw: bytes, *, max_depth: int, what: str) -> Any:
    """Parse JSON `raw`; ValueError naming `what` when it is not JSON or nests deeper than `max_depth`."""
    if not isinstance(raw, bytes | bytearray | memoryview):
        raise ValueError(f"{what}: expected bytes, got {type(raw).__name__}")
    raw = bytes(raw)
    if not nesting_within(raw, max_depth):
        raise ValueError(f"{what} nests deeper than {max_depth} levels, or its brackets do not balance")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what} is not valid JSON ({_one_line(exc)})") from None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:200] + "..."


def preview(value: object, limit: int = 60) -> str:
    """repr(value) on one line, cut to about `limit` characters: for messages quoting what a file holds."""
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[:limit] + "..."
