"""Pure report views: branch splitting, the timeline, tables, summary and tags (table-driven)."""

from __future__ import annotations

import io
import json
import math

import pytest
from rich.console import Console

from policies.decision import Decision
from supervisor.events import Event
from supervisor.report import (
    counts,
    jsonable,
    markdown_table,
    report_tags,
    rich_table,
    split_branches,
    summary_line,
    timeline_rows,
)

T0 = 1763772000.0
# The story of the sample lineage, as ranges of steps logged in time order: a NaN at 150 rolled back in
# process to 100; a spike (onset 398) rolled back by the monitor to 200; a SIGKILL resumed from 400;
# a hardware fault resumed from 500; then a clean finish at 600. Checkpoint ids are those a store gets
# when it saves every 100 steps along this story (300 and 400 of the spike branch are abandoned).
STORY = [(1, 150), (101, 412), (201, 455), (401, 520), (501, 600)]
CKPT = {
    100: "0000000100-000001",
    200: "0000000200-000002",
    400: "0000000400-000006",
    500: "0000000500-000007",
}
FINAL = "0000000600-000008"


def _loss(step: int, branch: int) -> float:
    if branch == 0 and step == 150:
        return math.nan
    if branch == 1 and step >= 398:
        return 2.0 + (step - 397) * 1.5
    return 3.0 * math.exp(-step / 250) + 0.8 + 0.02 * math.sin(step)


def lineage_points() -> tuple[dict[str, list[tuple[int, float, int]]], list[float]]:
    """MLflow-style points of loss and val_loss for STORY, and the wall time at the end of each range."""
    loss, val, ends = [], [], []
    t = T0
    for branch, (first, last) in enumerate(STORY):
        t += 2.0  # relaunch / restore
        for step in range(first, last + 1):
            t += 0.1
            loss.append((step, _loss(step, branch), int(t * 1000)))
            if step % 50 == 0:
                val.append((step, _loss(step, branch) + 0.1, int(t * 1000) + 1))
        ends.append(t + 0.05)
    return {"loss": loss, "val_loss": val}, ends


def _event(type_, step, onset, source, wall, *, metric=None, value=None, reason=""):
    return Event(type_, reason or f"{type_} at step {step}", metric, onset, step, value, wall, source)


def _decision(event, action, target_step, skip=0, lr=1.0, delay=0.0):
    target = CKPT.get(target_step) if target_step is not None else None
    reason = f"rules[0] ({event.type} -> {action}): {event.reason}; {action} to {target}"
    return Decision(
        action=action,
        target_id=target,
        target_step=target_step,
        skip_batches=skip,
        lr_scale=lr,
        delay_seconds=delay,
        reason=reason,
        rule_index=0,
        event=event,
    ).to_dict()


def lineage_record() -> dict:
    """A finished lineage record as the flow writes it (lineage-format.md), matching lineage_points()."""
    _, ends = lineage_points()
    nan = _event("non_finite", 150, 150, "in_process", ends[0], metric="loss", value=math.nan)
    spike = _event(
        "spike", 412, 398, "monitor", ends[1], metric="loss", value=24.5, reason="loss 24.5 > 6 sigmas"
    )
    kill = _event("unknown_exit", 455, None, "exit", ends[2], reason="exit -9 (SIGKILL) with no known cause")
    xid = _event("hardware_fault", 520, None, "exit", ends[3], reason="Xid 79: GPU has fallen off the bus")
    no_restore = {"checkpoint_id": None, "skip_batches": 0, "lr_scale": 1.0, "from_scratch": False}

    def restore(step, skip=0, lr=1.0):
        return {"checkpoint_id": CKPT[step], "skip_batches": skip, "lr_scale": lr, "from_scratch": False}

    def seg(i, start, last, rc, outcome, event, decision, restore_, in_process=()):
        return {
            "index": i,
            "started": T0 if i == 0 else ends[i] + 1.0,
            "ended": ends[i + 1] + 0.5,
            "pid": 1000 + i,
            "returncode": rc,
            "signal_sent": "SIGTERM" if outcome == "rollback" else None,
            "restore": restore_,
            "start_step": start,
            "last_step": last,
            "outcome": outcome,
            "event": event.to_dict() if event else None,
            "decision": decision,
            "in_process": list(in_process),
        }

    inner = {
        "time": ends[0] + 0.01,
        "event": nan.to_dict(),
        "decision": _decision(nan, "rollback", 100, skip=300, lr=0.5),
        "restore_s": 0.012,
        "tier": "memory",
    }
    segments = [
        seg(
            0,
            0,
            412,
            0,
            "rollback",
            spike,
            _decision(spike, "rollback", 200, 300, 0.5, 1.0),
            no_restore,
            [inner],
        ),
        seg(
            1, 200, 455, -9, "resume", kill, _decision(kill, "resume", 400, delay=2.0), restore(200, 300, 0.5)
        ),
        seg(2, 400, 520, 1, "resume", xid, _decision(xid, "resume", 500, delay=4.0), restore(400)),
        seg(3, 500, 600, 0, "finished", None, None, restore(500)),
    ]
    return {
        "version": 1,
        "lineage": "charlm-demo",
        "created": T0,
        "updated": ends[-1],
        "status": "finished",
        "final_reason": "training finished at step 600",
        "final_checkpoint": FINAL,
        "command": ["python", "examples/charlm.py", "--steps", "600"],
        "policy": {"path": "policies/presets/palm-spike.yaml", "name": "palm-spike"},
        "mlflow": {"tracking_uri": None, "experiment": "rollback-supervisor", "run_id": None},
        "history": {"version": 1, "entries": []},
        "events_consumed": 1,
        "next_restore": no_restore,
        "segments": segments,
    }


