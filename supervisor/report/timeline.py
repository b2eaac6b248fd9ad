"""Pure views of a lineage record: metric branches, the event/decision timeline, tables and tags."""

from __future__ import annotations

import datetime
import math
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from supervisor.lineage.record import RecordLike, as_json

Point = tuple[int, float, int]  # (step, value, timestamp_ms) as MLflow logs it

#: MLflow rejects longer tag values.
MAX_TAG_CHARS = 5000
RELAUNCH_ACTIONS = frozenset({"resume", "rollback"})
#: Terminals narrower than this get the short event table, with the reasons listed under it.
WIDE_TABLE_COLUMNS = 120
ACTION_STYLES = {
    "rollback": "magenta",
    "resume": "yellow",
    "stop": "green",
    "fail": "bold red",
    "replay": "cyan",
}


def split_branches(points: list[Point]) -> tuple[list[Point], list[Point]]:
    """(live, abandoned) points of one metric logged across every segment of a lineage, in time order.

    A point whose step is lower than the previous one starts a new branch at its step: every earlier
    live point at that step or later was on a branch that a rollback or relaunch abandoned.
    Points are ordered by timestamp; ties keep their given order (MLflow returns them by step).
    """
    live: list[Point] = []
    abandoned: list[Point] = []
    for point in sorted(points, key=lambda p: p[2]):
        if live and point[0] < live[-1][0]:
            while live and live[-1][0] >= point[0]:
                abandoned.append(live.pop())
        live.append(point)
    abandoned.sort(key=lambda p: p[2])
    return live, abandoned


def runs(points: list[Point]) -> list[list[Point]]:
    """Split time-ordered points into runs of increasing step (one run per abandoned branch)."""
    out: list[list[Point]] = []
    for point in points:
        if out and point[0] > out[-1][-1][0]:
            out[-1].append(point)
        else:
            out.append([point])
    return out


def timeline_rows(record: RecordLike) -> list[dict[str, Any]]:
    """One row per event and its decision, in time order: in-process rollbacks, then what ended each segment."""
    record = as_json(record)
    rows: list[dict[str, Any]] = []
    for seg in record.get("segments") or []:
        index = seg.get("index", len(rows))
        inner = sorted(
            seg.get("in_process") or [],
            key=lambda e: e.get("time") or (e.get("event") or {}).get("wall_time") or 0.0,
        )
        for entry in inner:
            event = entry.get("event") or {}
            rows.append(
                _row(index, event, entry.get("decision"), entry.get("time"), "in_process", True, entry)
            )
        decision = seg.get("decision")
        event = seg.get("event") or (decision or {}).get("event")
        if event or decision:
            rows.append(_row(index, event or {}, decision, seg.get("ended"), "monitor", False, {}))
    for n, row in enumerate(rows):
        row["index"] = n
    return rows


def _row(
    segment: int,
    event: dict[str, Any],
    decision: dict[str, Any] | None,
    fallback_time: float | None,
    default_source: str,
    in_process: bool,
    entry: dict[str, Any],
) -> dict[str, Any]:
    d = decision or {}
    replay = entry.get("replay") if isinstance(entry.get("replay"), dict) else {}
    return {
        "index": 0,
        "segment": segment,
        "time": event.get("wall_time") or fallback_time,
        "step": event.get("step"),
        "onset_step": event.get("onset_step"),
        "event": event.get("type"),
        "metric": event.get("metric"),
        "value": event.get("value"),
        "source": event.get("source") or default_source,
        "event_reason": event.get("reason"),
        "action": d.get("action") or ("replay" if replay else None),
        "target_id": d.get("target_id"),
        "target_step": d.get("target_step"),
        "fallback": d.get("fallback") is True,  # the target matched nothing; the newest usable one was taken
        "skip_batches": d.get("skip_batches", 0),
        "lr_scale": d.get("lr_scale", 1.0),
        "delay_seconds": d.get("delay_seconds", 0.0),
        "reason": d.get("reason") or replay.get("reason") or event.get("reason"),
        "in_process": in_process,
        "tier": entry.get("tier"),
        "restore_s": entry.get("restore_s"),
        # A replay's verdict (monitor.replay): replay_mismatch, reproducible_on_same_device or inconclusive.
        "replay": replay.get("verdict") or (event.get("evidence") or {}).get("replay", {}).get("verdict"),
    }


