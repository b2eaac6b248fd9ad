"""`rollback-supervisor bench goodput`: useful work under Poisson preemptions, per checkpoint cadence."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import typer

from benchmarks.common import BenchError, check_size, machine, target, write_json

app = typer.Typer(add_completion=False)
GOODPUT_TARGET = 0.95


def parse_intervals(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise BenchError(
            f"--intervals: expected step counts >= 1 separated by commas, like 10,25,50, got {text!r}"
        )
    return sorted(set(values))


def parse_signals(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in ("kill", "term") for v in values):
        raise BenchError(f"--signals: expected kill, term or kill,term, got {text!r}")
    return list(dict.fromkeys(values))


def summarize(results: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per signal: the best fixed interval and the adaptive run, by three measures.

    Step goodput does not charge checkpoint time, so it favours the shortest interval. The useful fraction of
    wall time charges everything, restarts included, whose length varies from run to run on a busy machine
    although every cadence sees the same preemptions. The cadence overhead (time checkpointing plus time
    redoing lost steps) is the part of the wall time the interval controls, and what Young/Daly minimises;
    realized, it also depends on where a handful of preemptions happened to land between checkpoints. The
    expected cadence overhead takes that luck out: the measured checkpoint time plus, at the preemption rate,
    the expected loss for the checkpoints each run actually took (benchmarks/goodput_accounting.py).
    """
    out: dict[str, Any] = {}
    for variant in variants:
        runs = [r for r in results if r["signal"] == variant]
        fixed = [r for r in runs if not r["adaptive"]]
        adaptive = next((r for r in runs if r["adaptive"]), None)
        entry: dict[str, Any] = {}
        for metric, value, higher in MEASURES:
            known = [r for r in fixed if value(r) is not None]
            best = (max if higher else min)(known, key=value, default=None)
            if best is not None:
                entry[f"best_fixed_by_{metric}"] = {"config": best["config"], metric: value(best)}
            if adaptive is not None and value(adaptive) is not None:
                entry[f"adaptive_{metric}"] = value(adaptive)
                if best is not None:
                    word = ">=" if higher else "<="
                    entry[f"adaptive {word} best fixed ({metric})"] = target(
                        value(adaptive), value(best), at_least=higher
                    )
        for run in runs:
            entry[f"goodput >= {GOODPUT_TARGET} ({run['config']})"] = target(
                run["goodput"], GOODPUT_TARGET, at_least=True
            )
        out[variant] = entry
    return out


def _goodput(run: dict[str, Any]) -> float:
    return run["goodput"]


def _useful(run: dict[str, Any]) -> float:
    return run["time_fraction"]["useful"]


def _cadence_overhead(run: dict[str, Any]) -> float:
    return run["time_fraction"]["checkpoint"] + run["time_fraction"]["redone"]


def _expected_overhead(run: dict[str, Any]) -> float | None:
    return run.get("expected_cadence_overhead")


#: (name, value, higher is better)
MEASURES = (
    ("goodput", _goodput, True),
    ("useful_time", _useful, True),
    ("cadence_overhead", _cadence_overhead, False),
    ("expected_cadence_overhead", _expected_overhead, False),
)


@app.callback(invoke_without_command=True)
def main(
    json_path: Path | None = typer.Option(None, "--json", help="Write the results here as JSON."),
    rate: float = typer.Option(..., "--rate", min=0.0, help="Preemptions per minute (Poisson)."),
    minutes: float = typer.Option(2.0, "--minutes", min=0.05, help="Wall-time budget per configuration."),
    size: str = typer.Option("tiny", "--size", help="Example size preset: tiny, small, 10M or 100M."),
    intervals: str = typer.Option("10,25,50,100", "--intervals", help="Fixed checkpoint intervals (steps)."),
    adaptive: bool = typer.Option(True, "--adaptive/--no-adaptive", help="Also run `adaptive: true`."),
    adaptive_cap: int | None = typer.Option(
        None, "--adaptive-cap", min=1, help="every_steps cap for adaptive (default: the largest interval)."
    ),
    signals: str = typer.Option("kill", "--signals", help="kill (SIGKILL), term (SIGTERM) or kill,term."),
    seed: int = typer.Option(0, "--seed", help="Seed of the preemption times (the same for every run)."),
    threads: int | None = typer.Option(1, "--threads", min=1, help="torch threads in the training process."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Scratch directory (kept when given)."),
) -> None:
    """Run the example under preemptions for each checkpoint cadence; report goodput and where time went."""
    from benchmarks.goodput import Config, run

    check_size(size)
    steps = parse_intervals(intervals)
    variants = parse_signals(signals)
    configs = [Config(n) for n in steps] + (
        [Config(adaptive_cap or max(steps), adaptive=True)] if adaptive else []
    )
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rbs-bench-goodput-", dir=workdir))
    try:
        results = run(
            scratch,
            configs=configs,
            variants=variants,
            minutes=minutes,
            rate_per_min=rate,
            seed=seed,
            size=size,
            threads=threads,
            say=lambda m: typer.echo(m, err=True),
        )
    finally:
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    result = {
        "rate_per_min": rate,
        "minutes": minutes,
        "expected_preemptions_per_run": rate * minutes,
        "size": size,
        "seed": seed,
        "threads": threads,
        "runs": results,
        "summary": summarize(results, variants),
        "machine": machine(),
        "notes": [
            "Every run gets the same preemption times (seeded); with few expected preemptions per run the "
            "figures are one draw, not an average: use --minutes so that rate * minutes is several.",
            "goodput = useful steps (step of the last durable checkpoint at the end) / steps executed.",
            "time_fraction buckets: startup (first launch to resume), restart (preemption to the next resume: "
            "detection, decision, relaunch, imports, restore), checkpoint (training blocked saving, emergency "
            "checkpoints included), redone (steps executed again plus the partial step a SIGKILL lost), "
            "useful, other.",
            "expected_cadence_overhead = checkpoint fraction + rate x expected_loss_per_preemption_s, where "
            "the expected loss is sum(T^2) / (2 sum(T)) over the intervals T between durable points (restore, "
            "then each checkpoint) the run took: the realized redone time without the luck of where the few "
            "preemptions landed (0 for SIGTERM, whose emergency checkpoint loses nothing).",
            "adaptive: Young/Daly from the measured save cost and the lineage's observed failure rate "
            "(supervisor/runtime/cadence.py): MTBF = the lineage's running time (at least 60 s) / its failures "
            "(at least 1); a segment saves after its first timed step to measure the cost; never beyond "
            "its every_steps cap; a due save waits for a write still in flight instead of blocking on it.",
        ],
    }
    typer.echo(write_json(result, json_path))
