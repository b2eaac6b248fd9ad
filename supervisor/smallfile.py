"""Reading a small file that could be hostile: never block on a FIFO, refuse anything but a regular file, and
never read more than a limit (policies, lineage records, checkpoint manifests and markers)."""

from __future__ import annotations

import os
import stat

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFile(ValueError):
    """The path names a directory, FIFO, device or socket; `kind` says which, in words ("a FIFO")."""

    def __init__(self, path: str, kind: str):
        self.kind = kind
        super().__init__(f"{path} is {kind}, not a regular file")


class FileTooLarge(ValueError):
    """The file holds more than the reader's limit; `size` is at least limit + 1."""

    def __init__(self, path: str, size: int, limit: int):
        self.size = size
        super().__init__(f"{path} is over {limit} bytes")


def read_small_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The whole file, at most `limit` bytes; OSError if it cannot be opened, NotRegularFile, FileTooLarge."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a regular file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((word for test, word in _KINDS if test(st.st_mode)), "a special file")
            raise NotRegularFile(os.fspath(path), kind)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(limit + 1)  # the size may have grown since fstat
    finally:
        os.close(fd)
    if max(st.st_size, len(data)) > limit:
        raise FileTooLarge(os.fspath(path), max(st.st_size, len(data)), limit)
    return data
