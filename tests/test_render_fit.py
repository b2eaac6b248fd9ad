"""Tables that fit the terminal (issue 19): below 120 columns the event table has short columns and the
reasons follow as a numbered list; wide terminals keep one table. Rendered at 80 and 160 columns."""

from __future__ import annotations

import io

import pytest
from rich.cells import cell_len
from rich.console import Console

from supervisor.commands.render import print_result
from supervisor.commands.status import lineage_status, print_lineage
from supervisor.report import timeline_rows
from supervisor.report.timeline import SHORT_COLUMNS
from tests.test_report_timeline import lineage_record


def _result(record: dict) -> dict:
    return {
        "lineage": record["lineage"],
        "status": record["status"],
        "reason": record["final_reason"],
        "final_checkpoint": record["final_checkpoint"],
        "mlflow_run_id": "0123456789abcdef",
        "tracking_uri": "sqlite:///wd/mlflow.db",
        "plot": "wd/lineages/charlm-demo/loss.png",
        "lineage_dir": "wd/lineages/charlm-demo",
        "timeline": timeline_rows(record),
    }


def _render(fn, width: int, *args) -> list[str]:
    out = io.StringIO()
    fn(*args, Console(file=out, width=width, color_system=None)) if fn is print_result else fn(
        Console(file=out, width=width, color_system=None), *args
    )
    return out.getvalue().splitlines()


def _squeeze(text: str) -> str:
    return "".join(text.split())


def _table_rows(lines: list[str]) -> list[list[str]]:
    """The cells of each body line of the boxed tables in `lines`."""
    return [[c.strip() for c in line.strip("│").split("│")] for line in lines if line.startswith("│")]


def _check_fits(lines: list[str], width: int) -> None:
    too_wide = [line for line in lines if cell_len(line.rstrip()) > width]
    assert not too_wide, f"lines wider than {width}: {too_wide}"


@pytest.fixture
def record() -> dict:
    rec = lineage_record()
    # A real engine reason: long, with brackets and a checkpoint id (what folded into 40-line cells).
    rec["segments"][1]["decision"]["reason"] = (
        "rules[1] (preemption, unknown_exit -> resume): unknown_exit; resume from 0000000400-000006 (step 400) "
        "chosen by latest(); skip 0 batches, lr x1, relaunch in 2.0 s; budgets left: 4 of 5 rollbacks, "
        "18 of 20 restarts"
    )
    return rec


def test_run_result_at_80_columns_is_a_short_table_then_numbered_reasons(record):
    lines = _render(print_result, 80, _result(record))
    _check_fits(lines, 80)
    text = "\n".join(lines)
    header = next(line for line in lines if line.startswith("┃"))
    assert [c.strip() for c in header.strip("┃").split("┃")] == list(SHORT_COLUMNS)
    assert "reason" not in header
    rows = timeline_rows(record)
    body = _table_rows(lines)
    assert body == [
        ["0", "0", "150", "non_finite", "rollback", "100", "300", "0.5"],
        ["1", "0", "412", "spike", "rollback", "200", "300", "0.5"],
        ["2", "1", "455", "unknown_exit", "resume", "400", "0", "1"],
        ["3", "2", "520", "hardware_fault", "resume", "500", "0", "1"],
    ]
    # Each reason in full, numbered as the table's # column, after the table.
    after = "\n".join(lines[max(i for i, line in enumerate(lines) if line.startswith("└")) :])
    for row in rows:
        assert f"\n{row['index']}. (" in after
        assert _squeeze(row["reason"]) in _squeeze(after), row["reason"]
    assert "onset 398" in after and "memory tier" in after
    assert "status: finished — training finished at step 600" in text


def test_run_result_at_160_columns_keeps_one_table_with_the_reasons(record):
    lines = _render(print_result, 160, _result(record))
    _check_fits(lines, 160)
    assert sum(line.startswith("┏") for line in lines) == 1
    header = next(line for line in lines if line.startswith("┃"))
    assert header.split("┃")[-2].strip() == "reason"
    text = "\n".join(lines)
    assert "\n0. (" not in text  # no list under the table
    # The reason column folds inside the table: every word of every reason is in it.
    reason_cells = " ".join(r[-1] for r in _table_rows(lines))
    for row in timeline_rows(record):
        assert all(word in reason_cells for word in row["reason"].split()), row["reason"]
    assert "412 (onset 398)" in text


@pytest.mark.parametrize("width", [80, 160])
def test_status_fits_and_shows_every_event(tmp_path, record, width):
    directory = tmp_path / "lineages" / "charlm-demo"
    directory.mkdir(parents=True)
    view = lineage_status(directory, record, tmp_path)
    lines = _render(print_lineage, width, record, view)
    _check_fits(lines, width)
    text = "\n".join(lines)
    for word in ("non_finite", "spike", "unknown_exit", "hardware_fault", "segments", "no checkpoints"):
        assert word in text, word
    squeezed = _squeeze(text)
    assert _squeeze(record["final_reason"]) in squeezed  # the summary is never cut at the edge
    if width < 120:
        assert all(_squeeze(r["reason"]) in squeezed for r in timeline_rows(record))
        assert "target step" in text