def counts(record: RecordLike) -> dict[str, int]:
    """Decisions as the budgets count them: rollbacks, restarts (resume or rollback) and in-process rollbacks."""
    record = as_json(record)
    rows = timeline_rows(record)
    return {
        "rollbacks": sum(r["action"] == "rollback" for r in rows),
        "restarts": sum(r["action"] in RELAUNCH_ACTIONS for r in rows),
        "in_process": sum(r["in_process"] and r["action"] == "rollback" for r in rows),
    }


def target_text(row: dict[str, Any]) -> str:
    """`<checkpoint> @<step>`, `scratch` for a relaunch from nothing, `-` when no checkpoint was chosen."""
    if row.get("target_id"):
        return f"{row['target_id']} @{row['target_step']}"
    return "scratch" if row.get("action") in RELAUNCH_ACTIONS else "-"


def step_text(row: dict[str, Any]) -> str:
    """`412 (onset 398)`, or the one step known."""
    step, onset = row.get("step"), row.get("onset_step")
    if onset is not None and step is not None and onset != step:
        return f"{step} (onset {onset})"
    return str(step if step is not None else onset if onset is not None else "-")


def decision_line(row: dict[str, Any]) -> str:
    """One line for an MLflow tag or a log: where, what happened, what was done, and why."""
    parts = [f"segment {row['segment']} step {step_text(row)}: {row['event'] or '?'} [{row['source']}]"]
    parts.append(f"-> {row['action'] or 'no decision'}")
    if row["action"] in RELAUNCH_ACTIONS or row.get("target_id"):
        parts.append(target_text(row))
    if row["action"] in RELAUNCH_ACTIONS:
        parts.append(f"skip {row['skip_batches']}, lr x{row['lr_scale']:g}" + _delay(row, ", delay {:.1f}s"))
    text = " ".join(parts) + f"; {row['reason'] or ''}"
    return " ".join(text.split())


def summary_line(record: RecordLike) -> str:
    """`<lineage>: <status>, N segments, R rollbacks (K in process), S restarts, final checkpoint X[; reason]`."""
    record = as_json(record)
    c = counts(record)
    segments = len(record.get("segments") or [])
    text = (
        f"{record.get('lineage', '?')}: {record.get('status', '?')}, {segments} segment(s), "
        f"{c['rollbacks']} rollback(s) ({c['in_process']} in process), {c['restarts']} restart(s), "
        f"final checkpoint {record.get('final_checkpoint') or 'none'}"
    )
    return text + (f"; {record['final_reason']}" if record.get("final_reason") else "")


def report_tags(record: RecordLike) -> dict[str, str]:
    """MLflow run tags for the lineage: status, final reason and checkpoint, budgets spent, one per decision."""
    record = as_json(record)
    c = counts(record)
    tags = {
        "rollback.lineage": str(record.get("lineage") or ""),
        "rollback.status": str(record.get("status") or ""),
        "rollback.final_reason": str(record.get("final_reason") or ""),
        "rollback.final_checkpoint": str(record.get("final_checkpoint") or ""),
        "rollback.rollbacks": str(c["rollbacks"]),
        "rollback.restarts": str(c["restarts"]),
    }
    for row in timeline_rows(record):
        tags[f"rollback.decision.{row['index']:03d}"] = decision_line(row)
    return {k: _clip(" ".join(v.split()), MAX_TAG_CHARS) for k, v in tags.items()}


