"""Concise terminal output of a flow result."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def print_result(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"lineage {result['lineage']}: {result['status']}", title_justify="left")
    keys = ("segment", "step", "event", "source", "action", "target_id", "skip_batches", "lr_scale", "reason")
    for col in ("seg", "step", "event", "source", "action", "target", "skip", "lr x", "reason"):
        table.add_column(col, overflow="fold")
    for row in result["timeline"]:
        table.add_row(*(Text("" if row.get(k) is None else str(row[k])) for k in keys))
    console.print(table)
    console.print(f"status: [bold]{result['status']}[/bold] — {result['reason']}")
    console.print(f"final checkpoint: {result['final_checkpoint']}")
    console.print(f"MLflow: run {result['mlflow_run_id']} at {result['tracking_uri']}")
    console.print(f"plot: {result['plot']}   lineage: {result['lineage_dir']}")
