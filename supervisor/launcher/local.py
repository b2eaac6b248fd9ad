"""The local launcher: each segment a process group on this machine, its output streamed, stopped for sure."""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from supervisor.launcher.base import ExitInfo, LaunchSpec, OnLine
from supervisor.launcher.standby_child import PARKED_PLAN_VARIABLE, PLAN_VARIABLE

log = logging.getLogger("rollback_supervisor.launcher")


#: How long reaping waits for SIGKILLed descendants to be gone.
REAP_WAIT_SECONDS = 5.0


def _ignore(stream: str, line: str) -> None:
    """The output sink when nobody listens."""


class LocalLauncher:
    """Runs each segment as a local process in its own session (process group)."""

    def __init__(self, tail_lines: int = 200):
        self.tail_lines = tail_lines

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> LocalSegment:
        proc = subprocess.Popen(
            list(spec.command),
            env=environment(spec),
            cwd=spec.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: we can signal torchrun and all its children
            text=True,
            errors="replace",
            bufsize=1,
        )
        return LocalSegment(proc, on_line=on_line, tail_lines=self.tail_lines).start()

    def reclaim(self, details: Mapping[str, Any]) -> None:
        """SIGKILL the process group a vanished supervisor left running on this host, if it is still that one.

        Only the very process the segment started (see `is_segment_process`): a PID reused since by an
        unrelated process is left alone, and so is a segment that ran on another host.
        """
        pid, host, index = details.get("pid"), details.get("host"), details.get("index")
        if not pid or host != socket.gethostname():
            return
        env_in_dir = details.get("env_in_dir") or {}
        if not is_segment_process(pid, details.get("pid_started"), env_in_dir):
            log.info("segment %s: pid %d is gone or was reused; nothing to kill", index, pid)
            strays = _orphans(details.get("pid_started"), env_in_dir)
        else:
            strays = []
            try:
                if os.getpgid(pid) != pid:
                    return
                os.killpg(pid, signal.SIGSTOP)  # nothing new is started while its children are listed
                try:
                    strays = [
                        p.pid for p in psutil.Process(pid).children(recursive=True) if _pgid(p.pid) != pid
                    ]
                except psutil.Error as exc:  # the group is killed all the same: never left stopped
                    log.warning("segment %s: could not list the children of pid %d: %s", index, pid, exc)
                finally:
                    os.killpg(pid, signal.SIGKILL)
                log.warning("killed stale training process group %d of segment %s", pid, index)
            except (ProcessLookupError, PermissionError):
                pass
            strays += [o for o in _orphans(details.get("pid_started"), env_in_dir) if o not in strays]
        # Children in sessions of their own (torchrun's ranks) outlive a killpg of their leader; an agent that
        # died first left them orphaned. Either way they would go on training beside the next segment.
        for stray in strays:
            try:
                os.kill(stray, signal.SIGKILL)
                log.warning(
                    "killed stale training process %d of segment %s (outside its group)", stray, index
                )
            except (ProcessLookupError, PermissionError):
                pass


def environment(spec: LaunchSpec) -> dict[str, str] | None:
    """The child's environment: ours plus the overrides (None: exactly ours), or only the overrides."""
    if not spec.inherit_env:
        return dict(spec.env_overrides)
    if not spec.env_overrides:
        return None
    return {**os.environ, **spec.env_overrides}


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


def _orphans(started: float | None, env_in_dir: Mapping[str, str]) -> list[int]:
    """Processes started since the segment was whose environment names the segment's plan directory, outside
    this process's own tree: its ranks, left behind by an agent that died (torchrun starts each rank in a
    session of its own, and nothing kills them with it). None without both to go by."""
    if started is None or not env_in_dir:
        return []
    try:
        own = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    except psutil.Error:
        own = {os.getpid()}
    found = []
    for proc in psutil.process_iter(["pid", "create_time"]):
        info = proc.info
        if info["pid"] in own or info["create_time"] is None or info["create_time"] < started - 1.0:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if _names_dir(env, env_in_dir):
            found.append(info["pid"])
    return found


def is_segment_process(pid: int, started: float | None, env_in_dir: Mapping[str, str]) -> bool:
    """Whether `pid` is still the training process a segment started.

    Its start time must match the recorded one within a second (psutil derives it from the boot time, which
    can move by about that much when the clock is adjusted), and where its environment is readable each
    variable of `env_in_dir` must name a path in the given directory (the runner's launch plan). A record
    from before start times were kept is judged by the environment alone.
    """
    now = process_started(pid)
    if now is None or (started is not None and abs(now - started) > 1.0):
        return False
    try:
        env = psutil.Process(pid).environ()
    except psutil.Error:
        return started is not None
    return _names_dir(env, env_in_dir)


def _names_dir(env: Mapping[str, str], env_in_dir: Mapping[str, str]) -> bool:
    """Whether each variable of `env_in_dir` names a path in its directory in `env`. A process started as a
    `park: plan` standby has no plan variable in the environment it started with, but `PARKED_PLAN_VARIABLE`
    naming a file in the same directory (`supervisor.launcher.standby.parked_env`)."""
    for name, directory in env_in_dir.items():
        value = env.get(name, env.get(PARKED_PLAN_VARIABLE) if name == PLAN_VARIABLE else None)
        if value is None or Path(value).parent != Path(directory):
            return False
    return True


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

    def restart_clock(self) -> None:
        """Count the segment's duration from now (a parked standby becomes a segment long after it started)."""
        self._t0 = time.monotonic()

    @property
    def handle_id(self) -> str:
        return str(self.pid)

    def details(self) -> dict[str, Any]:
        return {"pid": self.pid, "pid_started": process_started(self.pid)}

    def started(self) -> bool:
        return True  # a local process runs from Popen on

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
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"segment pid {self.pid} still running after {timeout}s") from exc
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
        """Signal the whole group, wait up to `grace_seconds`, then SIGKILL the group and any stray child.

        The grace covers the whole group, not only its leader: a leader that dies of the signal at once
        (torchrun's agent on SIGUSR2, a shell) leaves its children to run their handlers until the deadline.
        Children that left the group (torchrun starts each rank in its own session) get the signal from us
        once their leader is gone, since it can no longer forward it.
        """
        deadline = time.monotonic() + grace_seconds
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
        else:
            self._forward(sig)
        self._await_descendants(deadline)
        self._reap_strays()

    def _forward(self, sig: int) -> None:
        """Send `sig` to the live descendants outside the group (the killpg did not reach them)."""
        for pid in self._live_descendants():
            try:
                if os.getpgid(pid) != self.pid:
                    os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _await_descendants(self, deadline: float) -> None:
        """Wait until `deadline` for the remembered descendants still alive (same create_time) to exit."""
        while time.monotonic() < deadline and self._live_descendants():
            time.sleep(0.05)

    def _live_descendants(self) -> list[int]:
        live = []
        for pid, created in self._descendants.items():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                    live.append(pid)
            except psutil.Error:
                pass
        return live

    def kill(self) -> None:
        """SIGKILL the whole group now (no grace), recorded as sent by us."""
        self.stop(grace_seconds=0, sig=signal.SIGKILL)

    def _reap_strays(self) -> None:
        """SIGKILL the group and every remembered descendant, and wait (briefly) until they are gone.

        Children that left the group (setsid) would survive a killpg: they are killed by PID. The wait makes
        "the segment ended" mean that none of it still runs (a SIGKILL lands asynchronously).
        """
        _killpg(self.pid, signal.SIGKILL)
        live = self._live_descendants()
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if live:
            self._await_descendants(time.monotonic() + REAP_WAIT_SECONDS)


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
