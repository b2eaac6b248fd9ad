"""The scanner: a thread that versions a script's checkpoint files while it runs, and once more after it exits.

It is the segment's `Drain`: `drain()` runs once the script is gone, takes the final scan (everything has
settled then if the script exited with status 0 by itself; after a signal or a non-zero exit, what was still
changing is not versioned: see `ExitWatch`), closes the store, and then lets the next drain (the metric shipper) finish. A scan that fails
(a full disk) is logged and retried at the next round: a failing copy never stops the script, it only leaves
the newest version older.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from supervisor.launcher import Launcher, LaunchSpec, OnLine, SegmentHandle
from supervisor.script.files import ScriptFiles

log = logging.getLogger("rollback_supervisor.script")


class FileScanner:
    """Scans every `interval` seconds on its own thread; `drain()` stops it and takes the final scan."""

    def __init__(
        self,
        files: ScriptFiles,
        interval: float,
        metrics_at: Callable[[int], dict[str, float]],
        *,
        clean: Callable[[], bool] = lambda: False,
        then: Callable[[], None] | None = None,
    ):
        self.files = files
        self.interval = interval
        self.metrics_at = metrics_at  #: a version's metrics: those printed by its step
        self.clean = clean  #: whether the script exited with status 0 by itself (asked once it is gone)
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
            clean = self.clean() if final else True
            if final and not clean:
                log.info(
                    "the script ended by a signal or a non-zero exit: files still changing are not versioned"
                )
            self.files.scan(final=final, clean=clean, metrics=self.metrics_at)
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


class ExitWatch:
    """A launcher that notes how its segment ended, for the final scan: `clean()` only after an exit with status
    0 that no signal of ours caused. Unknown counts as unclean (the safe side: a file still changing waits)."""

    def __init__(self, inner: Launcher):
        self.inner = inner
        self.returncode: int | None = None
        self.signalled = False

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> SegmentHandle:
        return _WatchedHandle(self.inner.start(spec, on_line), self)

    def reclaim(self, details: Any) -> None:
        self.inner.reclaim(details)

    def clean(self) -> bool:
        return self.returncode == 0 and not self.signalled


class _WatchedHandle:
    def __init__(self, inner: SegmentHandle, watch: ExitWatch):
        self._inner = inner
        self._watch = watch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _note(self, code: int | None) -> int | None:
        if code is not None:
            self._watch.returncode = code
        return code

    def poll(self) -> int | None:
        return self._note(self._inner.poll())

    def wait_exit(self, timeout: float) -> int | None:
        return self._note(self._inner.wait_exit(timeout))

    def wait(self, timeout: float | None = None) -> Any:
        info = self._inner.wait(timeout)
        self._note(info.returncode)
        self._watch.signalled = self._watch.signalled or info.signal_sent is not None
        return info

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        self._watch.signalled = True
        self._inner.stop(grace_seconds, sig)

    def kill(self) -> None:
        self._watch.signalled = True
        self._inner.kill()
