"""`rollback-supervisor bench rollback`: anomaly to first resumed step, in process vs relaunch vs naive."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import typer

from benchmarks.common import BenchError, check_size, write_json

app = typer.Typer(add_completion=False)
#: A hand run at the issue's size keeps its numbers in benchmarks/results/rollback-100M.json (--json there);
#: `--integration X` runs keep theirs in benchmarks/results/rollback-integration-X.json.


@app.callback(invoke_without_command=True)
def main(
    json_path: Path | None = typer.Option(None, "--json", help="Write the results here as JSON."),
    size: str | None = typer.Option(
        None,
        "--size",
        help="Example size preset: tiny, small, 10M or 100M (default 100M; with --integration, 10M; none for script).",
    ),
    reps: int = typer.Option(3, "--reps", min=1, help="Repetitions per path (the median is reported)."),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        min=1,
        help="Example batch size (sets the step time; default 1, with --integration the example's own).",
    ),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads in the children."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Scratch directory (kept when given)."),
    device: str = typer.Option("cpu", "--device", help="Where the example trains: cpu or cuda."),
    overhead_steps: int = typer.Option(
        100,
        "--overhead-steps",
        min=0,
        help="Also supervise this many steps of the example with no fault and report the supervisor's CPU "
        "time against the training's (supervisor_cpu_s; target <= 2%); 0 skips it.",
    ),
    integration: str | None = typer.Option(
        None,
        "--integration",
        help="lightning, transformers or script: that integration's example, in process and relaunched, "
        "against the framework's own resume (benchmarks/integration.py).",
    ),
) -> None:
    """Measure anomaly -> first resumed step: in process (memory tier), relaunch (disk), naive torch.load;
    with --integration, under a framework integration against that framework's own resume."""
    if integration is not None:
        from benchmarks.integration import check

        size = check(integration, size, device)
    else:
        size = check_size(size or "100M")
        batch_size = batch_size or 1
        if device not in ("cpu", "cuda"):
            raise BenchError(f"--device: expected cpu or cuda, got {device!r}")

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rbs-bench-rollback-", dir=workdir))

    def say(message: str) -> None:
        typer.echo(message, err=True)

    try:
        if integration is not None:
            from benchmarks.integration import run as run_integration

            result = run_integration(scratch, integration, size, reps, batch_size, threads, say=say)
        else:
            from benchmarks.rollback import run

            result = run(scratch, size, reps, batch_size, threads, device=device, say=say)
            if overhead_steps:
                from benchmarks.overhead import supervisor_cpu

                say(f"supervisor CPU time over {overhead_steps} supervised steps")
                cost = supervisor_cpu(scratch / "overhead", size, overhead_steps, threads)
                result["supervisor_cpu"] = cost
                result["supervisor_cpu_s"] = cost["supervisor_cpu_s"]
                result["targets"].update(cost["targets"])
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    text = write_json(result, json_path)
    typer.echo(text)
