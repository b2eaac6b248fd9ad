"""The lineage lease: two supervisors never drive one lineage at once; a keeper thread renews it."""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs

from supervisor.errors import LeaseHeldError
from supervisor.lineage.store import MAX_RECORD_BYTES, _join, _protocols, write_json_atomic

log = logging.getLogger("rollback_supervisor.lineage")


def _dead_here(owner: str) -> bool:
    """A holder on this host whose process is gone (SIGKILL) need not be waited for until expiry."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    import psutil

    return not psutil.pid_exists(int(pid))


def parse_lease(raw: bytes) -> dict[str, Any] | None:
    """A lease record's fields, or None if the bytes are not one (damage: treated as no valid holder)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("owner"), str):
        return None
    expires, token = data.get("expires_at"), data.get("token", 0)
    if not _number(expires) or not isinstance(token, int) or isinstance(token, bool):
        return None
    return data


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class Lease:
    """A lease with expiry in the storage: two supervisors never drive one lineage at once.

    Local storage guards the take-over with an exclusive lock file. S3 (and compatible stores) use conditional
    writes: `If-None-Match: *` when there is no holder, `If-Match: <etag>` to replace the record that was
    judged expired, so of two supervisors racing for one lease exactly one write succeeds. Other object stores
    fall back to write-then-read-back, which narrows the race but cannot close it.
    A holder must `renew()` more often than `ttl_seconds` (`LeaseKeeper` does it on a thread); a crashed
    holder's lease expires. Each take-over increments `token`, the fencing token of the record writes.
    A damaged lease file counts as no holder (writes are atomic, so damage is not a holder mid-write).
    Thread-safety: `renew` (the keeper's thread) may run beside `check`; `acquire`/`release` are not
    concurrent with anything.
    """

    root: str
    ttl_seconds: float = 60.0
    owner: str = ""
    clock: Any = time.time
    token: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.fs, self._dir = url_to_fs(self.root)
        self.fs.makedirs(self._dir, exist_ok=True)
        self.path = _join(self._dir, "lease.json")
        self.owner = self.owner or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._raw: bytes | None = None  # the bytes `holder()` last read: what a compare-and-swap replaces
        self._floor = 0  # the token of a released lease last read: the next take-over goes above it
        self._released_by = ""  # who released the lease last read (a keeper of ours stops quietly)

    def holder(self) -> dict[str, Any] | None:
        """The current lease record; a damaged one reads as an expired lease of nobody."""
        self.fs.invalidate_cache(self.path)  # object stores: never judge a lease from a cached listing
        try:
            raw = self.fs.cat_file(self.path)
        except FileNotFoundError:
            self._raw, self._floor, self._released_by = None, 0, ""
            return None
        self._raw = raw
        parsed = parse_lease(raw[: MAX_RECORD_BYTES + 1])
        if parsed is None:
            log.warning("lease %s is damaged (%d bytes); treating it as expired", self.path, len(raw))
            return {"owner": "", "expires_at": 0.0, "token": 0, "damaged": True}
        if parsed["owner"] == "":  # released: nobody holds it, and its token is the floor of the next
            self._floor, self._released_by = parsed["token"], str(parsed.get("released_by", ""))
            return None
        return parsed

    def _takeable(self, current: dict[str, Any] | None) -> bool:
        return (
            current is None
            or current.get("owner") == self.owner
            or current["expires_at"] < self.clock()
            or _dead_here(current["owner"])
        )

    def acquire(self, wait_seconds: float = 0.0, sleep=time.sleep) -> None:
        """Take the lease, waiting up to `wait_seconds` for the holder to release or expire."""
        deadline = self.clock() + wait_seconds
        while True:
            current = self.holder()
            if self._takeable(current) and self._take(current):
                return
            if self.clock() >= deadline:
                current = self.holder() or {}
                left = max(0.0, current.get("expires_at", 0) - self.clock())
                raise LeaseHeldError(
                    f"lineage at {self.root} is driven by {current.get('owner') or '?'} (lease expires in "
                    f"{left:.0f}s); wait for it to finish, stop it, or pass a longer --lease-wait"
                )
            sleep(min(1.0, max(0.05, deadline - self.clock())))

    def _take(self, seen: dict[str, Any] | None, token: int | None = None) -> bool:
        # The owner string is unique to one supervisor process: the same owner is a renewal or a hand-over
        # inside that process (the CLI takes the lease before Prefect starts, the flow adopts it).
        ours = seen is not None and seen.get("owner") == self.owner
        base = seen.get("token", 0) if seen else self._floor
        record = {
            "owner": self.owner,
            "expires_at": self.clock() + self.ttl_seconds,
            "acquired_at": seen["acquired_at"] if ours and seen and "acquired_at" in seen else self.clock(),
            "token": token if token is not None else (base if ours else base + 1),
        }
        return self._write(seen, record)

    def _write(self, seen: dict[str, Any] | None, record: dict[str, Any]) -> bool:
        """Replace exactly what was last read with `record` (compare-and-swap where the storage allows it)."""
        if "file" in self.fs.protocol:
            ok = self._take_local(seen, record)
        elif "s3" in _protocols(self.fs):
            ok = self._swap(record)
        else:
            write_json_atomic(self.fs, self.path, record)
            time.sleep(0.2)
            now = self.holder()
            ok = now is None if record["owner"] == "" else (now or {}).get("owner") == self.owner
        if ok:
            self.token = record["token"]
        return ok

    def _take_local(self, seen: dict[str, Any] | None, record: dict[str, Any]) -> bool:
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
            before = self._raw
            now = self.holder()
            if now != seen or (seen is not None and self._raw != before):
                return False
            write_json_atomic(self.fs, self.path, record)
            return True
        finally:
            os.close(fd)
            os.unlink(lock)

    def _swap(self, record: dict[str, Any]) -> bool:
        """Compare-and-swap on S3: replace exactly the bytes last read (or create one where there was none)."""
        data = json.dumps(record, indent=2, sort_keys=True).encode()
        seen_raw = self._raw
        if seen_raw is None:
            condition = {"mode": "create"}  # If-None-Match: *
        else:
            etag = self._etag_of(seen_raw)
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

    def _etag_of(self, seen_raw: bytes) -> str | None:
        """The ETag of the stored record if it still holds `seen_raw`; None if it changed or vanished."""
        self.fs.invalidate_cache(self.path)
        try:
            before = self.fs.info(self.path)["ETag"]
            current = self.fs.cat_file(self.path)
            self.fs.invalidate_cache(self.path)
            after = self.fs.info(self.path)["ETag"]
        except (FileNotFoundError, KeyError):
            return None
        return before if before == after and current == seen_raw else None

    def check(self) -> None:
        """Raise LeaseHeldError unless this supervisor holds the lease, unexpired, with its own token."""
        current = self.holder()
        if (
            current is None
            or current.get("owner") != self.owner
            or current.get("token") != self.token
            or current["expires_at"] <= self.clock()
        ):
            who = (current or {}).get("owner") or "nobody"
            raise LeaseHeldError(
                f"lost the lease on {self.root} to {who}; this supervisor stops without "
                "launching or writing anything"
            )

    def renew(self) -> None:
        """Extend the lease; raise LeaseHeldError if another supervisor holds it or the extension failed.

        A lease of ours that expired unnoticed (a paused process) but that nobody took is simply extended:
        the take is a compare-and-swap, so it cannot overwrite a new holder.
        """
        current = self.holder()
        if current is None or current.get("owner") != self.owner or current.get("token") != self.token:
            self.check()  # raises, naming the holder
        if not self._take(current):
            self.check()  # a failed write may still leave our unexpired lease (a racing lock file)

    def advance(self, above: int) -> None:
        """Raise our token above `above` (the lineage record's), so our fenced writes are accepted.

        A lease file lost or damaged meanwhile restarts its tokens low; the record remembers the highest.
        """
        if self.token > above:
            return
        current = self.holder()
        if current is None or current.get("owner") != self.owner or current.get("token") != self.token:
            self.check()
        if not self._take(current, token=above + 1):
            self.check()
            raise LeaseHeldError(f"could not raise the lease token on {self.root}; try again")

    def release(self) -> None:
        """Give the lease up: an expired record of nobody that keeps the token, so tokens never go back."""
        current = self.holder()
        if current and current.get("owner") == self.owner and current.get("token") == self.token:
            released = {
                "owner": "",
                "expires_at": 0.0,
                "token": self.token,
                "released_by": self.owner,
                "released_at": self.clock(),
            }
            if not self._write(current, released):
                log.warning("could not release the lease on %s; it expires on its own", self.root)
        self.token = 0


