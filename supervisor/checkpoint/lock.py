"""The writer lock of a local store: one writer per store directory, held with flock until released."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator

from supervisor.errors import CheckpointError

LOCK = ".lock"


def take_lock(root: str) -> int:
    """Take the exclusive writer lock of the store at `root`; the fd holds it until closed."""
    fd = os.open(os.path.join(root, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            raise CheckpointError(
                f"{root}: another writer (pid {holder}) holds the store lock {LOCK}; "
                "close its CheckpointManager first"
            ) from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd


def lock_probe(root: str):
    """A context manager factory holding the writer lock of `root` (CheckpointError while a writer has it)."""

    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        if not os.path.isdir(root):
            yield
            return
        fd = take_lock(root)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    return hold
