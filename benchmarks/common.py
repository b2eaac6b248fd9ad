"""What both end-to-end benchmarks share: the example's location, child-process environment, JSON output."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

from supervisor.errors import SupervisorError, UserError

REPO = Path(__file__).resolve().parents[1]
CHARLM = REPO / "examples" / "charlm.py"
#: The example's size presets (kept in sync with examples/charlm.py SIZES; checked there at run time).
SIZES = ("tiny", "small", "10M", "100M")
#: Keeps MLflow's own clients quiet and off the network in every child process.
QUIET_ENV = {
    "GIT_PYTHON_REFRESH": "quiet",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "PYTHONUNBUFFERED": "1",
}


class BenchError(UserError):
    """A benchmark option is out of range, or the source checkout it needs is missing."""


class BenchRunError(SupervisorError):
    """A benchmark's child process failed or did not do what the measurement needs; the message says where."""


M = TypeVar("M")


class ForkServer(Generic[M]):
    """A `python -m module` child that answers JSON lines, and the pipe (`write_fd`) its children mark on.

    A subclass says what one marker is (`parse`). Not thread-safe: one caller asks, reads and drains."""

    def __init__(self, module: str, env: dict[str, str], log: Path, what: str):
        self.what = what
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
            pass_fds=(self.write_fd,),
            start_new_session=True,
        )
        self._pending = b""

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def reply(self) -> dict[str, Any]:
        """The child's next JSON line (a reply, or a message it sends unasked)."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise BenchRunError(f"{self.what} died; see {self.log.name}")
        return json.loads(line)

    def parse(self, arrived: float, line: str) -> M:
        """One marker from its line and the time (monotonic) its batch arrived."""
        raise NotImplementedError

    def markers(self, timeout: float) -> list[M]:
        """Marker lines that arrive within `timeout` seconds (at least one, unless it times out)."""
        ready, _, _ = select.select([self.read_fd], [], [], timeout)
        now = time.monotonic()
        if not ready:
            return []
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.read_fd, 65536):
                self._pending += chunk
        *lines, self._pending = self._pending.split(b"\n")
        return [self.parse(now, line.decode()) for line in lines]

    def drain(self) -> list[M]:
        """Every marker still in the pipe (once its writers are dead and reaped, that is all they wrote)."""
        out = []
        while batch := self.markers(0):
            out += batch
        return out

    def close(self) -> None:
        """Close the child's stdin (its cue to exit), wait (SIGKILL its group after 30 s), close the pipe."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        os.close(self.read_fd)
        os.close(self.write_fd)
        self.log.close()


def check_size(size: str) -> str:
    if size not in SIZES:
        raise BenchError(f"--size: expected one of {', '.join(SIZES)}, got {size!r}")
    if not CHARLM.exists():
        raise BenchError(
            f"{CHARLM}: the example workload is missing; run the benchmark from a source checkout"
        )
    return size


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark child: ours, the repository importable, no inherited drill or plan."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBACK_SUPERVISOR_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return {**env, **QUIET_ENV, **extra}


def load_charlm() -> ModuleType:
    """Import examples/charlm.py as the module `charlm` (examples/ is not a package)."""
    if "charlm" in sys.modules:
        return sys.modules["charlm"]
    spec = importlib.util.spec_from_file_location("charlm", CHARLM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["charlm"] = module
    spec.loader.exec_module(module)
    return module


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def target(value: float | None, goal: float, *, at_least: bool = False) -> dict[str, Any]:
    """A measured ratio next to its goal, and whether it was met."""
    met = None if value is None else (value >= goal if at_least else value <= goal)
    return {"value": value, "target": goal, "met": met}


def machine() -> dict[str, Any]:
    """Where the numbers came from: a busy 2-core machine reads very differently from an idle one."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(result: dict[str, Any], path: Path | None) -> str:
    """`result` as indented JSON; written to `path` (atomically) when one is given."""
    text = json.dumps(result, indent=2)
    if path is not None:
        replace_text(Path(path), text + "\n")
    return text


def replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and os.replace: a reader, or a run killed mid-write,
    finds the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class PhasedResult:
    """A benchmark's JSON file, rewritten after each phase so that a run killed part-way keeps its figures.

    Until `finish`, the file says `complete: false`, with `phases_done` and `phases_planned`; `failed` adds the
    error that ended the run. Not thread-safe: the benchmark's own thread reports its phases.
    """

    def __init__(self, path: Path | None, planned: list[str]):
        self.path = path
        self.planned = list(planned)
        self.done: list[str] = []
        self.last: dict[str, Any] = {}

    def phase_done(self, phase: str, result: dict[str, Any]) -> None:
        """`phase` has completed; `result` holds every figure measured so far."""
        self.done.append(phase)
        self.last = result
        self._write(result, complete=False)

    def failed(self, error: str) -> None:
        """The run ended with `error`: keep the figures of the phases done, and say why the rest are missing."""
        self._write({**self.last, "error": error}, complete=False)

    def finish(self, result: dict[str, Any]) -> str:
        """Write the final result (`complete: true`); its JSON text."""
        return self._write(result, complete=True)

    def _write(self, result: dict[str, Any], *, complete: bool) -> str:
        status = {"complete": complete, "phases_done": list(self.done), "phases_planned": self.planned}
        return write_json({**result, **status}, self.path)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a torchrun rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(child: Path, args: list[str], world_size: int, timeout_s: float, what: str) -> float:
    """Run `world_size` ranks of `child` (with `args`) under torchrun on 127.0.0.1 and a free port; returns
    the monotonic time of the exec (a relaunch's clock starts there). BenchRunError with the output's tail."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc_per_node={world_size}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(child),
        *args,
    ]
    env = child_env(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t_exec = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise BenchRunError(f"{what}: torchrun ran past {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        tail = (done.stdout[-2000:] + done.stderr[-4000:]).strip()
        raise BenchRunError(f"{what}: torchrun exited {done.returncode}:\n{tail}")
    return t_exec
