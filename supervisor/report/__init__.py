"""Observability of a lineage: timeline tables, the loss plot and the MLflow report (matplotlib, mlflow lazy)."""

from supervisor.report.mlflow_report import ReportError, events_document, fetch_points, write_mlflow_report
from supervisor.report.plot import ABANDONED_COLOR, plot_lineage
from supervisor.report.timeline import (
    counts,
    decision_line,
    jsonable,
    markdown_table,
    report_tags,
    rich_table,
    split_branches,
    summary_line,
    timeline_rows,
)

__all__ = [
    "ABANDONED_COLOR",
    "ReportError",
    "counts",
    "decision_line",
    "events_document",
    "fetch_points",
    "jsonable",
    "markdown_table",
    "plot_lineage",
    "report_tags",
    "rich_table",
    "split_branches",
    "summary_line",
    "timeline_rows",
    "write_mlflow_report",
]