class LeaseKeeper:
    """Renews a held lease on a thread every `ttl/3` s, for as long as the supervisor holds it.

    Every wait of the supervisor (the segment watch, the backoff delay, deciding, reporting) is covered. A
    renewal that finds the lease lost stops the keeper and is re-raised by the next `check()`.
    """

    def __init__(self, lease: Lease, interval: float | None = None):
        self.lease = lease
        self.interval = interval if interval is not None else max(0.05, lease.ttl_seconds / 3)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._error: LeaseHeldError | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> LeaseKeeper:
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        """Renew until stopped or until a loss is confirmed; any other failure is retried at the next tick."""
        while not self._stop.wait(self.interval):
            try:
                with self._lock:
                    self.lease.renew()
            except LeaseHeldError as exc:
                if self.lease._released_by == self.lease.owner:  # this process released it: the run ended
                    return
                log.error("%s", exc)
                self._error = exc
                return
            except Exception as exc:  # storage hiccup: retry at the next tick, the TTL leaves 2 more tries
                log.warning("could not renew the lease on %s: %s", self.lease.root, exc)

    def renew_now(self) -> None:
        """Renew at once (before a launch), raising LeaseHeldError if the lease was lost."""
        if self._error is not None:
            raise self._error
        with self._lock:
            self.lease.renew()

    def check(self) -> None:
        """Raise the loss a renewal found, else verify the lease against the storage now."""
        if self._error is not None:
            raise self._error
        with self._lock:
            self.lease.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
