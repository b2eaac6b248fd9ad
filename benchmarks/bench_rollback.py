"""`rollback-supervisor bench rollback`: anomaly to first resumed step, in process vs relaunch vs naive."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import typer

from benchmarks.common import BenchError, check_size, write_json

app = typer.Typer(add_completion=False)
#: A hand run at the issue's size keeps its numbers in benchmarks/results/rollback-100M.json (--json there).


@app.callback(invoke_without_command=True)
def main(
    json_path: Path | None = typer.Option(None, "--json", help="Write the results here as JSON."),
    size: str = typer.Option("100M", "--size", help="Example size preset: tiny, small, 10M or 100M."),
    reps: int = typer.Option(3, "--reps", min=1, help="Repetitions per path (the median is reported)."),
    batch_size: int = typer.Option(1, "--batch-size", min=1, help="Example batch size (sets the step time)."),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads in the children."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Scratch directory (kept when given)."),
    device: str = typer.Option("cpu", "--device", help="Where the example trains: cpu or cuda."),
) -> None:
    """Measure anomaly -> first resumed step: in process (memory tier), relaunch (disk), naive torch.load."""
    check_size(size)
    if device not in ("cpu", "cuda"):
        raise BenchError(f"--device: expected cpu or cuda, got {device!r}")
    from benchmarks.rollback import run

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rbs-bench-rollback-", dir=workdir))
    try:
        result = run(
            scratch, size, reps, batch_size, threads, device=device, say=lambda m: typer.echo(m, err=True)
        )
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    text = write_json(result, json_path)
    typer.echo(text)
