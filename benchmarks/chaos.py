"""`bench chaos`: SIGKILL a saving process at random moments in every phase of a save, then check the store.

Each trial starts a saver (benchmarks/chaos_child.py) on the same store, which resumes from the latest
checkpoint and saves step after step, announcing each phase of each save. The trial targets one phase (in
turn, so every phase gets its share) of the saver's first or second save, and SIGKILLs the saver a random
fraction of that phase's typical duration after the phase began. A new process then checks the store:
every committed checkpoint verifies; the latest restores and equals, bit for bit, the state saved at its
step; and "latest" is at least the newest checkpoint whose commit had finished before the kill (it may be
the one being committed, if that commit reached the disk). With `--storage s3` the store has an S3 remote
tier (moto's server); the check also restores from an empty local store (a new machine), where "latest" is
at least the newest checkpoint whose upload had finished.

Where a kill lands is read from the markers the saver wrote before it died, not from the target: a kill can
land after the phase ended, and phases overlap (the upload runs beside the local retention).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.chaos_child import KEEP_LAST, PHASES
from benchmarks.common import BenchRunError, ForkServer, child_env, machine

#: How long one saver may take to reach its targeted phase, and one check to finish.
TRIAL_TIMEOUT_S = 300.0
#: Until a phase has been seen, its duration is taken as this.
DEFAULT_PHASE_S = 0.01
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class Zygote(ForkServer[tuple[float, list[str]]]):
    """The forking child process (benchmarks/chaos_child.py) and the pipe its savers write markers to."""

    def __init__(self, env: dict[str, str], log: Path):
        super().__init__("benchmarks.chaos_child", env, log, "the chaos child process")

    def start(self, cmd: dict[str, Any]) -> int:
        return self.ask(cmd)["pid"]

    def reaped(self) -> int:
        return self.reply()["status"]

    def parse(self, arrived: float, line: str) -> tuple[float, list[str]]:
        return arrived, line.split()


class MotoServer:
    """moto's S3 server on a free 127.0.0.1 port, in its own process group, stopped by PID."""

    def __init__(self, log: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env={**os.environ, **AWS_ENV},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchRunError(
                    f"moto's S3 server exited with {self.proc.returncode}; see {self.log.name}"
                )
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1) as resp:
                    if resp.status == 200:
                        return
            time.sleep(0.2)
        raise BenchRunError(f"moto's S3 server did not answer within {timeout:.0f}s; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(15)
        self.log.close()


def make_bucket(endpoint: str, bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=endpoint, skip_instance_cache=True)
    if not fs.exists(bucket):
        fs.mkdir(bucket)


class Trial:
    """One saver's life: what it announced before the kill, and what that means for the store."""

    def __init__(self, index: int, target: str, nth_save: int, fraction: float):
        self.index, self.target, self.nth_save, self.fraction = index, target, nth_save, fraction
        self.markers: list[tuple[float, list[str]]] = []
        self.resumed: int | None = None
        self.killed_after_s: float | None = None

    def target_step(self) -> int | None:
        return None if self.resumed is None else self.resumed + self.nth_save

    def active(self) -> list[str]:
        """Phases begun and not ended when the saver died."""
        open_: dict[str, int] = defaultdict(int)
        for _, m in self.markers:
            if m[0] in ("B", "E"):
                open_[m[1]] += 1 if m[0] == "B" else -1
        return sorted(p for p, n in open_.items() if n > 0)

    def finished(self, phase: str) -> list[int]:
        """Steps for which `phase` ended (commit: committed locally; upload: committed remotely)."""
        return [int(m[2]) for _, m in self.markers if m[0] == "E" and m[1] == phase]

    def begun(self, phase: str) -> list[int]:
        return [int(m[2]) for _, m in self.markers if m[0] == "B" and m[1] == phase]


def run(
    scratch: Path,
    trials: int,
    *,
    storage: str = "local",
    endpoint: str | None = None,
    state_mb: float = 16.0,
    seed: int = 20261124,
    say: Callable[[str], None] = lambda _m: None,
) -> dict[str, Any]:
    """Run `trials` kills against one store in `scratch`; returns the counts as a JSON-able dict."""
    started = time.monotonic()
    rng = random.Random(seed)
    nbytes = int(state_mb * (1 << 20))
    phases = [p for p in PHASES if storage == "s3" or p != "upload"]
    server = None
    env = child_env()
    remote = None
    if storage == "s3":
        if endpoint is None:
            server = MotoServer(scratch / "moto.log")
            endpoint = server.endpoint
        env |= {**AWS_ENV, "AWS_ENDPOINT_URL_S3": endpoint, "FSSPEC_S3_ENDPOINT_URL": endpoint}
        bucket = f"rbs-chaos-{os.getpid()}-{int(time.time())}"
        with _env(env):
            make_bucket(endpoint, bucket)
        remote = f"s3://{bucket}/store"
    zygote = Zygote(env, scratch / "children.log")
    durations: dict[str, deque[float]] = {p: deque(maxlen=64) for p in PHASES}
    # Per view, the newest step known committed there (its commit or upload finished, or a check restored it),
    # and the newest whose commit or upload had begun (a kill may let it land).
    last = {"local": 0, "fresh_machine": 0}
    begun = {"local": 0, "fresh_machine": 0}
    log: list[dict[str, Any]] = []
    counts = _Counts(phases)
    try:
        order: list[str] = []
        for index in range(trials):
            if not order:
                order = list(phases)
                rng.shuffle(order)
            trial = Trial(index, order.pop(), rng.choice((1, 2)), rng.random())
            _kill_one(zygote, trial, scratch, remote, nbytes, durations)
            for view, phase in (("local", "commit"), ("fresh_machine", "upload")):
                last[view] = max([last[view], *trial.finished(phase)])
                begun[view] = max([begun[view], last[view], *trial.begun(phase)])
            check = _check(zygote, scratch, remote, nbytes, index)
            entry = counts.add(trial, check, last, begun)
            for view, got in check["views"].items():  # restored exactly: committed for good
                if got["error"] is None and not got["mismatched"] and got["step"] is not None:
                    last[view] = max(last[view], got["step"])
            log.append(entry)
            if (index + 1) % 10 == 0 or index + 1 == trials:
                say(f"chaos: {index + 1}/{trials} trials, {counts.bad()} bad so far")
    finally:
        zygote.close()
        if server is not None:
            server.stop()
    result = counts.summary(durations)
    result.update(
        benchmark="chaos",
        storage=storage,
        trials=trials,
        state_mb=state_mb,
        keep_last=KEEP_LAST,
        seed=seed,
        method=(
            "one store; each trial's saver resumes from the latest checkpoint and saves until SIGKILLed at a "
            "random fraction of the targeted phase's median duration into that phase of its 1st or 2nd save; "
            "a new process then verifies every committed checkpoint and restores the latest, bit for bit"
        ),
        wall_s=round(time.monotonic() - started, 1),
        machine=machine(),
        trial_log=log,
    )
    return result


@contextlib.contextmanager
def _env(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _kill_one(
    zygote: Zygote,
    trial: Trial,
    scratch: Path,
    remote: str | None,
    nbytes: int,
    durations: dict[str, deque[float]],
) -> None:
    """Start a saver, SIGKILL it in its targeted phase, and collect everything it announced."""
    cmd = {"op": "save", "store": str(scratch / "store"), "remote": remote, "nbytes": nbytes}
    pid = zygote.start({**cmd, "marker_fd": zygote.write_fd})
    began: dict[str, float] = {}
    deadline = time.monotonic() + TRIAL_TIMEOUT_S
    try:
        while trial.killed_after_s is None:
            if time.monotonic() > deadline:
                raise BenchRunError(f"trial {trial.index}: the saver never reached {trial.target}")
            begins = None  # when the targeted phase began, on the saver's clock
            for now, m in zygote.markers(1.0):  # the whole batch is kept, even past the target
                trial.markers.append((now, m))
                if m[0] == "R":
                    trial.resumed = int(m[1])
                elif m[0] == "B":
                    began[m[1]] = float(m[3])
                    if m[1] == trial.target and int(m[2]) == trial.target_step() and begins is None:
                        begins = float(m[3])
                elif m[0] == "E" and m[1] in began:
                    durations[m[1]].append(float(m[3]) - began.pop(m[1]))
            if begins is not None:
                # The saver's own clock (system-wide monotonic): a late wake-up here does not shift the kill.
                typical = (
                    statistics.median(durations[trial.target]) if durations[trial.target] else DEFAULT_PHASE_S
                )
                _sleep_until(begins + trial.fraction * typical)
                os.kill(pid, signal.SIGKILL)
                trial.killed_after_s = time.monotonic() - begins
    finally:
        if trial.killed_after_s is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        status = zygote.reaped()
    trial.markers += zygote.drain()
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        raise BenchRunError(f"trial {trial.index}: the saver exited by itself ({status}); see children.log")


def _sleep_until(when: float) -> None:
    """Sleep, then spin the last millisecond: a phase can be a few milliseconds long."""
    while (left := when - time.monotonic()) > 0:
        if left > 0.002:
            time.sleep(left - 0.001)


def _check(zygote: Zygote, scratch: Path, remote: str | None, nbytes: int, index: int) -> dict[str, Any]:
    out = scratch / "check.json"
    out.unlink(missing_ok=True)
    cmd = {
        "op": "verify",
        "store": str(scratch / "store"),
        "remote": remote,
        "scratch": str(scratch / f"fresh-{index}"),
        "out": str(out),
        "nbytes": nbytes,
    }
    zygote.start(cmd)
    status = zygote.reaped()
    if status != 0 or not out.exists():
        raise BenchRunError(f"trial {index}: the checking process failed ({status}); see children.log")
    return json.loads(out.read_text())


class _Counts:
    """The tallies the JSON reports."""

    def __init__(self, phases: list[str]):
        self.phases = phases
        self.targeted = dict.fromkeys(phases, 0)
        self.killed_in = dict.fromkeys(phases, 0)
        self.between = 0
        self.restore_failures: list[str] = []
        self.partial: list[str] = []
        self.invalid: list[str] = []
        self.backwards: dict[str, list[int]] = defaultdict(list)  # view -> steps behind, per trial
        self.ahead = 0
        self.restore_s: list[float] = []

    def add(
        self, trial: Trial, check: dict[str, Any], last: dict[str, int], begun: dict[str, int]
    ) -> dict[str, Any]:
        self.targeted[trial.target] += 1
        active = trial.active()
        for phase in active:
            self.killed_in[phase] = self.killed_in.get(phase, 0) + 1
        if not active:
            self.between += 1
        self.invalid += [f"trial {trial.index}: {r}" for r in check["invalid_committed"]]
        entry: dict[str, Any] = {
            "trial": trial.index,
            "target": trial.target,
            "killed_in": active,
            "after_ms": round((trial.killed_after_s or 0) * 1000, 2),
        }
        for view, got in check["views"].items():
            where = f"trial {trial.index} ({view})"
            if got["error"] is not None or (got["step"] is None and last[view] > 0):
                self.restore_failures.append(f"{where}: {got['error'] or 'no checkpoint, one was committed'}")
            elif got["mismatched"]:
                self.partial.append(f"{where}: step {got['step']} differs in {', '.join(got['mismatched'])}")
            step = got["step"]
            if step is not None:  # (a failed restore is counted once, above)
                self.backwards[view].append(max(0, last[view] - step))
                if step > last[view]:
                    self.ahead += 1  # a commit (or upload) in flight at the kill had reached the store
                    if step > begun[view]:
                        self.partial.append(f"{where}: step {step} was never saved")
            if got.get("restore_s") is not None:
                self.restore_s.append(got["restore_s"])
            entry[view] = {"latest": got["step"], "committed_before_kill": last[view]}
        return entry

    def bad(self) -> int:
        backwards = sum(1 for v in self.backwards.values() for b in v if b > 0)
        return len(self.restore_failures) + len(self.partial) + len(self.invalid) + backwards

    def summary(self, durations: dict[str, deque[float]]) -> dict[str, Any]:
        per_phase = {
            p: {
                "targeted": self.targeted.get(p, 0),
                "killed_in": self.killed_in.get(p, 0),
                "median_phase_ms": round(statistics.median(durations[p]) * 1000, 2) if durations[p] else None,
            }
            for p in PHASES
            if p in self.phases
        }
        backwards = {
            view: {
                "trials": sum(1 for b in steps if b > 0),
                "max_steps": max(steps, default=0),
                "histogram": {str(k): steps.count(k) for k in sorted(set(steps))},
            }
            for view, steps in self.backwards.items()
        }
        bad = self.bad()
        return {
            "phases": per_phase,
            "killed_between_phases": self.between,
            "restore_failures": len(self.restore_failures),
            "partial_restores": len(self.partial),
            "invalid_committed_checkpoints": len(self.invalid),
            "latest_moved_backwards": backwards,
            "latest_ahead_of_last_finished_commit": self.ahead,
            "bad_restores": bad,
            "target": {"value": bad, "target": 0, "met": bad == 0},
            "restore_s_median": round(statistics.median(self.restore_s), 4) if self.restore_s else None,
            "problems": (self.restore_failures + self.partial + self.invalid)[:50],
        }
