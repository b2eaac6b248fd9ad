"""`rollback-supervisor status`: each lineage's segments, events, decisions and checkpoints."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from supervisor.errors import UserError
from supervisor.report.timeline import (
    SEGMENT_COLUMNS,
    clock_text,
    counts,
    jsonable,
    rich_table,
    segment_cells,
    summary_line,
    timeline_rows,
)

STATUS_STYLES = {"finished": "green", "stopped": "green", "running": "cyan", "failed": "bold red"}


class StatusError(UserError):
    """The workdir or lineage asked for does not exist or cannot be read."""


def command(
    ctx: typer.Context,
    workdir: Path = typer.Option(Path(".rollback"), "--workdir", help="The supervisor's work directory."),
    lineage: str | None = typer.Option(None, "--lineage", help="Show only this lineage."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON document for scripts."),
) -> None:
    """Show each lineage's segments, events, decisions and checkpoints."""
    if ctx.args:
        raise StatusError(f"status: unexpected argument(s) {' '.join(ctx.args)}; see `status --help`")
    found = [(r, lineage_status(d, r)) for d, r in load_lineages(workdir, lineage)]
    if json_out:
        doc = {"lineages": [view for _, view in found]}
        typer.echo(json.dumps(jsonable(doc), indent=2, allow_nan=False))
        return
    console = Console()
    if not console.is_terminal:  # piped or captured: wide enough that tables stay readable
        console = Console(width=160)
    if not found:
        console.print(f"no lineages under {workdir / 'lineages'}")
    for record, view in found:
        _print_lineage(console, record, view)


def load_lineages(workdir: Path, only: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
    """(lineage directory, record) for each `<workdir>/lineages/*/lineage.json`, sorted by name."""
    if not workdir.is_dir():
        raise StatusError(
            f"--workdir {workdir}: no such directory; expected the directory `rollback-supervisor run` "
            "used (default .rollback)"
        )
    paths = sorted((workdir / "lineages").glob("*/lineage.json"))
    if only is not None:
        paths = [p for p in paths if p.parent.name == only]
        if not paths:
            known = ", ".join(p.parent.name for p in sorted((workdir / "lineages").glob("*/lineage.json")))
            raise StatusError(
                f"--lineage {only}: no {workdir / 'lineages' / only / 'lineage.json'}; "
                f"expected one of: {known or 'none (no lineage has run in this workdir)'}"
            )
    return [(p.parent, _read(p)) for p in paths]


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise StatusError(f"{path}: cannot read the lineage record: {exc}") from exc
    if not isinstance(record, dict):
        raise StatusError(f"{path}: expected a JSON object, got {type(record).__name__}")
    return record


def lineage_status(directory: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The JSON view of one lineage: record summary, counts, raw segments, timeline and checkpoints."""
    c = counts(record)
    return {
        "lineage": record.get("lineage") or directory.name,
        "status": record.get("status"),
        "final_reason": record.get("final_reason"),
        "final_checkpoint": record.get("final_checkpoint"),
        "rollbacks": c["rollbacks"],
        "restarts": c["restarts"],
        "segments": record.get("segments") or [],
        "timeline": timeline_rows(record),
        "checkpoints": [dataclasses.asdict(i) for i in checkpoints(directory / "checkpoints")],
    }


def checkpoints(directory: Path) -> list[Any]:
    """CheckpointInfo of every committed checkpoint in the lineage's store; none when it has no store yet."""
    if not directory.is_dir():
        return []
    from supervisor.checkpoint import open_store

    return open_store(directory).list()


def _print_lineage(console: Console, record: dict[str, Any], entry: dict[str, Any]) -> None:
    style = STATUS_STYLES.get(entry["status"] or "", "")
    console.rule(Text(summary_line(record), style=style), align="left")
    segments = Table(title="segments", title_justify="left")
    for name in SEGMENT_COLUMNS:
        segments.add_column(name, overflow="fold")
    for seg in entry["segments"]:
        segments.add_row(*(Text(c) for c in segment_cells(seg)))
    console.print(segments)
    if entry["timeline"]:
        table = rich_table(record)
        table.title = "events and decisions"
        console.print(table)
    else:
        console.print("no events")
    console.print(_checkpoint_table(entry))


def _checkpoint_table(entry: dict[str, Any]) -> Table | str:
    if not entry["checkpoints"]:
        return "no checkpoints"
    roles: dict[str, list[str]] = {}
    for row in entry["timeline"]:
        if row.get("target_id"):
            roles.setdefault(row["target_id"], []).append(f"{row['action']} target (#{row['index']})")
    if entry["final_checkpoint"]:
        roles.setdefault(entry["final_checkpoint"], []).insert(0, "final")
    table = Table(title="checkpoints", title_justify="left")
    for name in ("id", "step", "saved", "metrics", "parent", "size", "state", "role"):
        table.add_column(name, overflow="fold")
    for info in entry["checkpoints"]:
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in sorted(info["metrics"].items()))
        table.add_row(
            info["id"],
            str(info["step"]),
            clock_text(info["wall_time"]),
            metrics or "-",
            info["parent_id"] or "-",
            f"{info['nbytes'] / 2**20:.1f} MiB"
            if info["nbytes"] >= 2**20
            else f"{info['nbytes'] / 1024:.1f} KiB",
            Text("abandoned", style="dim") if info["abandoned"] else "live",
            ", ".join(roles.get(info["id"], [])) or "-",
        )
    return table
