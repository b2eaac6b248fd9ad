"""The lineage's excluded hosts, and the hosts an event blamed that were kept, as status shows them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from supervisor.report.timeline import clock_text

#: The record's two lists: hosts the next launches avoid, and hosts kept though an event blamed them.
LISTS = ("excluded_hosts", "not_excluded")


def exclusion_rows(record: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each list's entries {host, reason, event, segment, time}; a record without them (or this version's
    own older records) gives empty lists, and an entry that is not an object is left out."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for key in LISTS:
        entries = record.get(key)
        rows[key] = [
            {
                "host": str(e.get("host") or "?"),
                "reason": str(e.get("reason") or ""),
                "event": e.get("event") if isinstance(e.get("event"), str) else None,
                "segment": e.get("segment") if isinstance(e.get("segment"), int) else None,
                "time": e.get("time") if isinstance(e.get("time"), int | float) else None,
            }
            for e in (entries if isinstance(entries, list) else [])
            if isinstance(e, Mapping)
        ]
    return rows


def exclusion_lines(rows: Mapping[str, list[dict[str, Any]]]) -> list[str]:
    """The lists in words, one line a host; nothing when both are empty."""
    lines = []
    excluded, kept = rows.get("excluded_hosts") or [], rows.get("not_excluded") or []
    if excluded:
        lines.append("excluded hosts (the next launches avoid them; `rollback-supervisor exclusions clear`):")
        lines += [f"  {row['host']}: {_when(row)}{row['reason']}" for row in excluded]
    if kept:
        lines.append("hosts blamed but kept:")
        lines += [f"  {row['host']}: {_when(row)}{row['reason']}" for row in kept]
    return lines


def _when(row: Mapping[str, Any]) -> str:
    parts = []
    if row.get("segment") is not None:
        parts.append(f"segment {row['segment']}")
    if row.get("time") is not None:
        parts.append(clock_text(row["time"]))
    return f"[{', '.join(parts)}] " if parts else ""
