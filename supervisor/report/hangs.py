"""Where each rank was when a segment hung: one row per hung segment, from the stacks in the lineage record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from supervisor.monitor.stacks import by_place


def hang_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per segment that holds stacks: its index, the line, each rank's innermost main-thread frame,
    and why any rank's stacks are missing. A record this version did not write gives no rows."""
    rows = []
    for seg in record.get("segments") or []:
        stacks = seg.get("stacks") if isinstance(seg, Mapping) else None
        if not isinstance(stacks, Mapping):
            continue
        where = stacks.get("where") if isinstance(stacks.get("where"), Mapping) else {}
        missing = [str(m) for m in stacks.get("missing") or [] if isinstance(m, str)]
        rows.append(
            {
                "segment": seg.get("index"),
                "summary": str(stacks.get("summary") or "no stacks"),
                "where": {str(k): str(v) for k, v in where.items()},
                "missing": missing,
                "nccl_traces": list(stacks.get("nccl_traces") or []),
            }
        )
    return rows


def hang_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The rows in words, a line per place with the ranks there: "  ranks 0, 2-7: torch/...:2501 all_reduce"."""
    lines = []
    for row in rows:
        lines.append(f"segment {row['segment']} hung; the ranks were at:")
        lines += [f"  {who}: {place}" for who, place in by_place(row["where"])]
        lines += [f"  {m}" for m in row["missing"]]
        lines += [f"  NCCL flight recorder: {path}" for path in row["nccl_traces"]]
    return lines
