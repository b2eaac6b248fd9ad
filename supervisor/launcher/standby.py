"""The standby launcher: the next training process is started and parked while a segment runs, then given its plan.

A relaunched segment spends most of its start-up in the interpreter and imports (torch alone takes seconds).
`StandbyLauncher` wraps `LocalLauncher`: after each segment starts it parks one more process of the same
command (`standby_child.py`: interpreter up, the script's top-level imports and torch done, nothing else), and
the next `start()` hands that process the segment's argv, working directory and environment over a pipe.
It then runs the script as `__main__` in that same process, whose process group and output pipes become the
segment's, exactly as a cold start's would.

A parked process is used only if it is alive, its report came (imports done), and nothing it was started from
has changed: the interpreter, its options, the script or module, the working directory, the environment
except the per-segment `ROLLBACK_SUPERVISOR_*` variables (which the runtime reads when a Session starts,
never at import), and the mtime and size of every code file it loaded outside the standard library.
Anything else (dead, stale, a command it cannot park, such as `python -c`) starts cold, and a stale or
dead standby is killed and replaced. Not thread-safe except `close()`; one runner thread drives it.

`park="plan"` (policy `relaunch.park: plan`) parks later: the process is started in the base environment (the
per-segment variables left out) with the segment's arguments, runs the script as `__main__` from its first
line, and parks where the script first asks for its launch plan (`supervisor.runtime.plan.load_plan`), its
model built and its data and optimizer set up. It is used only if, besides the checks above, its arguments
are the segment's and it looked up no per-segment variable before that point. One that has not reached its
park point within `park_timeout_seconds`, or that exits before it, is killed; from then on this launcher parks
at the imports only, since the script evidently does not ask for its plan (or not soon enough).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from supervisor.errors import UserError
from supervisor.launcher.base import LaunchSpec, OnLine, SegmentHandle
from supervisor.launcher.local import LocalLauncher, LocalSegment, environment
from supervisor.launcher.standby_child import (
    BOOTSTRAP,
    PARKED_PLAN_VARIABLE,
    PER_SEGMENT_PREFIX,
    PLAN_VARIABLE,
)
from supervisor.launcher.torchrun import split_command

log = logging.getLogger("rollback_supervisor.launcher")

CHILD = str(Path(__file__).with_name("standby_child.py"))
#: Where a standby parks: after the imports, or where the script first asks for its launch plan.
PARK_POINTS = ("imports", "plan")
__all__ = ["PARK_POINTS", "PER_SEGMENT_PREFIX", "Standby", "StandbyLauncher", "StandbyOptions", "Target"]


@dataclass(frozen=True)
class StandbyOptions:
    """How the standby is kept."""

    imports: tuple[str, ...] = ()
    """Modules to import in the parked process besides the script's top-level imports and torch."""
    delay_seconds: float = 5.0
    """How long after a segment starts its standby is started: its imports then do not compete with the
    segment's own start-up for the CPU. Checked to be >= 0."""
    ready_timeout_seconds: float = 60.0
    """How long a relaunch waits for a standby still importing (never longer than a cold start's own imports,
    which began later, unless the imports hang); past that it starts cold."""
    torch: bool = True
    """Import torch in the parked process even where the script does not import it at the top."""
    park: str = "imports"
    """Where the process parks: `imports` (top-level imports done) or `plan` (the script run up to its first
    `load_plan`). Checked to be one of `PARK_POINTS`."""
    park_timeout_seconds: float = 300.0
    """`park="plan"`: how long a standby may take to reach its park point before it is killed, never used.
    Checked to be > 0."""
    preload: str | None = None
    """`park="plan"`: the lineage's local checkpoint directory, whose newest commit the parked process keeps
    read into memory for its segment's restore (`supervisor/checkpoint/preload.py`); None: no preload."""

    def __post_init__(self) -> None:
        if self.delay_seconds < 0:
            raise UserError(
                f"relaunch.standby_delay_seconds: expected a number >= 0, got {self.delay_seconds!r}"
            )
        if self.park not in PARK_POINTS:
            raise UserError(f"relaunch.park: expected one of {', '.join(PARK_POINTS)}, got {self.park!r}")
        if not self.park_timeout_seconds > 0:
            raise UserError(
                f"relaunch.park_timeout_seconds: expected a number > 0, got {self.park_timeout_seconds!r}"
            )
        if self.preload and self.park != "plan":
            raise UserError(
                f"relaunch.preload: needs park: plan (the park point it preloads at), got park: {self.park}"
            )


