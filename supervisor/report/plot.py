"""Loss-versus-step PNG of a lineage: live branch, greyed abandoned branches, anomalies, rollbacks, and a
marker at every relaunch by kind; a sidecar JSON next to the PNG records what was marked."""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from supervisor.lineage.record import RecordLike, as_json
from supervisor.report.timeline import (
    RELAUNCH_ACTIONS,
    Point,
    runs,
    split_branches,
    summary_line,
    timeline_rows,
)

SERIES = {"loss": "tab:blue", "val_loss": "tab:green"}
#: A cool grey that antialiased text, grid lines and the coloured series never produce (tests look for it).
ABANDONED_COLOR = "#a3a3b5"
ANOMALY_COLOR = "tab:red"
ARROW_COLORS = {"rollback": "tab:purple", "resume": "tab:orange"}
#: The kind of relaunch each process event leads to; a relaunch decided as a rollback is a "rollback".
RELAUNCH_KIND = {
    "preemption": "preemption",
    "hardware_fault": "hardware fault",
    "unknown_exit": "kill",
    "hang": "hang",
}
#: (marker, colour) of each kind of relaunch; any other kind (an OOM resumed, say) gets OTHER_MARK.
RELAUNCH_MARKS = {
    "rollback": ("<", "tab:purple"),
    "kill": ("X", "black"),
    "hardware fault": ("s", "tab:brown"),
    "preemption": ("D", "tab:orange"),
    "hang": ("P", "tab:olive"),
}
OTHER_MARK = ("o", "tab:gray")
LEGEND_ORDER = (
    "loss (live)",
    "val_loss (live)",
    "abandoned branch",
    "non-finite value",
    "anomaly onset",
    "rollback",
    *(f"relaunch: {kind}" for kind in RELAUNCH_MARKS),
)


@dataclass(frozen=True)
class Relaunch:
    """One segment boundary: segment `segment` started at `step` after a relaunch of this kind."""

    segment: int
    step: int
    kind: str
    event: str | None
    action: str


def relaunches(record: RecordLike) -> list[Relaunch]:
    """Every relaunch of the lineage, in order, at the step the new segment started from. Pure.

    The step is the decision's target; without one, the step of the checkpoint the next segment restored,
    0 from scratch, and else the step the event was seen at (a "newest valid" resume with nothing known).
    """
    record = as_json(record)
    segments = {s.get("index"): s for s in record.get("segments") or []}
    out = []
    for row in timeline_rows(record):
        if row["in_process"] or row["action"] not in RELAUNCH_ACTIONS:
            continue
        nxt = segments.get(row["segment"] + 1) or {}
        step = row["target_step"]
        if step is None:
            step = _restored_step(nxt.get("restore") or {})
        if step is None:
            step = row["step"] if row["step"] is not None else row["onset_step"]
        if step is None and not row.get("target_id"):
            step = 0  # no checkpoint chosen: a relaunch from scratch (as the tables say)
        if step is None:
            continue
        kind = "rollback" if row["action"] == "rollback" else RELAUNCH_KIND.get(row["event"] or "", None)
        kind = kind or (row["event"] or "other").replace("_", " ")
        out.append(Relaunch(row["segment"] + 1, int(step), kind, row["event"], row["action"]))
    return out


def relaunch_counts_text(marks: list[Relaunch], in_process: int) -> str:
    """The title's second line: how many relaunches of each kind are marked, and the in-process rollbacks."""
    by_kind = Counter(m.kind for m in marks)
    kinds = sorted(by_kind, key=lambda k: (list(RELAUNCH_MARKS).index(k) if k in RELAUNCH_MARKS else 99, k))
    text = f"{len(marks)} relaunch(es) marked" + (
        ": " + ", ".join(f"{by_kind[k]} {k}" for k in kinds) if marks else ""
    )
    return text + f"; {in_process} in-process rollback(s) (arrows)"


def _restored_step(restore: dict[str, Any]) -> int | None:
    if restore.get("from_scratch"):
        return 0
    if restore.get("checkpoint_id"):
        from supervisor.checkpoint.options import parse_id

        try:
            return parse_id(restore["checkpoint_id"])[0]
        except ValueError:
            return None
    return None