def _delay(row: dict[str, Any], template: str) -> str:
    # An in-process rollback continues at once; the policy's backoff only delays relaunches.
    return "" if row["in_process"] else template.format(row["delay_seconds"])


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _num(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


TIMELINE_COLUMNS = (
    "#",
    "seg",
    "step",
    "event",
    "value",
    "source",
    "action",
    "target",
    "skip",
    "lr×",
    "delay",
    "reason",
)


def _cells(row: dict[str, Any]) -> list[str]:
    relaunch = row["action"] in RELAUNCH_ACTIONS
    return [
        str(row["index"]),
        str(row["segment"]),
        step_text(row),
        row["event"] or "-",
        f"{row['metric']}={_num(row['value'])}" if row.get("metric") else "-",
        row["source"] + (f" ({row['tier']})" if row.get("tier") else ""),
        row["action"] or "-",
        target_text(row),
        str(row["skip_batches"]) if relaunch else "-",
        f"{row['lr_scale']:g}" if relaunch else "-",
        (_delay(row, "{:.1f}s") or "-") if relaunch else "-",
        row["reason"] or "-",
    ]


def segment_cells(seg: dict[str, Any]) -> list[str]:
    """seg, pid, started, steps, restore, exit, outcome: one segment as table cells."""
    restore = seg.get("restore") or {}
    origin = restore.get("checkpoint_id") or "scratch"
    if restore.get("skip_batches"):
        origin += f" skip {restore['skip_batches']}"
    if restore.get("lr_scale", 1.0) != 1.0:
        origin += f" lr x{restore['lr_scale']:g}"
    exit_text = _num(seg.get("returncode")) + (
        f" (sent {seg['signal_sent']})" if seg.get("signal_sent") else ""
    )
    return [
        str(seg.get("index", "?")),
        _num(seg.get("pid")),
        clock_text(seg.get("started")),
        f"{_num(seg.get('start_step'))} → {_num(seg.get('last_step'))}",
        origin,
        exit_text,
        seg.get("outcome") or ("running" if seg.get("ended") is None else "-"),
    ]


SEGMENT_COLUMNS = ("seg", "pid", "started", "steps", "restored from", "exit", "outcome")


def clock_text(ts: float | None) -> str:
    """Local wall-clock time of a timestamp, to the second; `-` when unknown."""
    if not ts:
        return "-"
    return datetime.datetime.fromtimestamp(ts).isoformat(sep=" ", timespec="seconds")


def _md_escape(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def _md_table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_md_escape(c) for c in cells) + " |" for cells in rows]
    return lines


def markdown_table(record: RecordLike) -> str:
    """Markdown for a Prefect artifact: the summary, the event/decision timeline and the segments."""
    record = as_json(record)
    rows = timeline_rows(record)
    lines = [f"**{_md_escape(summary_line(record))}**", "", "### Events and decisions", ""]
    lines += _md_table(TIMELINE_COLUMNS, [_cells(r) for r in rows]) if rows else ["No events."]
    lines += ["", "### Segments", ""]
    lines += _md_table(SEGMENT_COLUMNS, [segment_cells(s) for s in record.get("segments") or []])
    return "\n".join(lines) + "\n"


def rich_table(record: RecordLike) -> Table:
    """The event/decision timeline as a compact rich Table for the terminal."""
    record = as_json(record)
    table = Table(title=Text(summary_line(record)), title_justify="left", show_lines=True)
    # Short cells never wrap (a broken event type or checkpoint id is hard to read); the reason folds.
    for name in ("#", "seg", "step", "event", "source", "decision", "reason"):
        table.add_column(name, no_wrap=name != "reason", overflow="fold")
    for row in timeline_rows(record):
        # Text, not markup: reasons hold brackets such as "rules[0]".
        step = str(row["step"] if row["step"] is not None else "-")
        if row["onset_step"] is not None and row["onset_step"] != row["step"]:
            step += f"\nonset {row['onset_step']}"
        event = Text(row["event"] or "-")
        if row.get("metric"):
            event.append(f"\n{row['metric']}={_num(row['value'])}", style="dim")
        source = row["source"] + (f"\n({row['tier']})" if row.get("tier") else "")
        decision = Text(row["action"] or "-", style=ACTION_STYLES.get(row["action"] or "", ""))
        if row.get("replay") and row["action"] == "replay":
            decision.append(f"\n{row['replay']}", style="dim")
        if row.get("target_id"):
            decision.append(f" → step {row['target_step']}\n{row['target_id']}")
            if row.get("fallback"):
                decision.append("\n(fallback)", style="dim")
        elif row["action"] in RELAUNCH_ACTIONS:
            decision.append(" → scratch")
        if row["action"] in RELAUNCH_ACTIONS:
            knobs = [f"skip {row['skip_batches']}"] if row["skip_batches"] else []
            knobs += [f"lr ×{row['lr_scale']:g}"] if row["lr_scale"] != 1.0 else []
            knobs += [_delay(row, "in {:.1f}s")] if not row["in_process"] else []
            if knobs:
                decision.append("\n" + " · ".join(knobs), style="dim")
        cells = (
            str(row["index"]),
            str(row["segment"]),
            step,
            event,
            source,
            decision,
            Text(row["reason"] or "-"),
        )
        table.add_row(*cells)
    return table


