"""The durable lineage record on disk: read and write it atomically, fenced by the lease token.

Fencing: every take-over of the lease increments its `token`, which never goes back (a release leaves the
token in an expired lease record, and a holder raises it above the record's on open). The holder stamps each
record write with its token, and a write is refused when the stored record carries a newer one, so a
supervisor that lost its lease (a long GC pause, a frozen VM) cannot overwrite what the new holder wrote.
Locally the read-compare-write is done under a lock file; on an object store it is a check before the write
(best effort: the lease's conditional writes are the hard guarantee there).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from supervisor.errors import LeaseHeldError, UserError
from supervisor.smallfile import FileTooLarge, NotRegularFile, read_small_file

log = logging.getLogger("rollback_supervisor.lineage")

#: A lease or lineage record is a few KB; anything far larger is damage, not a record.
MAX_RECORD_BYTES = 64 << 20
#: Keys every lineage record has, and their JSON types.
RECORD_KEYS: dict[str, type | tuple[type, ...]] = {
    "lineage": str,
    "status": str,
    "segments": list,
    "mlflow": dict,
    "history": dict,
}


class LineageRecordError(UserError):
    """A lineage record on disk is not a lineage record (damaged, truncated or not JSON)."""


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


class LineageStore:
    """Read and write one lineage's record atomically. Not thread-safe; one supervisor per lineage (see Lease)."""

    def __init__(self, root: str):
        self.root = str(root)
        self.fs, self._path = url_to_fs(self.root)
        self.fs.makedirs(self._path, exist_ok=True)

    @property
    def record_path(self) -> str:
        return _join(self._path, "lineage.json")

    def load(self) -> dict[str, Any] | None:
        """The record, or None if there is none; a damaged record raises LineageRecordError."""
        try:
            if "file" in _protocols(self.fs):  # a FIFO planted as lineage.json must not hang the supervisor
                raw = read_small_file(self.record_path, MAX_RECORD_BYTES)
            else:
                with self.fs.open(self.record_path, "rb") as fh:
                    raw = fh.read(MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        except (NotRegularFile, FileTooLarge) as exc:
            raise LineageRecordError(f"lineage record {exc}; it is damaged") from None
        return parse_record(raw, self.record_path)

    def save(self, record: dict[str, Any], fence: int | None = None) -> None:
        """Write `record`; with a `fence` (the lease token), refuse if a newer lease holder wrote it last."""
        if fence is None:
            write_json_atomic(self.fs, self.record_path, record)
            return
        with self._locked():
            try:
                stored = self.load()
            except LineageRecordError:
                stored = None  # a damaged record is replaced by the holder's good one
            newer = (stored or {}).get("lease_token", 0)
            if isinstance(newer, int) and newer > fence:
                raise LeaseHeldError(
                    f"lineage record {self.record_path} was written by a newer lease holder (token {newer} > "
                    f"ours {fence}); this supervisor lost its lease and stops without writing"
                )
            record["lease_token"] = fence
            write_json_atomic(self.fs, self.record_path, record)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive flock around a read-compare-write of a local record; nothing on object stores."""
        if "file" not in _protocols(self.fs):
            yield
            return
        fd = os.open(self.record_path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


def decode_record(raw: bytes, where: str) -> Any:
    """A lineage record's bytes as JSON; LineageRecordError (one line) for anything that is not JSON."""
    if len(raw) > MAX_RECORD_BYTES:
        raise LineageRecordError(f"lineage record {where} is over {MAX_RECORD_BYTES >> 20} MB; it is damaged")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LineageRecordError(
            f"lineage record {where} is not valid JSON ({type(exc).__name__}: {str(exc)[:120]}); restore it "
            "from a backup or start a new lineage with another --lineage"
        ) from None


def parse_record(raw: bytes, where: str) -> dict[str, Any]:
    """Validate a lineage record's bytes: a JSON object with the keys every record has."""
    record = decode_record(raw, where)
    if not isinstance(record, dict):
        raise LineageRecordError(
            f"lineage record {where}: expected a JSON object, found {type(record).__name__}"
        )
    for key, kind in RECORD_KEYS.items():
        if not isinstance(record.get(key), kind):
            found = type(record.get(key)).__name__ if key in record else "nothing"
            raise LineageRecordError(
                f"lineage record {where}: key {key!r}: expected {getattr(kind, '__name__', kind)}, found {found}"
            )
    for i, seg in enumerate(record["segments"]):
        if not isinstance(seg, dict):
            raise LineageRecordError(f"lineage record {where}: segments[{i}]: expected an object")
    return record


def write_json_atomic(fs: fsspec.AbstractFileSystem, path: str, data: Any) -> None:
    """Local: temp file, fsync, rename. Object stores: a single PUT is already all-or-nothing."""
    text = json.dumps(data, indent=2, sort_keys=True, default=str)
    if fs.protocol in ("file", "local") or "file" in fs.protocol:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    else:
        with fs.open(path, "w") as fh:
            fh.write(text)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
