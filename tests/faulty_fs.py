"""Filesystems that fail, for the storage-fault tests.

Real ones where this machine lets a test mount (root, as in CI here): a size-limited tmpfs (ENOSPC), and an
ext4 filesystem on a loop device whose backing file is cut short under it, so that writes landing past the cut
fail with EIO (a dying disk, a lost SAN path), or which the kernel turns read-only under the writer, as ext4
does on an error with `errors=remount-ro` (a plain `mount -o remount,ro` is refused while a file is open for
writing, and the store keeps its lock file open). Where mounting is not allowed,
those tests skip with the reason, and `FaultyFileSystem` (an fsspec filesystem that fails from its Nth write
on) still drives the remote tier's failures.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
import subprocess
import uuid
from pathlib import Path
from typing import Any, ClassVar

from fsspec import register_implementation
from fsspec.implementations.local import LocalFileSystem

PAGE = 4096
_FIEMAP = 0xC020660B  # FS_IOC_FIEMAP: where a file's extents lie on the device


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout.strip()


def mount_refused(probe_dir: Path) -> str | None:
    """Why a test cannot mount a tmpfs here, or None if it can (tried for real, then undone)."""
    probe_dir.mkdir(parents=True, exist_ok=True)
    try:
        _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe_dir))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"cannot mount a tmpfs here ({detail.strip()})"
    _run("umount", str(probe_dir))
    return None


class SmallDisk:
    """A size-limited tmpfs mounted at `path` for one test: fill it up, give the space back."""

    def __init__(self, path: Path, size: int):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path))
        self._fillers: list[Path] = []

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int = 0) -> None:
        """Take all free space but `leave` bytes (whole pages), as another process filling the disk would."""
        filler = self.path / f"filler-{uuid.uuid4().hex[:8]}"
        self._fillers.append(filler)
        with open(filler, "wb") as f:
            todo = self.free() - leave
            while todo > 0:
                try:
                    todo -= f.write(b"\0" * min(todo, 1 << 20))
                except OSError as exc:  # leave=0: the last page may not fit exactly
                    if exc.errno != errno.ENOSPC:
                        raise
                    break

    def unfill(self) -> None:
        for filler in self._fillers:
            filler.unlink(missing_ok=True)
        self._fillers = []

    def unmount(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("umount", str(self.path))
            return
        _run("umount", "-l", str(self.path))  # a file left open by a failed test: detach it anyway


class LoopDisk:
    """ext4 (no journal) on a loop device at `path`. `cut()` shrinks the device to just past the blocks in use,
    so new data lands beyond its end and fails with EIO (at fsync) while what is stored stays readable;
    `fail_read_only()` makes the kernel remount it read-only, open files and all."""

    def __init__(self, path: Path, image: Path, size_mb: int = 64):
        self.path, self.image, self.size = Path(path), Path(image), size_mb << 20
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        _run("mkfs.ext4", "-q", "-F", "-b", str(PAGE), "-O", "^has_journal", "-E", "nodiscard", str(image))
        self.loop = _run("losetup", "-f", "--show", str(self.image))
        try:
            _run("mount", "-o", "errors=continue", self.loop, str(self.path))
        except BaseException:
            _run("losetup", "-d", self.loop)
            raise

    def cut(self, margin: int = 64 * PAGE) -> None:
        """Shrink the device to `margin` bytes past the last data block of any file now on it."""
        os.sync()
        top = max(
            (_last_byte(Path(root) / name) for root, _, names in os.walk(self.path) for name in names),
            default=0,
        )
        self._resize(-(-(top + margin) // PAGE) * PAGE)

    def heal(self) -> None:
        self._resize(self.size)

    def fail_read_only(self) -> None:
        """An ext4 error with errors=remount-ro: every later write fails with EROFS (no way back but fsck)."""
        _run("mount", "-o", "remount,errors=remount-ro", str(self.path))
        with open(f"/sys/fs/ext4/{os.path.basename(self.loop)}/trigger_fs_error", "w") as f:
            f.write("storage-fault test\n")

    def _resize(self, size: int) -> None:
        os.truncate(self.image, size)
        _run("losetup", "-c", self.loop)

    def remount(self) -> None:
        """Unmount and mount again: later reads come from the device, not from the page cache."""
        self.heal()
        os.sync()
        _run("umount", str(self.path))
        _run("mount", "-o", "errors=continue", self.loop, str(self.path))

    def unmount(self) -> None:
        self.heal()
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("umount", str(self.path))
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("umount", "-l", str(self.path))
        _run("losetup", "-d", self.loop)


def _last_byte(path: Path) -> int:
    """The device offset just past the file's last extent (FIEMAP)."""
    count = 256
    buf = bytearray(struct.pack("=QQLLLL", 0, 2**64 - 1, 1, 0, count, 0) + b"\0" * (56 * count))
    with open(path, "rb") as f:
        fcntl.ioctl(f.fileno(), _FIEMAP, buf)
    (mapped,) = struct.unpack_from("=L", buf, 20)
    ends = [sum(struct.unpack_from("=QQQ", buf, 32 + 56 * i)[1:]) for i in range(mapped)]
    return max(ends, default=0)


class FaultyFileSystem(LocalFileSystem):
    """Local files through fsspec (protocol `faulty://`) whose writes fail from the `fail_at`-th on (1-based)
    with `errno_`, until `heal()`: a store on a remote filesystem that runs out of space or breaks mid-upload."""

    protocol = ("faulty",)
    root_marker = "/"
    writes: ClassVar[int] = 0
    fail_at: ClassVar[int | None] = None
    errno_: ClassVar[int] = errno.EIO
    once: ClassVar[bool] = False  # fail only the `fail_at`-th write (a transient fault a retry gets past)

    @classmethod
    def arm(cls, fail_at: int | None, err: int = errno.EIO, *, once: bool = False) -> None:
        cls.writes, cls.fail_at, cls.errno_, cls.once = 0, fail_at, err, once

    @classmethod
    def heal(cls) -> None:
        cls.arm(None)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        path = str(path)
        return super()._strip_protocol(path[len("faulty://") :] if path.startswith("faulty://") else path)

    @classmethod
    def _write(cls) -> None:
        cls.writes += 1
        failing = cls.fail_at is not None and (
            cls.writes == cls.fail_at if cls.once else cls.writes >= cls.fail_at
        )
        if failing:
            raise OSError(cls.errno_, f"{os.strerror(cls.errno_)} (write {cls.writes}, injected)")

    def put_file(self, lpath: Any, rpath: Any, *args: Any, **kwargs: Any) -> None:
        self._write()
        super().put_file(lpath, rpath, *args, **kwargs)

    def _open(self, path: Any, mode: str = "rb", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wa+"):
            self._write()
        return super()._open(path, mode, *args, **kwargs)


register_implementation("faulty", FaultyFileSystem, clobber=True)