def sidecar_path(png: str | os.PathLike[str]) -> Path:
    """`loss.png` → `loss.marks.json`: what the plot marked, for tests and tools that cannot read a PNG."""
    path = Path(png)
    return path.with_name(path.stem + ".marks.json")


def plot_lineage(record: RecordLike, points: dict[str, list[Point]], path: str | os.PathLike[str]) -> Path:
    """Write the lineage's loss (and val_loss) versus step as a PNG at `path`; returns the path.

    Other metrics in `points` are ignored. Non-finite values are left out of the lines and marked with
    red crosses along the top edge. What was marked goes to `sidecar_path(path)` as JSON.
    """
    fig, drawn = draw_lineage(record, points)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    sidecar_path(out).write_text(json.dumps({"png": out.name, **drawn}, indent=2, allow_nan=False))
    return out


def draw_lineage(record: RecordLike, points: dict[str, list[Point]]) -> tuple[Any, dict[str, Any]]:
    """(the matplotlib Figure, what it marks: title, relaunches, counts by kind, anomaly marks)."""
    record = as_json(record)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    fig = Figure(figsize=(11, 5.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = ax.get_xaxis_transform()  # x in data, y in axes fraction: for marks with no finite value
    legend: dict[str, Any] = {}

    for name, color in SERIES.items():
        live, abandoned = split_branches(points.get(name) or [])
        marker = "o" if name != "loss" else None
        for run in runs(abandoned):
            xs, ys = _xy(run)
            dot = marker or ("." if len(run) == 1 else None)  # a one-point branch has no line to draw
            ax.plot(xs, ys, color=ABANDONED_COLOR, lw=1.2, marker=dot, ms=3, zorder=1)
            legend["abandoned branch"] = Line2D([], [], color=ABANDONED_COLOR, lw=1.2)
        if live:
            xs, ys = _xy(live)
            ax.plot(xs, ys, color=color, lw=1.4, marker=marker, ms=3.5, zorder=3)
            legend[name + " (live)"] = Line2D([], [], color=color, lw=1.4, marker=marker)
        bad = [s for s, v, _ in live + abandoned if not math.isfinite(v)]
        if bad:
            ax.plot(bad, [0.97] * len(bad), "x", color=ANOMALY_COLOR, ms=7, mew=2, transform=top, zorder=5)
            legend["non-finite value"] = Line2D([], [], color=ANOMALY_COLOR, marker="x", lw=0, mew=2)

    ax.set_yscale(y_scale(v for series in points.values() for _, v, _ in series))

    loss = points.get("loss") or []
    live_loss, _ = split_branches(loss)
    anomalies = []
    for k, row in enumerate(timeline_rows(record)):
        x = row["onset_step"] if row["onset_step"] is not None else row["step"]
        if x is None:
            continue
        anomalies.append(
            {"step": x, "event": row["event"], "action": row["action"], "replay": row.get("replay")}
        )
        ax.axvline(x, color=ANOMALY_COLOR, ls=":", lw=1, alpha=0.6, zorder=2)
        ax.plot([x], [1.0], "v", color=ANOMALY_COLOR, ms=8, transform=top, clip_on=False, zorder=6)
        ax.annotate(
            (row["event"] or "?") + (f" ({row['replay']})" if row["action"] == "replay" else ""),
            xy=(x, 1.0),
            xycoords=top,
            xytext=(6, -10 - 11 * (k % 3)),
            textcoords="offset points",
            color=ANOMALY_COLOR,
            fontsize=8,
        )
        legend["anomaly onset"] = Line2D([], [], color=ANOMALY_COLOR, marker="v", ls=":")
        if row["action"] in ARROW_COLORS and row["target_step"] is not None:
            _arrow(ax, row, loss, live_loss, top)
            legend[row["action"]] = Line2D([], [], color=ARROW_COLORS[row["action"]], ls="--")

    marks = relaunches(record)
    for mark in marks:
        _relaunch_mark(ax, mark, top)
        legend[f"relaunch: {mark.kind}"] = Line2D(
            [], [], color=_style(mark.kind)[1], marker=_style(mark.kind)[0], ls="-."
        )
    in_process = sum(r["in_process"] and r["action"] == "rollback" for r in timeline_rows(record))
    counts_line = relaunch_counts_text(marks, in_process)

    if not points or not any(points.values()):
        ax.text(0.5, 0.5, "no metric points logged", transform=ax.transAxes, ha="center", color="0.4")
    title = textwrap.fill(summary_line(record), 130) + "\n" + counts_line
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    if legend:
        names = sorted(
            legend, key=lambda n: LEGEND_ORDER.index(n) if n in LEGEND_ORDER else len(LEGEND_ORDER)
        )
        # Outside the axes: event labels run along the top edge and the curve along the bottom.
        ax.legend([legend[n] for n in names], names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    drawn = {
        "title": title,
        "relaunches": [asdict(m) for m in marks],
        "relaunch_counts": dict(Counter(m.kind for m in marks)),
        "in_process_rollbacks": in_process,
        "anomalies": anomalies,
    }
    return fig, drawn


def _style(kind: str) -> tuple[str, str]:
    return RELAUNCH_MARKS.get(kind, OTHER_MARK)


def _relaunch_mark(ax: Any, mark: Relaunch, top: Any) -> None:
    """A dash-dot line at the step the segment started from, and its kind's marker on the bottom edge."""
    marker, color = _style(mark.kind)
    ax.axvline(mark.step, color=color, ls="-.", lw=1, alpha=0.5, zorder=2)
    ax.plot(
        [mark.step],
        [0.0],
        marker,
        color=color,
        ms=8,
        transform=top,
        clip_on=False,
        zorder=6,
        gid=f"relaunch:{mark.segment}:{mark.kind}",
    )
    ax.annotate(
        f"seg {mark.segment}: {mark.kind}",
        xy=(mark.step, 0.0),
        xycoords=top,
        xytext=(4, 8),
        textcoords="offset points",
        color=color,
        fontsize=7,
        rotation=90,
    )


def y_scale(values: Iterable[float]) -> str:
    """ "log" when the finite values are all positive and span more than two decades, else "linear"."""
    finite = [v for v in values if math.isfinite(v)]
    return "log" if finite and min(finite) > 0 and max(finite) / min(finite) > 100 else "linear"


def _xy(points: list[Point]) -> tuple[list[int], list[float]]:
    # NaN breaks the line at a non-finite value instead of drawing it off the chart.
    return [p[0] for p in points], [p[1] if math.isfinite(p[1]) else math.nan for p in points]


def _arrow(ax: Any, row: dict[str, Any], loss: list[Point], live: list[Point], top: Any) -> None:
    """Dashed arrow from the branch tip when the decision was taken back to the restored step."""
    color = ARROW_COLORS[row["action"]]
    tip = _tip(loss, row)
    fx = tip[0] if tip else row["step"] or row["onset_step"]
    tx = row["target_step"]
    target = [p for p in live if p[0] <= tx and math.isfinite(p[1])] or [
        p for p in live if math.isfinite(p[1])
    ]
    ty = target[-1][1] if target and tx > 0 else (target[0][1] if target else None)
    if tip is None or ty is None:
        # No finite value to anchor on: draw the arrow along the top edge instead.
        start, end, coords = (fx, 0.9), (tx, 0.9), top
    else:
        start, end, coords = (fx, tip[1]), (tx, ty), "data"
    ax.annotate(
        "",
        xy=end,
        xycoords=coords,
        xytext=start,
        textcoords=coords,
        arrowprops={
            "arrowstyle": "-|>",
            "ls": "--",
            "lw": 1.3,
            "color": color,
            "connectionstyle": "arc3,rad=0.2",
        },
        zorder=4,
    )
    label = f"{row['action']} → {tx}"
    if row["action"] == "rollback" or row["skip_batches"] or row["lr_scale"] != 1.0:
        label += f"\nskip {row['skip_batches']}, lr ×{row['lr_scale']:g}"
    ax.annotate(
        label,
        xy=end,
        xycoords=coords,
        xytext=(4, 6),
        textcoords="offset points",
        color=color,
        fontsize=8,
        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "lw": 0.6, "alpha": 0.85},
    )


def _tip(loss: list[Point], row: dict[str, Any]) -> Point | None:
    """The last finite loss point logged before the decision: the tip of the branch the anomaly ended."""
    ordered = sorted((p for p in loss if math.isfinite(p[1])), key=lambda p: p[2])
    if row.get("time"):
        before = [p for p in ordered if p[2] <= row["time"] * 1000.0]
        if before:
            return before[-1]
    at = [p for p in ordered if p[0] == row["step"]]
    return at[-1] if at else None
