"""A real `prefect server` and process worker for tests: own process groups, stopped by PID (worker first)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from tests.servers import _wait_http, free_port, stop_pid

# FACTS.md: without these every start prints telemetry errors; the worker's flow runs inherit them too.
QUIET = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_UI_ENABLED": "false",
    "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS": "false",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "GIT_PYTHON_REFRESH": "quiet",
}
PREFECT = [sys.executable, "-m", "prefect"]
WORKER_QUERY_SECONDS = 1


class PrefectServer:
    """`prefect server start` on 127.0.0.1 with its own PREFECT_HOME (sqlite) under `root`."""

    def __init__(self, root: Path, port: int | None = None, *, ui: bool = False):
        self.root = Path(root)
        self.ui = ui  #: serve Prefect's web UI (off by default: the tests that need a browser turn it on)
        self.home = self.root / "prefect-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "server.log"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for any process that should talk to this server (CLI, worker, and its flow runs)."""
        env = {**os.environ, **QUIET, "PREFECT_HOME": str(self.home), "PREFECT_API_URL": self.api_url}
        env["PREFECT_UI_URL"] = f"http://127.0.0.1:{self.port}"  # for the links Automations template
        if self.ui:  # the UI's JavaScript calls the API at this address (default: port 4200)
            env["PREFECT_SERVER_UI_ENABLED"] = "true"
            env["PREFECT_UI_API_URL"] = self.api_url
        env.pop("PREFECT_PROFILE", None)
        return {**env, **extra}

    def start(self, timeout: float = 120) -> PrefectServer:
        cmd = [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)]
        env = self.env()
        env.pop("PREFECT_API_URL")  # the server must not try to reach itself as a client while starting
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
        )
        _wait_http(f"{self.api_url}/health", self.proc, timeout, self.log)
        return self

    def stop(self) -> None:
        stop_pid(self.proc, signal.SIGTERM, timeout=20)
        self.proc = None

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.api_url}{path}", timeout=10) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        req = urllib.request.Request(
            f"{self.api_url}{path}",
            data=json.dumps(body or {}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def cli(self, *args: str, cwd: Path | None = None, timeout: float = 120, **env: str) -> str:
        """Run `prefect ARGS` against this server; raises with the full output if it fails."""
        proc = subprocess.run(
            [*PREFECT, *args],
            cwd=cwd,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
            start_new_session=True,
        )
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise RuntimeError(f"`prefect {' '.join(args)}` exited {proc.returncode}:\n{output[-4000:]}")
        return output

    def wait_flow_run(self, flow_run_id: str, timeout: float, poll: float = 1.0) -> dict[str, Any]:
        """Poll the API until the flow run reaches a final state; returns the flow run as JSON."""
        final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
        deadline = time.monotonic() + timeout
        while True:
            run = self.get(f"/flow_runs/{flow_run_id}")
            if (run.get("state") or {}).get("type") in final or time.monotonic() >= deadline:
                return run
            time.sleep(poll)


class ProcessWorker:
    """`prefect worker start --pool POOL --limit 1`; its flow runs are subprocesses of it."""

    def __init__(self, server: PrefectServer, pool: str, root: Path, cwd: Path | None = None):
        self.server, self.pool = server, pool
        self.root = Path(root)
        self.cwd = cwd or self.root
        self.proc: subprocess.Popen | None = None
        self.log = self.root / "worker.log"

    def start(self, timeout: float = 60) -> ProcessWorker:
        cmd = [*PREFECT, "worker", "start", "--pool", self.pool, "--type", "process", "--limit", "1"]
        self.proc = subprocess.Popen(
            cmd,
            cwd=self.cwd,
            # Poll for scheduled flow runs every second, not every 10 s (the default): each run waited ~5 s.
            env=self.server.env(PREFECT_WORKER_QUERY_SECONDS=str(WORKER_QUERY_SECONDS)),
            stdout=self.log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while not self.online():
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise RuntimeError(f"worker did not come online within {timeout}s; log:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def online(self) -> bool:
        workers = self.server.post(f"/work_pools/{self.pool}/workers/filter")
        return any(w.get("status") == "ONLINE" for w in workers)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        # FACTS.md: a worker that has lost its server ignores SIGTERM; SIGINT stops it.
        stop_pid(self.proc, signal.SIGINT, timeout=20)
        self.proc = None


def descendants(*procs: subprocess.Popen | None) -> list[psutil.Process]:
    """Every live process below the given ones (flow runs, training segments), captured before teardown."""
    found: list[psutil.Process] = []
    for proc in procs:
        if proc is None:
            continue
        try:
            found.extend(psutil.Process(proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return found


def kill_leftovers(procs: list[psutil.Process], timeout: float = 10) -> list[psutil.Process]:
    """SIGKILL the given processes if still alive (same PID and start time); returns those that were."""
    alive = [p for p in procs if _alive(p)]
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)
    return alive


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
