"""`rollback-supervisor bench chaos`: SIGKILL a saving process in every phase of a save; count bad restores.

With `--sharded`: SIGKILL one rank of a 2-rank FSDP2 run in every phase of a sharded save (benchmarks/chaos_sharded.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import typer

from benchmarks.common import BenchError, write_json

app = typer.Typer(add_completion=False)
#: Committed results: benchmarks/results/chaos-local.json and chaos-s3.json (200 trials each), and
#: chaos-sharded-50.json (--sharded --kills 50).


@app.callback(invoke_without_command=True)
def main(
    trials: int = typer.Option(200, "--trials", min=1, help="How many saving processes to kill."),
    storage: str = typer.Option("local", "--storage", help="local, or s3 (a remote tier on an S3 server)."),
    endpoint: str | None = typer.Option(
        None, "--endpoint", help="S3 endpoint URL; without it, a local moto S3 server is started."
    ),
    state_mb: float = typer.Option(16.0, "--state-mb", min=0.1, help="Size of the saved state in MB."),
    seed: int = typer.Option(20261124, "--seed", help="Seed of the kill schedule."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results here as JSON."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Scratch directory (kept when given)."),
    sharded: bool = typer.Option(
        False, "--sharded", help="Kill one rank of a 2-rank FSDP2 run during sharded (DCP) saves instead."
    ),
    kills: int | None = typer.Option(
        None,
        "--kills",
        min=1,
        help="With --sharded: how many rounds, each ending in one rank's SIGKILL [50].",
    ),
    collective_timeout: float = typer.Option(
        5.0, "--collective-timeout", min=0.5, help="With --sharded: the ranks' collective timeout in seconds."
    ),
) -> None:
    """Kill savers at random moments in every phase (copy, checksum, write, commit, retention, upload), then
    restore the latest checkpoint from a new process and check it bit for bit; exit 1 on any bad restore.

    With --sharded, each round SIGKILLs rank 0 or 1 of a 2-rank FSDP2 run at a phase of a sharded save (every
    phase x rank in turn) or at a random time, and checks the survivor exits and latest is the old or the new
    commit, never a mix, bit for bit."""
    if sharded:
        if storage != "local" or endpoint is not None:
            raise BenchError(
                "--sharded: only with --storage local (the sharded store has no remote tier yet)"
            )
        return _sharded(kills or 50, collective_timeout, seed, json_path, workdir)
    if kills is not None:
        raise BenchError("--kills: only with --sharded (use --trials for the single-process savers)")
    if storage not in ("local", "s3"):
        raise BenchError(f"--storage: expected local or s3, got {storage!r}")
    if endpoint is not None and storage != "s3":
        raise BenchError("--endpoint: only with --storage s3")
    from benchmarks.chaos import run

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rbs-bench-chaos-", dir=workdir))
    try:
        result = run(
            scratch,
            trials,
            storage=storage,
            endpoint=endpoint,
            state_mb=state_mb,
            seed=seed,
            say=lambda m: typer.echo(m, err=True),
        )
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["command"] = " ".join(
        [
            "rollback-supervisor bench chaos",
            f"--trials {trials}",
            f"--storage {storage}",
            f"--state-mb {state_mb:g}",
        ]
        + ([f"--endpoint {endpoint}"] if endpoint else [])
        + ([f"--json {json_path}"] if json_path else [])
    )
    summary = {k: v for k, v in result.items() if k != "trial_log"}
    write_json(result, json_path)
    typer.echo(write_json(summary, None))
    if not result["target"]["met"]:
        raise typer.Exit(1)


def _sharded(kills: int, timeout_s: float, seed: int, json_path: Path | None, workdir: Path | None) -> None:
    from benchmarks.chaos_sharded import run

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rbs-bench-chaos-sharded-", dir=workdir))
    try:
        result = run(scratch, kills, timeout_s=timeout_s, seed=seed, say=lambda m: typer.echo(m, err=True))
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result["command"] = " ".join(
        [
            "rollback-supervisor bench chaos --sharded",
            f"--kills {kills}",
            f"--collective-timeout {timeout_s:g}",
        ]
        + ([f"--seed {seed}"] if seed != 20261124 else [])
        + ([f"--json {json_path}"] if json_path else [])
    )
    write_json(result, json_path)
    typer.echo(write_json({k: v for k, v in result.items() if k != "round_log"}, None))
    if not result["target"]["met"]:
        raise typer.Exit(1)