def P(step: int, ts: int, value: float = 1.0) -> tuple[int, float, int]:
    return (step, value, ts)


@pytest.mark.parametrize(
    ("points", "live_steps", "abandoned_steps"),
    [
        ([], [], []),
        ([P(1, 1), P(2, 2), P(3, 3)], [1, 2, 3], []),
        # given out of time order: sorted by timestamp first
        ([P(3, 3), P(1, 1), P(2, 2)], [1, 2, 3], []),
        # rollback to 2: the old 3 and 4 are abandoned, the new 3 replaces the old one
        ([P(1, 1), P(2, 2), P(3, 3), P(4, 4), P(3, 5), P(4, 6)], [1, 2, 3, 4], [3, 4]),
        # the first step after a rollback equals a step already logged: that older point is abandoned too
        ([P(1, 1), P(2, 2), P(3, 3), P(2, 4)], [1, 2], [2, 3]),
        # two rollbacks, the second one further back than the first
        (
            [P(1, 1), P(2, 2), P(3, 3), P(4, 4), P(3, 5), P(4, 6), P(5, 7), P(2, 8), P(3, 9)],
            [1, 2, 3],
            [3, 4, 4, 5, 2, 3],
        ),
        # a resume that re-logs from a checkpoint after the last logged step abandons nothing
        ([P(1, 1), P(2, 2), P(3, 3), P(4, 4)], [1, 2, 3, 4], []),
        # the same step logged twice in a row is not a rollback
        ([P(1, 1), P(1, 2), P(2, 3)], [1, 1, 2], []),
        # scratch restart
        ([P(1, 1), P(2, 2), P(1, 3)], [1], [1, 2]),
    ],
)
def test_split_branches(points, live_steps, abandoned_steps):
    live, abandoned = split_branches(points)
    assert [p[0] for p in live] == live_steps
    assert sorted(p[0] for p in abandoned) == sorted(abandoned_steps)
    assert sorted(live + abandoned, key=lambda p: p[2]) == sorted(points, key=lambda p: p[2])


def test_split_branches_of_the_sample_lineage_leaves_one_point_per_step():
    points, _ = lineage_points()
    live, abandoned = split_branches(points["loss"])
    assert [p[0] for p in live] == list(range(1, 601))
    # abandoned: 101..150 (NaN branch), 201..412 (spike branch), 401..455 (killed), 501..520 (Xid)
    expected = [*range(101, 151), *range(201, 413), *range(401, 456), *range(501, 521)]
    assert [p[0] for p in abandoned] == expected
    assert all(math.isfinite(p[1]) and p[1] < 5 for p in live), "the live branch holds no NaN or spike"


def test_timeline_rows_are_in_time_order_and_include_in_process_rollbacks():
    rows = timeline_rows(lineage_record())
    got = [(r["index"], r["segment"], r["event"], r["source"], r["action"], r["target_step"]) for r in rows]
    assert got == [
        (0, 0, "non_finite", "in_process", "rollback", 100),
        (1, 0, "spike", "monitor", "rollback", 200),
        (2, 1, "unknown_exit", "exit", "resume", 400),
        (3, 2, "hardware_fault", "exit", "resume", 500),
    ]
    first, spike = rows[0], rows[1]
    assert first["in_process"] and first["tier"] == "memory" and first["restore_s"] == 0.012
    assert (spike["step"], spike["onset_step"], spike["skip_batches"], spike["lr_scale"]) == (
        412,
        398,
        300,
        0.5,
    )
    assert spike["delay_seconds"] == 1.0 and spike["target_id"] == CKPT[200]
    assert spike["reason"].startswith("rules[0] (spike -> rollback)")
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        ([], []),
        ([{"index": 0, "event": None, "decision": None, "in_process": []}], []),
        # a running segment (no outcome yet) adds nothing
        ([{"index": 0}], []),
        # a decision without a separate event dict still gives a row, from the decision's event
        (
            [{"index": 0, "decision": {"action": "stop", "reason": "plateau", "event": {"type": "plateau"}}}],
            [("plateau", "stop")],
        ),
    ],
)
def test_timeline_rows_edge_cases(segments, expected):
    rows = timeline_rows({"lineage": "x", "segments": segments})
    assert [(r["event"], r["action"]) for r in rows] == expected


