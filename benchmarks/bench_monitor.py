"""`rollback-supervisor bench monitor`: detection latency and poll cost against real MLflow stores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from benchmarks.common import BenchError
from benchmarks.monitor import BACKENDS, run

app = typer.Typer(add_completion=False, help="Measure the monitor's detection latency and poll cost.")


@app.callback(invoke_without_command=True)
def bench(
    json_path: Path = typer.Option(..., "--json", help="Write the results here as JSON."),
    trials: int = typer.Option(20, help="Latency trials per backend."),
    poll_seconds: float = typer.Option(1.0, help="The monitor's poll interval during latency trials."),
    points: int = typer.Option(10_000, help="Points per metric in the poll-cost run."),
    metrics: int = typer.Option(5, help="Metrics in the poll-cost run."),
    backends: str = typer.Option(
        "sqlite,http", help="Comma-separated: sqlite, http (a local mlflow server)."
    ),
    seed: int = typer.Option(0, help="Seed for the random poll phase of each trial."),
) -> None:
    """Detection latency (log -> event) and poll cost, against sqlite and a local `mlflow server`."""
    chosen = [b.strip() for b in backends.split(",") if b.strip()]
    if not chosen or any(b not in BACKENDS for b in chosen):
        raise BenchError(
            f"--backends: expected a comma-separated subset of {', '.join(BACKENDS)}, got {backends!r}"
        )
    if trials < 1 or points < 1 or metrics < 1 or poll_seconds <= 0:
        raise BenchError("--trials, --points and --metrics: expected >= 1; --poll-seconds: expected > 0")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    results = run(chosen, trials, poll_seconds, points, metrics, seed, say=typer.echo)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