@dataclass(frozen=True)
class Target:
    """What a command runs: the interpreter and its options, and a script path or a module."""

    interpreter: str
    flags: tuple[str, ...]
    kind: str  #: "path" or "module"
    name: str

    @classmethod
    def of(cls, command: tuple[str, ...]) -> tuple[Target, tuple[str, ...]] | None:
        """The target of `python [opts] script.py ...` or `python [opts] -m mod ...` and its arguments; None
        for anything else (not Python, `-c`, options the standby cannot pass through)."""
        if not command or not os.path.basename(command[0]).startswith("python"):
            return None
        try:
            split = split_command(command)
        except UserError:
            return None
        script = split.script
        if not script:
            return None
        if script[0] == "-m":
            if len(script) < 2:
                return None
            return cls(split.interpreter, split.flags, "module", script[1]), tuple(script[2:])
        if script[0].startswith("-"):
            return None
        return cls(split.interpreter, split.flags, "path", script[0]), tuple(script[1:])


def base_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without the per-segment variables: what must match between a standby and its segment."""
    return {k: v for k, v in env.items() if not k.startswith(PER_SEGMENT_PREFIX)}


#: What `PARKED_PLAN_VARIABLE` names in a `park: plan` standby: a file that never exists, beside the plans of
#: the lineage that parked it.
PARKED_PLAN = "parked-standby-has-no-plan"


def parked_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment a `park: plan` standby starts in: `env` without its per-segment variables (the script
    never sees a segment's plan before its park point), plus `PARKED_PLAN_VARIABLE` naming `PARKED_PLAN` in the
    directory of `env`'s plan. The environment a process started with is what a later supervisor can read of
    it: with that variable it names the lineage's plan directory as a cold start's does, so a segment started
    in the standby, and its torchrun ranks, can be reclaimed after a supervisor crash (`LocalLauncher.reclaim`).
    """
    out = base_env(env)
    plan = env.get(PLAN_VARIABLE)
    if plan:
        out[PARKED_PLAN_VARIABLE] = os.path.join(os.path.dirname(plan), PARKED_PLAN)
    return out


def resolved_env(spec: LaunchSpec) -> dict[str, str]:
    """The environment a cold start of `spec` gets, as a dict."""
    env = environment(spec)
    return dict(os.environ) if env is None else env


#: Output lines a parked process may print (import warnings) kept for its segment; older ones are dropped.
PARKED_LINES = 10_000