SHORT_COLUMNS = ("#", "seg", "step", "event", "action", "target step", "skip", "lr×")


def short_cells(row: dict[str, Any]) -> list[str]:
    """One timeline row in the short table's columns: nothing that can grow with the policy or the reason."""
    relaunch = row["action"] in RELAUNCH_ACTIONS
    if row.get("target_step") is not None:
        target = str(row["target_step"])
    else:
        target = "scratch" if relaunch and not row.get("target_id") else "-"
    step = row["step"] if row["step"] is not None else row["onset_step"]
    return [
        str(row["index"]),
        str(row["segment"]),
        "-" if step is None else str(step),
        row["event"] or "-",
        row["action"] or "-",
        target,
        str(row["skip_batches"]) if relaunch else "-",
        f"{row['lr_scale']:g}" if relaunch else "-",
    ]


def reason_text(row: dict[str, Any]) -> str:
    """What the short table leaves out: where the event was seen, its onset, the checkpoint, and the reason."""
    seen = row["source"] + (f", {row['tier']} tier" if row.get("tier") else "")
    if row.get("replay") and row["action"] != "replay":
        seen += f", after a replay: {row['replay']}"
    if row["onset_step"] is not None and row["onset_step"] != row["step"]:
        seen += f", onset {row['onset_step']}"
    if row.get("metric"):
        seen += f", {row['metric']}={_num(row['value'])}"
    if row.get("target_id") and row["target_id"] not in (row["reason"] or ""):
        seen += f", checkpoint {row['target_id']}"
    if (
        row["action"] in RELAUNCH_ACTIONS
        and not row["in_process"]
        and "relaunch in" not in (row["reason"] or "")
    ):
        seen += _delay(row, ", relaunch in {:.1f}s")
    return " ".join(f"({seen}) {row['reason'] or '-'}".split())


def short_timeline(rows: list[dict[str, Any]], title: str | Text | None = None) -> Group:
    """The event table for a narrow terminal: short columns, then each row's reason as a numbered list.

    Every cell is short enough for 80 columns, so no cell wraps; the reasons wrap as prose under the table.
    """
    table = Table(title=title, title_justify="left")
    for name in SHORT_COLUMNS:
        table.add_column(name, no_wrap=name != "event", overflow="fold")
    for row in rows:
        cells = short_cells(row)
        cells[4] = Text(cells[4], style=ACTION_STYLES.get(row["action"] or "", ""))
        table.add_row(*(c if isinstance(c, Text) else Text(c) for c in cells))
    reasons = Table.grid(padding=(0, 1))
    reasons.add_column(justify="right", no_wrap=True)
    reasons.add_column(overflow="fold")
    for row in rows:
        reasons.add_row(f"{row['index']}.", Text(reason_text(row)))  # Text: reasons hold brackets
    return Group(table, reasons) if rows else Group(table)


def jsonable(obj: Any) -> Any:
    """Strict JSON: non-finite floats become "NaN"/"Infinity"/"-Infinity", tuples become lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj
