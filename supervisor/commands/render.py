"""Concise terminal output of a flow result: the event table sized to the terminal, then where things are."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from supervisor.report.timeline import WIDE_TABLE_COLUMNS, short_timeline, step_text

#: (column, key of the timeline row) of the wide table.
WIDE_COLUMNS = (
    ("seg", "segment"),
    ("step", "step"),
    ("event", "event"),
    ("source", "source"),
    ("action", "action"),
    ("target", "target_id"),
    ("target step", "target_step"),
    ("skip", "skip_batches"),
    ("lr×", "lr_scale"),
    ("reason", "reason"),
)


def print_result(result: dict[str, Any], console: Console | None = None) -> None:
    """The event table (short below WIDE_TABLE_COLUMNS, one table above), the status and where to look."""
    console = console or Console()
    title = f"lineage {result['lineage']}: {result['status']}"
    if console.width < WIDE_TABLE_COLUMNS:
        console.print(short_timeline(result["timeline"], title))
    else:
        console.print(wide_table(result["timeline"], title))
    console.print(Text.assemble("status: ", (str(result["status"]), "bold"), f" — {result['reason']}"))
    console.print(f"final checkpoint: {result['final_checkpoint']}")
    console.print(f"MLflow: run {result['mlflow_run_id']} at {result['tracking_uri']}")
    console.print(f"plot: {result['plot']}   lineage: {result['lineage_dir']}")


def wide_table(rows: list[dict[str, Any]], title: str) -> Table:
    """One table with every column; only the reason folds."""
    table = Table(title=title, title_justify="left")
    for col, _ in WIDE_COLUMNS:
        table.add_column(col, overflow="fold", no_wrap=col != "reason")
    for row in rows:
        cells = [Text("" if row.get(k) is None else str(row[k])) for _, k in WIDE_COLUMNS]
        cells[1] = Text(step_text(row))  # the onset too, when it differs
        table.add_row(*cells)
    return table
