"""Following a SLURM job's output files: new lines go to `on_line` as they appear, and a tail is kept."""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path

from supervisor.launcher.base import OnLine

log = logging.getLogger("rollback_supervisor.launcher")


def size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class OutputFollower:
    """Reads `{stream: path}` from the given offsets every `interval` seconds on one thread until `close()`.

    The files are written by the job on the compute node; on a shared filesystem they may appear late, so a
    missing file is simply not read yet. `close()` reads what is left, then stops.
    """

    def __init__(
        self,
        paths: dict[str, Path],
        offsets: dict[str, int],
        on_line: OnLine,
        *,
        tail_lines: int = 200,
        interval: float = 0.2,
    ):
        self.paths = paths
        self.offsets = dict(offsets)
        self.on_line = on_line
        self.interval = interval
        self.tails = {name: collections.deque(maxlen=tail_lines) for name in paths}
        self._partial = {name: b"" for name in paths}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="slurm-output", daemon=True)

    def start(self) -> OutputFollower:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.read()

    def read(self, final: bool = False) -> None:
        """Hand every complete new line to `on_line` (and, when `final`, an unterminated last one)."""
        with self._lock:
            for name, path in self.paths.items():
                try:
                    with open(path, "rb") as f:
                        f.seek(self.offsets[name])
                        data = f.read()
                except OSError:
                    data = b""
                self.offsets[name] += len(data)
                *lines, rest = (self._partial[name] + data).split(b"\n")
                if final and rest:
                    lines, rest = [*lines, rest], b""
                self._partial[name] = rest
                for raw in lines:
                    line = raw.decode("utf-8", "replace")
                    self.tails[name].append(line)
                    try:
                        self.on_line(name, line)
                    except Exception:  # a logging sink failing must not stop the following
                        log.exception("output callback failed")

    def tail(self, name: str) -> str:
        return "\n".join(self.tails[name])

    def close(self) -> None:
        """Stop following, after reading what is left."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self.read(final=True)
