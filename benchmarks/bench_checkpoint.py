"""`rollback-supervisor bench checkpoint`: our store against torch.save/torch.load, one process, medians; with
`--sharded`, FSDP2 on several ranks against DCP's save, async_save and load; with `--ddp-paths`, DDP's rank-0
path against the sharded path."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from benchmarks.common import BenchError, write_json

app = typer.Typer(add_completion=False)


def parse_params(text: str) -> int:
    """'100M', '10m', '1.5G', '250000' -> a parameter count."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}
    t = text.strip().upper()
    try:
        value = float(t[:-1]) * scale[t[-1]] if t and t[-1] in scale else float(t)
    except ValueError:
        raise BenchError(f"--params: expected a count like 10M or 100M, got {text!r}") from None
    if value < 1e4:
        raise BenchError(f"--params: expected at least 10K parameters, got {text!r}")
    return int(value)


@app.callback(invoke_without_command=True)
def main(
    params: str = typer.Option("100M", "--params", help="Model size: 10M, 100M, ..."),
    json_path: Path | None = typer.Option(None, "--json", help="Write the results here as JSON."),
    reps: int = typer.Option(
        5, "--reps", min=1, help="Repetitions per measurement (the median is reported)."
    ),
    workdir: Path | None = typer.Option(None, "--workdir", help="Scratch directory on the disk to measure."),
    device: str = typer.Option(
        "cpu", "--device", help="Where the model lives: cpu, or cuda (snapshots go to pinned host memory)."
    ),
    sharded: bool = typer.Option(
        False, "--sharded", help="FSDP2 on --world-size ranks (torchrun): our sharded store against DCP."
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        help="Ranks of a --sharded or --ddp-paths run (default 2); cuda needs a GPU per rank.",
    ),
    ddp_paths: bool = typer.Option(
        False,
        "--ddp-paths",
        help="DDP on --world-size ranks (torchrun, gloo): rank 0 alone writing against every rank writing a "
        "share (sharded), saves and restores.",
    ),
) -> None:
    """Measure save, restore and dedup against torch.save/torch.load; print and optionally write JSON."""
    count = parse_params(params)
    if device not in ("cpu", "cuda"):
        raise BenchError(f"--device: expected cpu or cuda, got {device!r}")
    if sharded and ddp_paths:
        raise BenchError("--sharded and --ddp-paths: expected one of them, got both; run them one at a time")
    if world_size is not None and not (sharded or ddp_paths):
        raise BenchError(
            f"--world-size {world_size}: only a --sharded run has ranks; add --sharded (or --ddp-paths)"
        )
    if ddp_paths:
        from benchmarks.ddp_paths import check
        from benchmarks.ddp_paths import run as run_ddp_paths

        ranks = 2 if world_size is None else world_size
        check(ranks, device)  # before a scratch directory or a process exists
        with tempfile.TemporaryDirectory(dir=workdir, prefix="rbs-bench-ddp-paths-") as tmp:
            result = run_ddp_paths(count, reps, ranks, Path(tmp))
        typer.echo(write_json(result, json_path))
        return
    if sharded:
        from benchmarks.sharded_checkpoint import check_device
        from benchmarks.sharded_checkpoint import run as run_sharded

        ranks = 2 if world_size is None else world_size
        check_device(device, ranks)  # before a scratch directory or a process exists
        with tempfile.TemporaryDirectory(dir=workdir, prefix="rbs-bench-sharded-") as tmp:
            result = run_sharded(count, reps, ranks, Path(tmp), device=device)
        typer.echo(write_json(result, json_path))
        return
    from benchmarks.checkpoint import run  # torch loads only when the benchmark runs

    with tempfile.TemporaryDirectory(dir=workdir, prefix="rbs-bench-") as tmp:
        result = run(count, reps, Path(tmp), device=device)
    typer.echo(write_json(result, json_path))
