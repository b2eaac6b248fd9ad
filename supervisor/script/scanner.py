"""The scanner: a thread that versions a script's checkpoint files while it runs, and once more after it exits.

It is the segment's `Drain`: `drain()` runs once the script is gone, takes the final scan (everything has
settled then), closes the store, and then lets the next drain (the metric shipper) finish. A scan that fails
(a full disk) is logged and retried at the next round: a failing copy never stops the script, it only leaves
the newest version older.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from supervisor.script.files import ScriptFiles

log = logging.getLogger("rollback_supervisor.script")


class FileScanner:
    """Scans every `interval` seconds on its own thread; `drain()` stops it and takes the final scan."""

    def __init__(
        self,
        files: ScriptFiles,
        interval: float,
        metrics: Callable[[], dict[str, float]],
        *,
        then: Callable[[], None] | None = None,
    ):
        self.files = files
        self.interval = interval
        self.metrics = metrics
        self.then = then
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="script-files", daemon=True)

    def start(self) -> FileScanner:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._scan(final=False)

    def _scan(self, *, final: bool) -> None:
        try:
            self.files.scan(final=final, metrics=self.metrics())
        except Exception as exc:
            self.failures += 1
            log.warning("versioning %s failed (%s); trying again", self.files.glob, exc)

    def drain(self) -> None:
        """The script has exited: stop the thread, version what it left, close the store, then `then`."""
        try:
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join()
            self._scan(final=True)
            self.files.close()
        finally:
            if self.then is not None:
                self.then()
