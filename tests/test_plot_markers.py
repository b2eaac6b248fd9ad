"""Every segment boundary on the loss plot (issue 19): each relaunch is marked by its kind (rollback, kill,
hardware fault, preemption, hang), the title's counts match the marks, and a sidecar JSON records them."""

from __future__ import annotations

import json
import math
import re
from collections import Counter

import pytest

from supervisor.report import counts, plot_lineage
from supervisor.report.plot import RELAUNCH_MARKS, draw_lineage, relaunches, sidecar_path

T0 = 1763772000.0
#: (first, last) step logged by each branch, in time order: an in-process NaN at 150 rolled back to 100;
#: then segments ended by a spike (onset 298), a SIGKILL, a GPU off the bus, a preemption and a hang.
BRANCHES = [(1, 150), (101, 310), (201, 355), (301, 430), (401, 480), (481, 560), (501, 700)]
ENDS = [T0 + 10.0 * (i + 1) for i in range(len(BRANCHES))]


def _ckpt(step: int) -> str:
    return f"{step:010d}-{step // 10:06d}"


def _event(type_, step, onset=None, source="exit", wall=0.0, reason=""):
    return {
        "type": type_,
        "reason": reason or f"{type_} at step {step}",
        "metric": "loss" if source != "exit" else None,
        "onset_step": onset,
        "step": step,
        "value": None,
        "wall_time": wall,
        "source": source,
        "evidence": {},
    }


def _decision(action, target_step, reason):
    return {
        "action": action,
        "target_id": _ckpt(target_step) if target_step is not None else None,
        "target_step": target_step,
        "skip_batches": 0,
        "lr_scale": 1.0,
        "delay_seconds": 0.5,
        "reason": reason,
    }


def _restore(step):
    if step is None:
        return {"checkpoint_id": None, "skip_batches": 0, "lr_scale": 1.0, "from_scratch": False}
    return {"checkpoint_id": _ckpt(step), "skip_batches": 0, "lr_scale": 1.0, "from_scratch": False}


def _record() -> dict:
    ends = ENDS
    spike = _event("spike", 310, 298, "monitor", ends[1])
    ended_by = [
        (spike, "rollback", 200, None),
        (_event("unknown_exit", None, wall=ends[2]), "resume", 300, 200),
        (_event("hardware_fault", None, wall=ends[3]), "resume", 400, 300),
        (_event("preemption", 480, wall=ends[4]), "resume", 480, 400),
        (_event("hang", 560, wall=ends[5]), "resume", 500, 480),
        (None, None, None, 500),
    ]
    segments = []
    for i, (event, action, target, restored) in enumerate(ended_by):
        segments.append(
            {
                "index": i,
                "started": ends[i] + 0.5 if i else T0,
                "ended": ends[i + 1] + 0.5,
                "restore": _restore(restored),
                "outcome": action or "finished",
                "event": event,
                "decision": _decision(action, target, f"{event['type']} -> {action}") if event else None,
                "in_process": [],
            }
        )
    nan = _event("non_finite", 150, 150, "in_process", ends[0])
    segments[0]["in_process"] = [
        {"time": ends[0] + 0.1, "event": nan, "decision": _decision("rollback", 100, "nan -> rollback")}
    ]
    return {"lineage": "kinds", "status": "finished", "final_checkpoint": _ckpt(700), "segments": segments}


def _points() -> dict[str, list[tuple[int, float, int]]]:
    loss, t = [], T0
    for branch, (first, last) in enumerate(BRANCHES):
        for step in range(first, last + 1):
            bad = branch == 0 and step == 150
            loss.append((step, math.nan if bad else 3.0 * math.exp(-step / 300) + 0.5, int(t * 1000)))
            t += 10.0 / (last - first + 1)
    return {"loss": loss}


EXPECTED = [
    (1, 200, "rollback"),
    (2, 300, "kill"),
    (3, 400, "hardware fault"),
    (4, 480, "preemption"),
    (5, 500, "hang"),
]


def test_every_relaunch_is_drawn_with_its_kind_and_the_title_counts_match(tmp_path):
    record = _record()
    fig, drawn = draw_lineage(record, _points())
    (ax,) = fig.axes
    marks = sorted(
        (int(line.get_gid().split(":")[1]), line)
        for line in ax.lines
        if (line.get_gid() or "").startswith("relaunch:")
    )
    got = [(seg, int(line.get_xdata()[0]), line.get_gid().split(":", 2)[2]) for seg, line in marks]
    assert got == EXPECTED
    for _, line in marks:  # each kind has its own marker
        kind = line.get_gid().split(":", 2)[2]
        assert line.get_marker() == RELAUNCH_MARKS[kind][0]
    assert len({line.get_marker() for _, line in marks}) == 5

    title = ax.get_title(loc="left")
    marked = re.search(r"(\d+) relaunch\(es\) marked: ([^;]+); (\d+) in-process", title)
    assert marked, title
    in_title = {kind: int(n) for n, kind in re.findall(r"(\d+) ([a-z ]+?)(?:,|$)", marked.group(2))}
    assert in_title == Counter(kind for _, _, kind in got)
    assert int(marked.group(1)) == len(got)
    # Relaunches plus in-process rollbacks are the restarts the summary (first title line) counts.
    restarts = counts(record)["restarts"]
    assert f"{restarts} restart(s)" in title and restarts == len(got) + int(marked.group(3)) == 6
    assert drawn["title"] == title


def test_the_sidecar_next_to_the_png_records_what_was_marked(tmp_path):
    out = plot_lineage(_record(), _points(), tmp_path / "loss.png")
    side = json.loads(sidecar_path(out).read_text())
    assert sidecar_path(out) == tmp_path / "loss.marks.json"
    assert side["png"] == "loss.png" and out.read_bytes()[:4] == b"\x89PNG"
    assert [(m["segment"], m["step"], m["kind"]) for m in side["relaunches"]] == EXPECTED
    assert side["relaunch_counts"] == {k: 1 for _, _, k in EXPECTED}
    assert side["in_process_rollbacks"] == 1
    assert (
        "5 relaunch(es) marked: 1 rollback, 1 kill, 1 hardware fault, 1 preemption, 1 hang" in side["title"]
    )


@pytest.mark.parametrize(
    ("decision_target", "next_restore", "step"),
    [
        (300, _restore(200), 300),  # the decision's target
        (None, _restore(250), 250),  # else the checkpoint the next segment restored
        (None, {**_restore(None), "from_scratch": True}, 0),
        (None, _restore(None), 0),  # no checkpoint chosen: from scratch, as the tables say
    ],
)
def test_a_relaunch_is_placed_where_the_next_segment_started(decision_target, next_restore, step):
    record = _record()
    seg = record["segments"][1]
    seg["decision"] = {**seg["decision"], "target_step": decision_target}
    if decision_target is None:
        seg["decision"]["target_id"] = None
    record["segments"][2]["restore"] = next_restore
    assert relaunches(record)[1].step == step
    assert relaunches(record)[1].kind == "kill"
