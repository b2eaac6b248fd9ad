"""`rollback-supervisor checkpoints`: list, verify, gc and import checkpoint stores."""

from __future__ import annotations

import contextlib
import datetime
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from supervisor.checkpoint.catalog import Catalog, open_store
from supervisor.checkpoint.retention import policy_from_settings
from supervisor.errors import CheckpointError, UserError

app = typer.Typer(help="Inspect and maintain checkpoint stores.", no_args_is_help=True, add_completion=False)


def _console() -> Console:
    return Console(width=160)


def _existing_store(directory: str) -> Catalog:
    """The store at `directory`; UserError (exit 2) when nothing is there, rather than an empty listing."""
    try:
        catalog = open_store(directory)
    except (ValueError, ImportError) as exc:  # an unknown protocol, or its package is not installed
        raise UserError(f"{directory}: not a directory or URL this machine can open ({exc})") from None
    try:
        if catalog.on_disk:
            found = stat.S_ISDIR(os.stat(catalog.root).st_mode)
        else:
            found = catalog.fs.isdir(catalog.root)
    except (FileNotFoundError, NotADirectoryError):
        found = False
    except OSError as exc:  # a name too long, a permission refused
        raise UserError(f"no checkpoint store at {directory}: {exc.strerror or exc}") from None
    if not found:
        raise UserError(f"no checkpoint store at {directory}")
    return catalog


@contextlib.contextmanager
def _reading(directory: str) -> Iterator[None]:
    """An I/O failure while reading the store becomes one line (exit 1) instead of a traceback."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"checkpoint store {directory}: {exc}") from None


@app.command("list")
def list_cmd(directory: str = typer.Argument(..., help="Store directory or fsspec URL.")) -> None:
    """Print every committed checkpoint as a table, oldest commit first."""
    catalog = _existing_store(directory)
    with _reading(directory):
        infos = catalog.list()
    table = Table(title=f"{len(infos)} checkpoint(s) in {directory}")
    for column in ("id", "step", "saved", "metrics", "parent", "size", "written", "state", "health"):
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
            "ok" if i.healthy else f"UNHEALTHY ({len(i.nonfinite)} non-finite)",
        )
    _console().print(table)


@app.command("verify")
def verify_cmd(
    directory: str = typer.Argument(..., help="Store directory or fsspec URL."),
    mode: str = typer.Option(
        "full", "--mode", help="full (checksums, headers), fast (sizes) or none (markers)."
    ),
) -> None:
    """Verify every checkpoint; exit 0 when all are valid, 1 with a reason per invalid one."""
    catalog = _existing_store(directory)
    bad = 0
    with _reading(directory):
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

    catalog = _existing_store(directory)
    section = load_policy(policy).checkpoint
    keep = policy_from_settings(section.keep_last, section.keep_best, section.keep_every_steps)
    with _reading(directory):
        result = catalog.gc(keep)
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