def test_counts_and_summary_line():
    record = lineage_record()
    assert counts(record) == {"rollbacks": 2, "restarts": 4, "in_process": 1}
    assert summary_line(record) == (
        "charlm-demo: finished, 4 segment(s), 2 rollback(s) (1 in process), 4 restart(s), "
        f"final checkpoint {FINAL}; training finished at step 600"
    )
    assert summary_line({"lineage": "new", "status": "running", "segments": []}) == (
        "new: running, 0 segment(s), 0 rollback(s) (0 in process), 0 restart(s), final checkpoint none"
    )


def test_markdown_table_has_one_line_per_decision_and_segment_and_escapes_pipes():
    record = lineage_record()
    record["segments"][1]["event"]["reason"] = "a | b"
    record["segments"][1]["decision"]["reason"] = "why | not\nsecond line"
    text = markdown_table(record)
    lines = text.splitlines()
    assert lines[0] == f"**{summary_line(record)}**"
    timeline = [
        ln
        for ln in lines
        if ln.startswith("| ")
        and ln.split("|")[4].strip() in ("spike", "non_finite", "unknown_exit", "hardware_fault")
    ]
    assert len(timeline) == 4
    assert "why \\| not second line" in text
    assert all(ln.count("|") - ln.count("\\|") == 13 for ln in timeline), "12 columns, no stray pipes"
    assert (
        f"| 1 | 0 | 412 (onset 398) | spike | loss=24.5 | monitor | rollback | {CKPT[200]} @200 | 300 | 0.5 | 1.0s |"
        in text
    )
    # an in-process rollback continues at once: no relaunch delay is shown
    assert (
        f"| 0 | 0 | 150 | non_finite | loss=nan | in_process (memory) | rollback | {CKPT[100]} @100 | 300 | 0.5 | - |"
        in text
    )
    segment_rows = [
        ln for ln in lines[lines.index("### Segments") :] if ln.startswith("| ") and ln[2].isdigit()
    ]
    assert [ln.split("|")[7].strip() for ln in segment_rows] == ["rollback", "resume", "resume", "finished"]


def test_markdown_table_without_events():
    text = markdown_table({"lineage": "quiet", "status": "finished", "segments": []})
    assert "No events." in text and "quiet: finished" in text


def test_rich_table_renders_every_row_without_markup_errors():
    table = rich_table(lineage_record())
    out = io.StringIO()
    Console(file=out, width=250, color_system=None).print(table)
    text = out.getvalue()
    assert table.row_count == 4
    for word in (
        "non_finite",
        "spike",
        "unknown_exit",
        "hardware_fault",
        "rules[0]",
        "in_process",
        "skip 300",
    ):
        assert word in text, word


def test_report_tags_one_line_per_decision_and_clipped():
    record = lineage_record()
    record["segments"][2]["decision"]["reason"] = "x" * 9000 + "\nnext"
    tags = report_tags(record)
    assert tags["rollback.status"] == "finished"
    assert tags["rollback.final_checkpoint"] == FINAL
    assert (tags["rollback.rollbacks"], tags["rollback.restarts"]) == ("2", "4")
    decisions = sorted(k for k in tags if k.startswith("rollback.decision."))
    assert decisions == [f"rollback.decision.{i:03d}" for i in range(4)]
    assert tags["rollback.decision.001"].startswith(
        f"segment 0 step 412 (onset 398): spike [monitor] -> rollback {CKPT[200]} @200 skip 300, lr x0.5, delay 1.0s;"
    )
    assert (
        "delay" not in tags["rollback.decision.000"] and "skip 300, lr x0.5;" in tags["rollback.decision.000"]
    )
    assert all("\n" not in v and len(v) <= 5000 for v in tags.values())
    assert tags["rollback.decision.003"].endswith("…")


def test_report_tags_without_final_checkpoint_are_empty_strings():
    tags = report_tags({"lineage": "x", "status": "running", "segments": []})
    assert tags["rollback.final_checkpoint"] == "" and tags["rollback.final_reason"] == ""


def test_jsonable_makes_strict_json():
    doc = jsonable({"a": math.nan, "b": (math.inf, -math.inf, 1.5), "c": {"d": [None, "s"]}})
    assert json.loads(json.dumps(doc, allow_nan=False)) == {
        "a": "NaN",
        "b": ["Infinity", "-Infinity", 1.5],
        "c": {"d": [None, "s"]},
    }
