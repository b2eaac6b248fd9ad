"""`bench chaos --sharded` (issue 17, crash tests), the short CI version: 9 rounds of a 2-rank FSDP2 run, each
ending in a real SIGKILL of one rank (every phase of the save protocol once, both ranks, and 3 timed kills),
each followed by a restore from a new process; and the checker's own tallies, table-driven."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos_sharded import Round, _Tally, kill_plan
from supervisor.checkpoint.dcp_writer import PHASES

CLI = Path(sys.executable).with_name("rollback-supervisor")


@pytest.mark.e2e
def test_sigkills_of_either_rank_in_every_phase_leave_old_or_new_latest_restored_bit_for_bit(tmp_path: Path):
    out = tmp_path / "chaos-sharded.json"
    proc = subprocess.run(
        [
            str(CLI),
            "bench",
            "chaos",
            "--sharded",
            "--kills",
            "9",
            "--json",
            str(out),
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["kills"] == 9 and len(result["round_log"]) == 9
    assert result["mixed_restores"] == result["partial_restores"] == 0, result["problems"]
    assert result["bad"] == 0 and result["target"]["met"], result["problems"]
    assert result["survivor_hung"] == result["tmp_left_after_open"] == result["verify_failures"] == 0
    phase_rounds = [r for r in result["round_log"] if r["mode"] == "phase"]
    assert {r["phase"] for r in phase_rounds} == set(PHASES)
    assert {r["victim"] for r in phase_rounds} == {0, 1}
    for r in result["round_log"]:
        assert r["victim_sigkilled"], r
        # The survivor left by itself, at once (a dead peer resets gloo's connection; no timeout waited for).
        assert r["survivor"]["exit_code"] == 3 and r["survivor"]["exit_after_kill_s"] < 5.0, r
        assert r["latest"] in ("old", "new", "none"), r
    by_pair = {(r["phase"], r["victim"]): r["latest"] for r in phase_rounds}
    # The crash table of the design (section 4): before the marker, the old latest; once it is written, the new.
    assert by_pair[("before_marker", 0)] == "old" and by_pair[("committed", 1)] == "new"
    assert by_pair[("write_start", 1)] in ("old", "none") and by_pair[("after_blob", 0)] in ("old", "none")
    # Every round after the first commit restored a checkpoint at least as new as the last one committed.
    assert sum(1 for r in result["round_log"] if r["latest"] == "old") >= 3


def test_the_plan_covers_every_phase_and_both_ranks_in_its_first_rounds():
    plan = kill_plan(18, random.Random(0))
    phase_rounds = [p for p in plan if p["mode"] == "phase"]
    assert len(phase_rounds) == 12 and sum(p["mode"] == "timed" for p in plan) == 6
    assert {(p["phase"], p["victim"]) for p in phase_rounds} == {(p, v) for p in PHASES for v in (0, 1)}
    first = phase_rounds[:6]
    assert {p["phase"] for p in first} == set(PHASES) and {p["victim"] for p in first} == {0, 1}


def _round(saved_steps: list[int], in_flight: int | None) -> Round:
    rnd = Round(3, {"mode": "phase", "victim": 0, "phase": "before_marker", "save": 2})
    for s in saved_steps:
        rnd.markers += [["0", "save", str(s), "1.0", "1"], ["0", "saved", str(s), "1.1", f"{s:010d}-{s:06d}"]]
    if in_flight is not None:
        rnd.markers += [
            ["0", "save", str(in_flight), "2.0", "2"],
            ["0", "phase", str(in_flight), "2.1", "plan"],
        ]
    return rnd


def _check(cid: str | None, **over) -> dict:
    return {
        "id": cid,
        "step": int(cid.split("-")[0]) if cid else None,
        "error": None,
        "differences": {"old": [], "new": []},
        "tmp_left": [],
        "orphan_blobs": [],
        "invalid": {},
        "commits": [cid] if cid else [],
        "restore_s": 0.01,
        "resumed_from": None,
        "resume_known": True,
        **over,
    }


ENTRY = {
    "mode": "phase",
    "victim": 0,
    "phase": "before_marker",
    "killed_in": "phase:before_marker",
    "victim_sigkilled": True,
    "survivor": {"hung": False, "exit_code": 3, "error": "RankLost", "exit_after_kill_s": 0.03},
}
OLD = {"id": "0000000004-000004", "step": 4, "ref": "unused"}


@pytest.mark.parametrize(
    "check, entry, latest, kinds",
    [
        (_check("0000000004-000004"), ENTRY, "old", {}),
        (_check("0000000005-000005"), ENTRY, "new", {}),
        # A step never saved, or an older commit than the last one: latest is neither old nor new.
        (_check("0000000006-000006"), ENTRY, "mixed", {"mixed": 1}),
        (_check("0000000003-000003"), ENTRY, "mixed", {"mixed": 1}),
        # The right id with the wrong bytes, a restore that raised, nothing restored after a commit.
        (
            _check("0000000005-000005", differences={"new": ["differs model.0.weight"]}),
            ENTRY,
            "new",
            {"partial": 1},
        ),
        (_check(None, error="CheckpointCorrupt: x"), ENTRY, "error", {"partial": 1}),
        (_check(None), ENTRY, "none", {"partial": 1}),
        # What the open must clean, what verify must pass, and a survivor that never left.
        (_check("0000000004-000004", tmp_left=["x.1"]), ENTRY, "old", {"tmp_left": 1}),
        (_check("0000000004-000004", invalid={"0000000004-000004": "bad"}), ENTRY, "old", {"verify": 1}),
        (
            _check("0000000004-000004"),
            {**ENTRY, "survivor": {**ENTRY["survivor"], "hung": True}},
            "old",
            {"hung": 1},
        ),
        (
            _check("0000000004-000004"),
            {**ENTRY, "survivor": {**ENTRY["survivor"], "exit_after_kill_s": 11.0}},
            "old",
            {"slow_exit": 1},
        ),
        # The checking process itself raised: nothing it checked counts as good.
        ({"failed": "FileNotFoundError: x", "traceback": ""}, ENTRY, "error", {"check_failed": 1}),
    ],
    ids=[
        "old",
        "new",
        "never-saved",
        "older",
        "partial",
        "failed",
        "lost",
        "tmp",
        "verify",
        "hung",
        "slow",
        "check",
    ],
)
def test_the_checker_counts_every_kind_of_bad_round(check, entry, latest, kinds):
    rnd = _round([4], 5)
    tally = _Tally()
    got = tally.add(rnd, entry, check, OLD, rnd.in_flight())
    assert got["latest"] == latest
    assert dict(tally.kinds) == kinds and tally.bad() == sum(kinds.values())
    assert tally.summary()["target"]["met"] is (not kinds)


def test_a_save_some_rank_saw_return_is_committed_not_in_flight():
    rnd = _round([4, 5], None)
    assert rnd.saved() == {4: "0000000004-000004", 5: "0000000005-000005"} and rnd.in_flight() is None


def test_a_save_only_rank_1_had_begun_is_not_in_flight():
    """Rank 0 died between the gather and its save (rank 1 already in the save): nothing could commit."""
    rnd = _round([4], None)
    rnd.markers.append(["1", "save", "5", "2.0", "2"])
    assert rnd.in_flight() is None
    rnd.markers.append(["0", "save", "5", "2.0", "2"])
    assert rnd.in_flight() == 5
