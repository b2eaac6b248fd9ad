"""Durable lineage record and lease, stored next to the checkpoints (local path or fsspec URL).

Everything a new flow run needs to resume lives here: events, decisions, budgets spent (the policy
history), the MLflow run, the segments so far and the plan for the next one.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from supervisor.errors import LeaseHeldError


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
        try:
            with self.fs.open(self.record_path, "r") as fh:
                return json.load(fh)
        except FileNotFoundError:
            return None

    def save(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.fs, self.record_path, record)


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


def _dead_here(owner: str) -> bool:
    """A holder on this host whose process is gone (SIGKILL) need not be waited for until expiry."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    import psutil

    return not psutil.pid_exists(int(pid))


@dataclass
class Lease:
    """A lease with expiry in the storage: two supervisors never drive one lineage at once.

    Local storage guards the take-over with an exclusive lock file. S3 (and compatible stores) use conditional
    writes: `If-None-Match: *` when there is no holder, `If-Match: <etag>` to replace the record that was
    judged expired, so of two supervisors racing for one lease exactly one write succeeds. Other object stores
    fall back to write-then-read-back, which narrows the race but cannot close it.
    A holder must `renew()` more often than `ttl_seconds`; a crashed holder's lease expires.
    """

    root: str
    ttl_seconds: float = 60.0
    owner: str = ""
    clock: Any = time.time

    def __post_init__(self) -> None:
        self.fs, self._dir = url_to_fs(self.root)
        self.fs.makedirs(self._dir, exist_ok=True)
        self.path = _join(self._dir, "lease.json")
        self.owner = self.owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"

    def holder(self) -> dict[str, Any] | None:
        self.fs.invalidate_cache(self.path)  # object stores: never judge a lease from a cached listing
        try:
            with self.fs.open(self.path, "r") as fh:
                return json.load(fh)
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def acquire(self, wait_seconds: float = 0.0, sleep=time.sleep) -> None:
        """Take the lease, waiting up to `wait_seconds` for the holder to release or expire."""
        deadline = self.clock() + wait_seconds
        while True:
            current = self.holder()
            if (
                current is None
                or current.get("owner") == self.owner
                or current.get("expires_at", 0) < self.clock()
                or _dead_here(current.get("owner", ""))
            ):
                if self._take(current):
                    return
            if self.clock() >= deadline:
                current = self.holder() or {}
                left = max(0.0, current.get("expires_at", 0) - self.clock())
                raise LeaseHeldError(
                    f"lineage at {self.root} is driven by {current.get('owner', '?')} (lease expires in {left:.0f}s); "
                    "wait for it to finish, stop it, or pass a longer --lease-wait"
                )
            sleep(min(1.0, max(0.05, deadline - self.clock())))

    def _take(self, seen: dict[str, Any] | None) -> bool:
        record = {
            "owner": self.owner,
            "expires_at": self.clock() + self.ttl_seconds,
            "acquired_at": self.clock(),
        }
        if "file" in self.fs.protocol:
            lock = self.path + ".lock"
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                # A lock file older than the TTL belongs to a holder that died mid-take-over.
                try:
                    if time.time() - os.path.getmtime(lock) > self.ttl_seconds:
                        os.unlink(lock)
                except FileNotFoundError:
                    pass
                return False
            try:
                if self.holder() != seen:
                    return False
                write_json_atomic(self.fs, self.path, record)
                return True
            finally:
                os.close(fd)
                os.unlink(lock)
        if "s3" in _protocols(self.fs):
            return self._swap(seen, record)
        write_json_atomic(self.fs, self.path, record)
        time.sleep(0.2)
        return (self.holder() or {}).get("owner") == self.owner

    def _swap(self, seen: dict[str, Any] | None, record: dict[str, Any]) -> bool:
        """Compare-and-swap on S3: replace exactly the record `seen` (or create one where there was none)."""
        data = json.dumps(record, indent=2, sort_keys=True).encode()
        if seen is None:
            condition = {"mode": "create"}  # If-None-Match: *
        else:
            etag = self._etag_of(seen)
            if etag is None:
                return False  # it changed since it was judged: look again
            condition = {"IfMatch": etag}
        try:
            self.fs.pipe_file(self.path, data, **condition)
        except (OSError, FileExistsError):
            return False  # 412 Precondition Failed: another supervisor wrote first
        finally:
            self.fs.invalidate_cache(self.path)
        return True

    def _etag_of(self, seen: dict[str, Any]) -> str | None:
        """The ETag of the stored record if it still is `seen`; None if it changed or vanished meanwhile."""
        self.fs.invalidate_cache(self.path)
        try:
            before = self.fs.info(self.path)["ETag"]
            current = json.loads(self.fs.cat_file(self.path))
            self.fs.invalidate_cache(self.path)
            after = self.fs.info(self.path)["ETag"]
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            return None
        return before if before == after and current == seen else None

    def renew(self) -> None:
        current = self.holder()
        if current is None or current.get("owner") != self.owner:
            raise LeaseHeldError(
                f"lost the lease on {self.root} to {current and current.get('owner')}; stopping"
            )
        self._take(current)

    def release(self) -> None:
        current = self.holder()
        if current and current.get("owner") == self.owner:
            self.fs.rm(self.path)
