"""`rollback-supervisor checkpoints`: list, verify, gc and import checkpoint stores."""

from __future__ import annotations

import datetime
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from supervisor.checkpoint.catalog import open_store
from supervisor.checkpoint.retention import policy_from_settings

app = typer.Typer(help="Inspect and maintain checkpoint stores.", no_args_is_help=True, add_completion=False)


def _console() -> Console:
    return Console(width=160)


@app.command("list")
def list_cmd(directory: str = typer.Argument(..., help="Store directory or fsspec URL.")) -> None:
    """Print every committed checkpoint as a table, oldest commit first."""
    catalog = open_store(directory)
    infos = catalog.list()
    table = Table(title=f"{len(infos)} checkpoint(s) in {directory}")
    for column in ("id", "step", "saved", "metrics", "parent", "size", "written", "state"):
        table.add_column(column, overflow="fold")
    for i in infos:
        saved = (
            datetime.datetime.fromtimestamp(i.wall_time).isoformat(timespec="seconds") if i.wall_time else "?"
        )
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(i.metrics.items()))
        table.add_row(
            i.id,
            str(i.step),
            saved,
            metrics,
            i.parent_id or "-",
            _mb(i.nbytes),
            _mb(i.written_bytes),
            "abandoned" if i.abandoned else "live",
        )
    _console().print(table)


@app.command("verify")
def verify_cmd(
    directory: str = typer.Argument(..., help="Store directory or fsspec URL."),
    mode: str = typer.Option("full", "--mode", help="full (checksums), fast (sizes) or none (markers)."),
) -> None:
    """Verify every checkpoint; exit 0 when all are valid, 1 with a reason per invalid one."""
    catalog = open_store(directory)
    bad = 0
    for info in catalog.list():
        reason = catalog.verify(info.id, mode)
        if reason is None:
            typer.echo(f"ok       {info.id}")
        else:
            bad += 1
            typer.echo(f"INVALID  {info.id}: {reason}")
    if bad:
        typer.echo(f"{bad} invalid checkpoint(s)", err=True)
        raise typer.Exit(1)


@app.command("gc")
def gc_cmd(
    directory: str = typer.Argument(..., help="Store directory or fsspec URL."),
    policy: Path = typer.Option(
        ..., "--policy", help="Policy file whose checkpoint: section says what to keep."
    ),
) -> None:
    """Delete what the policy's retention does not keep (never the newest), then unreferenced blobs."""
    from policies import load_policy

    section = load_policy(policy).checkpoint
    keep = policy_from_settings(section.keep_last, section.keep_best, section.keep_every_steps)
    result = open_store(directory).gc(keep)
    for info, reason in result.delete:
        typer.echo(f"deleted  {info.id}: {reason}")
    typer.echo(f"kept {len(result.keep)}, deleted {len(result.delete)}")


@app.command("import")
def import_cmd(
    file: Path = typer.Argument(..., help="A .pt file (loaded with torch.load(weights_only=True) only)."),
    directory: str = typer.Argument(..., help="Local store directory."),
    step: int | None = typer.Option(None, "--step", help="Step to record (default: the file's, else 0)."),
) -> None:
    """Import a foreign .pt file as a checkpoint; files that need pickle to load are refused."""
    from supervisor.checkpoint.importer import import_file  # imports torch, which list/verify/gc never need

    info = import_file(file, directory, step=step)
    typer.echo(f"imported {file} as checkpoint {info.id} ({_mb(info.nbytes)})")


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"