class Standby:
    """One parked process of a target: started, importing, then waiting on its plan pipe.

    Its output is drained from the start (a full pipe would block its imports) and kept until it becomes a
    segment, whose sink then gets those lines first, as a cold start's would have printed them.
    """

    def __init__(
        self,
        target: Target,
        env: dict[str, str],
        cwd: str,
        options: StandbyOptions,
        tail_lines: int = 200,
        argv: tuple[str, ...] = (),
        on_unparked: Callable[[Standby, str], None] | None = None,
    ):
        self.target, self.env, self.cwd, self.options, self.argv = target, env, cwd, options, tuple(argv)
        self.park_point = options.park
        self.discarded = False
        self._on_unparked = on_unparked
        config: dict[str, Any] = {
            "target": [target.kind, target.name],
            "imports": list(options.imports),
            "torch": options.torch,
        }
        if self.park_point == "plan":  # runs the script: its arguments now, no per-segment variable at all
            config.update(
                park="plan",
                argv=list(self.argv),
                preload=options.preload,
                park_timeout_seconds=options.park_timeout_seconds,
            )
            env = parked_env(env)
        self.proc = self._spawn(config, env, cwd)
        self.pid = self.proc.pid
        self.started = time.monotonic()
        self._out_lock = threading.Lock()
        self._held: collections.deque[tuple[str, str]] = collections.deque(maxlen=PARKED_LINES)
        self._sink: OnLine | None = None
        self.segment = LocalSegment(self.proc, on_line=self._line, tail_lines=tail_lines).start()
        self.report: dict[str, Any] | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._watch_report, daemon=True)
        self._reader.start()
        self._deadline: threading.Timer | None = None
        if self.park_point == "plan":
            self._deadline = threading.Timer(options.park_timeout_seconds, self._overdue)
            self._deadline.daemon = True
            self._deadline.start()
        log.info(
            "standby pid %d: parking %s %s at its %s",
            self.pid,
            target.kind,
            target.name,
            "first load_plan" if self.park_point == "plan" else "imports",
        )

    # -- how the process is started and talked to: two pipes (`TorchrunStandby` overrides these) ---------

    def _spawn(self, config: dict[str, Any], env: dict[str, str], cwd: str) -> subprocess.Popen:
        """Start the parked process: `python [flags] -c BOOTSTRAP standby_child.py <config>`, with the plan
        pipe's read end and the ready pipe's write end passed to it."""
        plan_r, self._plan_w = os.pipe()
        self._ready_r, ready_w = os.pipe()
        config = {**config, "plan_fd": plan_r, "ready_fd": ready_w}
        try:
            return subprocess.Popen(
                [self.target.interpreter, *self.target.flags, "-c", BOOTSTRAP, CHILD, json.dumps(config)],
                env=env,
                cwd=cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # a segment's own process group, as LocalLauncher gives it
                text=True,
                errors="replace",
                bufsize=1,
                pass_fds=(plan_r, ready_w),
            )
        except BaseException:
            os.close(self._plan_w)
            os.close(self._ready_r)
            raise
        finally:
            os.close(plan_r)
            os.close(ready_w)

    def _receive_report(self) -> dict[str, Any] | None:
        """Block until the parked process reports (its imports done); None if it exited first."""
        with os.fdopen(self._ready_r, "r") as ready:
            line = ready.readline()
        try:
            return json.loads(line) if line else None
        except ValueError:
            return None

    def _send_plan(self, message: dict[str, Any]) -> None:
        try:
            with os.fdopen(self._plan_w, "wb") as pipe:
                pipe.write(json.dumps(message).encode() + b"\n")
        except BrokenPipeError:  # it died between the check and now: the segment's exit says so
            pass

    def _close_channel(self) -> None:
        """Tell a parked process it will never get a plan (it exits quietly)."""
        try:
            os.close(self._plan_w)
        except OSError:
            pass

    def _kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    # ----------------------------------------------------------------------------------------------------

    def _overdue(self) -> None:
        if self.report is None and not self.discarded and self._on_unparked is not None:
            self._on_unparked(
                self, f"it had not reached its park point after {self.options.park_timeout_seconds:g}s"
            )

    def _line(self, stream: str, line: str) -> None:
        with self._out_lock:
            if self._sink is None:
                self._held.append((stream, line))
                return
            self._sink(stream, line)

    def _watch_report(self) -> None:
        self.report = self._receive_report()
        if self._deadline is not None:
            self._deadline.cancel()
        self._ready.set()
        if self.report is None and self.park_point == "plan" and self._on_unparked is not None:
            self.proc.wait()  # the ready pipe's end: it is exiting (or killed by us; `discarded` then says so)
            if not self.discarded:
                self._on_unparked(self, f"it exited with code {self.proc.returncode} before its park point")

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Whether it finished its imports (False: still importing after `timeout`, or it died first)."""
        self._ready.wait(timeout)
        return self.report is not None

    def unusable(
        self, target: Target, env: Mapping[str, str], cwd: str, argv: tuple[str, ...] = ()
    ) -> str | None:
        """Why this standby must not run a segment of `target` with `argv` in `env` and `cwd`; None if it may."""
        if self.proc.poll() is not None:
            return f"it exited with code {self.proc.returncode} while parked"
        if target != self.target:
            return f"the command changed ({target} instead of {self.target})"
        if self.park_point == "plan" and tuple(argv) != self.argv:
            return f"the arguments changed ({list(argv)} instead of {list(self.argv)})"
        if os.path.realpath(cwd) != os.path.realpath(self.cwd):
            return f"the working directory changed ({cwd} instead of {self.cwd})"
        if base_env(env) != base_env(self.env):
            theirs, ours = base_env(env), base_env(self.env)
            names = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
            return f"the environment changed ({', '.join(names[:5])})"
        wait = self.options.ready_timeout_seconds
        if self.park_point == "plan":  # never past its own bound: it is killed there anyway
            wait = min(wait, max(0.0, self.started + self.options.park_timeout_seconds - time.monotonic()))
        if not self.wait_ready(wait):
            where = "before its park point" if self.park_point == "plan" else "while importing"
            if self.proc.poll() is not None:
                return f"it exited with code {self.proc.returncode} {where}"
            if self.park_point == "plan":
                return f"it had not reached its park point after {time.monotonic() - self.started:.0f}s"
            return f"its imports were not done after {self.options.ready_timeout_seconds:g}s"
        assert self.report is not None
        early = self.report.get("early_reads")
        if early:
            return (
                f"the script read {', '.join(early)} before its park point (per-segment variables are set only "
                "when the plan is asked for)"
            )
        for path, mtime_ns, size in self.report["files"]:
            try:
                st = os.stat(path)
            except OSError:
                return f"{path} is gone"
            if (st.st_mtime_ns, st.st_size) != (mtime_ns, size):
                return f"{path} changed since it was imported"
        return None

    def activate(
        self, argv: tuple[str, ...], env: dict[str, str], cwd: str, on_line: OnLine | None
    ) -> LocalSegment:
        """Send the plan; the parked process becomes the segment (its PID, process group and output)."""
        with self._out_lock:
            sink = on_line or (lambda stream, line: None)
            for stream, line in self._held:
                sink(stream, line)
            self._held.clear()
            self._sink = sink
        self.segment.restart_clock()
        self._send_plan({"argv": list(argv), "cwd": cwd, "env": env})
        return self.segment

    def rss_bytes(self) -> int | None:
        """The parked process's resident memory, or None if it is gone."""
        try:
            return psutil.Process(self.pid).memory_info().rss
        except psutil.Error:
            return None

    def discard(self, why: str) -> None:
        """Kill it (its whole process group) and reap it."""
        log.info("standby pid %d discarded: %s", self.pid, why)
        self.discarded = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._close_channel()
        self._kill()
        try:
            self.segment.wait(10)  # reaps it; its output readers end at the pipes' end of file
        except TimeoutError:
            log.warning("standby pid %d did not exit after SIGKILL", self.pid)


