"""`bench chaos` (issue 14, 6.2), the short CI version: 20 savers SIGKILLed in turn in each phase of a save,
each followed by a check from a new process; and the checker's own tallies, table-driven."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.chaos import Trial, _Counts

CLI = Path(sys.executable).with_name("rollback-supervisor")


@pytest.mark.e2e
def test_bench_chaos_kills_savers_in_every_phase_and_every_restore_is_exact(tmp_path: Path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [str(CLI), "bench", "chaos", "--trials", "20", "--state-mb", "8", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["trials"] == 20 and len(result["trial_log"]) == 20
    assert result["bad_restores"] == 0, result["problems"]
    assert result["restore_failures"] == result["partial_restores"] == 0
    assert result["invalid_committed_checkpoints"] == 0
    assert result["latest_moved_backwards"]["local"]["max_steps"] == 0
    phases = result["phases"]
    assert list(phases) == ["copy", "checksum", "write", "commit", "retention"]  # no upload without a remote
    assert all(p["targeted"] == 4 for p in phases.values())
    # Where the kills landed is read from the saver's own markers; on a busy machine a few land after the
    # phase they targeted, but they spread over the phases.
    assert sum(1 for p in phases.values() if p["killed_in"] > 0) >= 3, phases
    # Every trial restored a checkpoint at least as new as the last one committed before its kill.
    for trial in result["trial_log"]:
        assert trial["local"]["latest"] >= trial["local"]["committed_before_kill"] > 0, trial


def _trial(markers: list[str], target: str = "commit") -> Trial:
    trial = Trial(0, target, 1, 0.5)
    trial.markers = [(0.0, m.split()) for m in markers]
    trial.resumed = 4
    return trial


def _view(step: int | None, error: str | None = None, mismatched: tuple[str, ...] = ()) -> dict:
    return {
        "views": {"local": {"step": step, "error": error, "mismatched": list(mismatched)}},
        "invalid_committed": [],
    }


SAVE_5 = ["R 4", "B copy 5 1", "E copy 5 1", "B checksum 5 1", "E checksum 5 1", "B write 5 1", "E write 5 1"]


@pytest.mark.parametrize(
    "markers, check, killed_in, bad",
    [
        # Killed mid-commit: the previous checkpoint (4) or the one committing (5) is a good latest.
        (SAVE_5 + ["B commit 5 1"], _view(4), ["commit"], 0),
        (SAVE_5 + ["B commit 5 1"], _view(5), ["commit"], 0),
        # Step 5's commit had finished: restoring 4 means "latest" moved backwards.
        (SAVE_5 + ["B commit 5 1", "E commit 5 1"], _view(4), [], 1),
        # A restore that raised, one that came back with the wrong bytes, one of a step never saved.
        (SAVE_5, _view(None, error="CheckpointCorrupt: x"), [], 1),
        (SAVE_5, _view(4, mismatched=("moving_a",)), [], 1),
        (SAVE_5, _view(6), [], 1),
    ],
    ids=["commit-old", "commit-new", "backwards", "failed", "partial", "never-saved"],
)
def test_the_checker_counts_every_kind_of_bad_restore(markers, check, killed_in, bad):
    counts = _Counts(["copy", "checksum", "write", "commit", "retention"])
    trial = _trial(markers)
    last = {"local": max([4, *trial.finished("commit")])}
    begun = {"local": max([4, *trial.begun("commit")])}
    entry = counts.add(trial, check, last, begun)
    assert entry["killed_in"] == killed_in
    assert counts.bad() == bad
