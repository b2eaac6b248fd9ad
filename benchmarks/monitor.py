"""`bench monitor` measurements: detection latency (log -> event) and poll cost against real MLflow stores."""

from __future__ import annotations

import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BACKENDS = ("sqlite", "http")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def mlflow_server(root: Path) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1 (sqlite backend), stopped by PID on exit."""
    port = _free_port()
    log = (root / "server.log").open("ab")
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{root / 'server.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
    ]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {proc.returncode}; see {root / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mlflow server did not answer on {url} within 120 s") from None
                time.sleep(0.2)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def summary(samples: list[float]) -> dict[str, float]:
    """Median, p90, min and max of `samples`."""
    ordered = sorted(samples)
    return {
        "median": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "min": ordered[0],
        "max": ordered[-1],
    }


def latency(uri: str, trials: int, poll_seconds: float, seed: int) -> dict[str, Any]:
    """Seconds from `log_metric(NaN)` being called to the monitor's callback, with a random poll phase."""
    from mlflow.tracking import MlflowClient

    from supervisor.monitor.watcher import Monitor

    client = MlflowClient(uri)
    experiment = client.create_experiment(f"bench-latency-{time.time_ns()}")
    rng = random.Random(seed)
    latencies, log_calls = [], []
    for _ in range(trials):
        run_id = client.create_run(experiment).info.run_id
        for step in range(20):
            client.log_metric(run_id, "loss", 2.0, step=step)
        monitor = Monitor.from_specs(uri, run_id, [{"type": "non_finite", "metrics": ["loss"]}])
        stop, fired, seen = threading.Event(), threading.Event(), {}

        def on_event(event: Any, seen: dict = seen, fired: threading.Event = fired) -> None:
            seen.setdefault("at", time.monotonic())
            fired.set()

        thread = threading.Thread(target=monitor.run, args=(stop, on_event, poll_seconds), daemon=True)
        thread.start()
        while monitor.points_seen < 20:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, poll_seconds))  # sample the poll phase uniformly
        start = time.monotonic()
        client.log_metric(run_id, "loss", float("nan"), step=20)
        log_calls.append(time.monotonic() - start)
        got = fired.wait(poll_seconds + 30)
        stop.set()
        thread.join(30)
        monitor.close()
        if not got:
            raise RuntimeError(f"no event within {poll_seconds + 30} s on {uri}")
        latencies.append(seen["at"] - start)
    target = poll_seconds + 0.5
    stats = summary(latencies)
    return {
        **{f"{k}_s": v for k, v in stats.items()},
        "samples_s": latencies,
        "log_call_median_ms": 1000 * statistics.median(log_calls),
        "target_s": target,
        "meets_target": stats["median"] <= target,
    }


def poll_cost(uri: str, points: int, metrics: int, repeats: int = 20) -> dict[str, Any]:
    """Cost of polls on one run with `points` points for each of `metrics` metrics."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from supervisor.monitor.watcher import MetricWatcher

    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(f"bench-poll-{time.time_ns()}")).info.run_id
    names = [f"m{i}" for i in range(metrics)]
    now = int(time.time() * 1000)
    batch: list[Metric] = []
    for name in names:
        for step in range(points):
            batch.append(Metric(name, 2.0 + 1e-4 * step, now + step, step))
            if len(batch) == 1000:
                client.log_batch(run_id, metrics=batch)
                batch = []
    if batch:
        client.log_batch(run_id, metrics=batch)

    watcher = MetricWatcher(uri, run_id, names)
    start = time.perf_counter()
    caught_up = len(watcher.poll())
    first = time.perf_counter() - start
    idle = []
    for _ in range(repeats):
        start = time.perf_counter()
        watcher.poll()
        idle.append(time.perf_counter() - start)
    one_step = []
    for i in range(repeats):
        step = points + i
        client.log_batch(run_id, metrics=[Metric(n, 2.0, now + step, step) for n in names])
        start = time.perf_counter()
        got = len(watcher.poll())
        one_step.append(time.perf_counter() - start)
        if got != metrics:
            raise RuntimeError(f"expected {metrics} new points, the watcher returned {got}")
    watcher.close()
    start = time.perf_counter()
    for name in names:
        client.get_metric_history(run_id, name)
    full = time.perf_counter() - start
    return {
        "points_per_metric": points,
        "metrics": metrics,
        "first_poll_s": first,
        "first_poll_points": caught_up,
        "idle_poll_ms": {k: 1000 * v for k, v in summary(idle).items()},
        "one_step_poll_ms": {k: 1000 * v for k, v in summary(one_step).items()},
        "full_history_read_all_metrics_s": full,
    }


def run(
    backends: Sequence[str],
    trials: int,
    poll_seconds: float,
    points: int,
    metrics: int,
    seed: int,
    say: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Latency and poll cost on each backend (sqlite, or a local `mlflow server` for http), as one result."""
    import mlflow

    results: dict[str, Any] = {
        "benchmark": "monitor",
        "mlflow": mlflow.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "poll_seconds": poll_seconds,
        "trials": trials,
        "latency": {},
        "poll_cost": {},
    }
    with tempfile.TemporaryDirectory(prefix="rbs-bench-monitor-") as tmp:
        root = Path(tmp)
        for backend in backends:
            if backend == "sqlite":
                uri = f"sqlite:///{root / 'bench.db'}"
                results["latency"][backend] = latency(uri, trials, poll_seconds, seed)
                results["poll_cost"][backend] = poll_cost(uri, points, metrics)
            else:
                with mlflow_server(root) as uri:
                    results["latency"][backend] = latency(uri, trials, poll_seconds, seed)
                    results["poll_cost"][backend] = poll_cost(uri, points, metrics)
            lat, cost = results["latency"][backend], results["poll_cost"][backend]
            say(
                f"{backend}: latency median {lat['median_s']:.3f} s (p90 {lat['p90_s']:.3f}, target "
                f"{lat['target_s']:.1f}, {'met' if lat['meets_target'] else 'MISSED'}); poll of {metrics}x{points}: "
                f"first {cost['first_poll_s']:.2f} s, idle {cost['idle_poll_ms']['median']:.1f} ms, "
                f"one step {cost['one_step_poll_ms']['median']:.1f} ms, full re-read "
                f"{cost['full_history_read_all_metrics_s']:.2f} s"
            )
    return results
