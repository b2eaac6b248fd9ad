"""The local launcher: each segment a process group on this machine, its output streamed, stopped for sure."""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any

import psutil

from supervisor.launcher.base import ExitInfo, LaunchSpec, OnLine

log = logging.getLogger("rollback_supervisor.launcher")


def _ignore(stream: str, line: str) -> None:
    """The output sink when nobody listens."""


class LocalLauncher:
    """Runs each segment as a local process in its own session (process group)."""

    def __init__(self, tail_lines: int = 200):
        self.tail_lines = tail_lines

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> LocalSegment:
        proc = subprocess.Popen(
            list(spec.command),
            env=dict(spec.env) if spec.env else None,
            cwd=spec.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: we can signal torchrun and all its children
            text=True,
            errors="replace",
            bufsize=1,
        )
        return LocalSegment(proc, on_line=on_line, tail_lines=self.tail_lines).start()


class LocalSegment:
    """A started local process group, with its output streamed line by line.

    `stop()` may be called from any thread; everything else from the owner thread.
    """

    def __init__(self, proc: subprocess.Popen, *, on_line: OnLine | None = None, tail_lines: int = 200):
        self.proc = proc
        self.pid = proc.pid
        self._on_line = on_line or _ignore
        self._tails: dict[str, collections.deque[str]] = {
            "stdout": collections.deque(maxlen=tail_lines),
            "stderr": collections.deque(maxlen=tail_lines),
        }
        self._signal_sent: int | None = None
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._descendants: dict[int, float] = {}  # pid -> create_time, so a reused PID is never killed
        self._readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=self._pump, args=(proc.stderr, "stderr"), daemon=True),
        ]

    def start(self) -> LocalSegment:
        """Start streaming its output (the pipes must be drained, or the child blocks)."""
        for reader in self._readers:
            reader.start()
        return self

    @property
    def handle_id(self) -> str:
        return str(self.pid)

    def details(self) -> dict[str, Any]:
        return {"pid": self.pid, "pid_started": process_started(self.pid)}

    def _pump(self, stream, name: str) -> None:
        for line in stream:
            line = line.rstrip("\n")
            self._tails[name].append(line)
            try:
                self._on_line(name, line)
            except Exception:  # a logging sink failing must not stop the pump (the child would block)
                log.exception("output callback failed")
        stream.close()

    def poll(self) -> int | None:
        self._remember_descendants()
        return self.proc.poll()

    def _remember_descendants(self) -> None:
        try:
            for child in psutil.Process(self.pid).children(recursive=True):
                self._descendants[child.pid] = child.create_time()
        except psutil.Error:
            pass

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # still running
            return None

    def wait(self, timeout: float | None = None) -> ExitInfo:
        self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(5)
        self._reap_strays()
        return ExitInfo(
            returncode=self.proc.returncode,
            stderr_tail="\n".join(self._tails["stderr"]),
            stdout_tail="\n".join(self._tails["stdout"]),
            signal_sent=self._signal_sent,
            handle_id=self.handle_id,
            duration_s=time.monotonic() - self._t0,
        )

    def stop(self, grace_seconds: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """Signal the whole group, wait up to `grace_seconds`, then SIGKILL the group and any stray child."""
        with self._lock:
            if self.proc.poll() is not None:
                return
            self._remember_descendants()
            self._signal_sent = sig
            log.info(
                "stopping segment pid %d with %s (grace %.0fs)",
                self.pid,
                signal.Signals(sig).name,
                grace_seconds,
            )
            _killpg(self.pid, sig)
        try:
            self.proc.wait(grace_seconds)
        except subprocess.TimeoutExpired:
            log.warning(
                "segment pid %d ignored %s for %.0fs; killing its process group",
                self.pid,
                signal.Signals(sig).name,
                grace_seconds,
            )
            _killpg(self.pid, signal.SIGKILL)
        self._reap_strays()

    def kill(self) -> None:
        """SIGKILL the whole group now (no grace), recorded as sent by us."""
        self.stop(grace_seconds=0, sig=signal.SIGKILL)

    def _reap_strays(self) -> None:
        # Children that left the group (setsid) would survive a killpg: kill them by PID.
        _killpg(self.pid, signal.SIGKILL)
        for pid, created in self._descendants.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
            except psutil.Error:
                pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def process_started(pid: int) -> float | None:
    """The process's start time (identifies it across PID reuse), or None if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None