class StandbyLauncher:
    """A LocalLauncher whose relaunches start in a parked process of the same command (see module docstring)."""

    def __init__(self, options: StandbyOptions | None = None, inner: LocalLauncher | None = None):
        self.options = options or StandbyOptions()
        self.inner = inner or LocalLauncher()
        self._lock = threading.Lock()
        self._parked: Standby | None = None
        self._timer: threading.Timer | None = None
        self._closed = False
        self._spawned = threading.Condition(self._lock)
        self.park_point = self.options.park  #: falls back to "imports" once a `plan` standby never parks

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> SegmentHandle:
        """Start `spec` in the parked standby if it is usable, else cold; then schedule the next standby."""
        parsed = Target.of(spec.command)
        if parsed is None:
            log.info(
                "no standby for %r: only `python script.py` and `python -m module` park", spec.command[:3]
            )
            return self.inner.start(spec, on_line)
        target, argv = parsed
        env, cwd = resolved_env(spec), os.path.realpath(spec.cwd or os.getcwd())
        handle = self._from_standby(target, argv, env, cwd, on_line)
        if handle is None:
            handle = self.inner.start(spec, on_line)
        self._schedule(target, env, cwd, argv)
        return handle

    def _from_standby(
        self, target: Target, argv: tuple[str, ...], env: dict[str, str], cwd: str, on_line: OnLine | None
    ) -> SegmentHandle | None:
        with self._lock:
            parked, self._parked = self._parked, None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        if parked is None:
            log.info("no standby parked: the segment starts cold")
            return None
        why = parked.unusable(target, env, cwd, argv)
        if why is not None:
            log.warning("standby pid %d not used: %s; the segment starts cold", parked.pid, why)
            parked.discard(why)
            if parked.report and parked.report.get("early_reads") and self.park_point == "plan":
                log.warning("later standbys park after the imports only: this script reads its segment early")
                self.park_point = "imports"  # it would read them in every standby parked at its plan
            return None
        failed = parked.report.get("failed") if parked.report else None
        if failed:  # the script's own run raises these again, with its traceback, if it needs them
            log.info("standby pid %d could not import: %s", parked.pid, "; ".join(failed[:5]))
        log.info(
            "segment starts in standby pid %d (parked %.1fs ago, %s took %.2fs)",
            parked.pid,
            time.monotonic() - parked.started,
            "the script up to its plan" if parked.park_point == "plan" else "imports",
            parked.report["imports_s"] if parked.report else float("nan"),
        )
        return self._activated(parked.activate(argv, env, cwd, on_line), parked)

    def _activated(self, segment: LocalSegment, standby: Standby) -> SegmentHandle:
        """The handle of a segment started in `standby` (`TorchrunStandbyLauncher` wraps it)."""
        return segment

    def _new_standby(
        self, target: Target, env: dict[str, str], cwd: str, options: StandbyOptions, argv: tuple[str, ...]
    ) -> Standby:
        return Standby(target, env, cwd, options, self.inner.tail_lines, argv, on_unparked=self._unparked)

    def _schedule(self, target: Target, env: dict[str, str], cwd: str, argv: tuple[str, ...]) -> None:
        with self._lock:
            if self._closed:
                return
            if self.options.delay_seconds <= 0:
                self._park_locked(target, env, cwd, argv)
                return
            self._timer = threading.Timer(
                self.options.delay_seconds, self.park, args=(target, env, cwd, argv)
            )
            self._timer.daemon = True
            self._timer.start()

    def park(
        self, target: Target, env: dict[str, str], cwd: str, argv: tuple[str, ...] = ()
    ) -> Standby | None:
        """Park a standby of `target` (with `argv`, where it parks at the plan) now, replacing any parked one;
        None once closed."""
        with self._lock:
            return self._park_locked(target, env, cwd, argv)

    def _park_locked(
        self, target: Target, env: dict[str, str], cwd: str, argv: tuple[str, ...]
    ) -> Standby | None:
        if self._closed:
            return None
        old, self._parked = self._parked, None
        if old is not None:
            old.discard("replaced by a newer standby")
        # Fallen back to `imports` (a `plan` standby never parked): there is no park point to preload at.
        preload = self.options.preload if self.park_point == "plan" else None
        options = dataclasses.replace(self.options, park=self.park_point, preload=preload)
        try:
            self._parked = self._new_standby(target, env, cwd, options, argv)
        except OSError as exc:  # cannot start one: the next relaunch starts cold, as without the standby
            log.warning("could not start a standby of %s: %s", target.name, exc)
        self._spawned.notify_all()
        return self._parked

    def park_for(self, spec: LaunchSpec) -> Standby | None:
        """Park a standby for `spec`'s command now (the first segment's, or a benchmark's); None if it cannot."""
        parsed = Target.of(spec.command)
        if parsed is None:
            return None
        return self.park(parsed[0], resolved_env(spec), os.path.realpath(spec.cwd or os.getcwd()), parsed[1])

    def _unparked(self, standby: Standby, why: str) -> None:
        """A `plan` standby that exited or overran its bound before its park point: killed, and every later
        standby of this launcher parks at the imports only (this script does not reach `load_plan` in time)."""
        with self._lock:
            if standby.discarded:
                return
            current = self._parked is standby
            if current:
                self._parked = None
            if self.park_point == "plan":
                log.warning(
                    "standby pid %d never used: %s; later standbys park after the imports only "
                    "(relaunch.park: imports), as a script that does not ask for its plan must",
                    standby.pid,
                    why,
                )
                self.park_point = "imports"
            standby.discard(why)
            if current:  # park again at once, at the imports, so the next relaunch still skips them
                self._park_locked(standby.target, standby.env, standby.cwd, standby.argv)

    def parked(self, timeout: float = 0.0) -> Standby | None:
        """The parked standby, waiting up to `timeout` seconds for one to be started."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._parked is None and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._spawned.wait(left)
            return self._parked

    def reclaim(self, details: Mapping[str, Any]) -> None:
        self.inner.reclaim(details)

    def close(self) -> None:
        """Cancel a pending standby and kill the parked one."""
        with self._lock:
            self._closed = True
            parked, self._parked = self._parked, None
            if self._timer is not None:
                self._timer.cancel()
            self._spawned.notify_all()
        if parked is not None:
            parked.discard("the supervisor is closing")

    def __enter__(self) -> StandbyLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
