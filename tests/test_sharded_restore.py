"""Restore of a sharded checkpoint whose file is bad on one rank only: every rank learns it together. Two real
processes (gloo): one rank's corrupt ranks.<r>.json makes both fall back to the older checkpoint for "latest",
and both raise CheckpointCorrupt for that checkpoint's id (no rank carries on alone and hangs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "restore_child.py"
TIMEOUT_S = 20.0  # the checkpoint group's collective timeout: a desynchronised rank ends as RankLost
pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # real multi-process runs


def test_a_corrupt_rank_file_on_rank_1_makes_both_ranks_fall_back_or_raise_corrupt(tmp_path):
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
        }
        args = [sys.executable, str(CHILD), tmp_path, tmp_path / "store", TIMEOUT_S]
        procs.append(
            subprocess.Popen(
                list(map(str, args)), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    try:
        for p in procs:
            p.wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    logs = [p.stdout.read().decode(errors="replace")[-2000:] for p in procs if p.stdout]
    assert [p.returncode for p in procs] == [0, 0], logs
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    save1, save2 = reports[0]["save1"], reports[0]["save2"]
    assert save1 and save2 and save1 != save2
    for report in reports:
        assert report["latest"] == save1, report
        kind, message = report["explicit"]
        assert kind == "CheckpointCorrupt", report
        assert f"checkpoint {save2} is invalid: rank 1: " in message and "ranks.1.json" in message, report
    # Rank 0's own failures before DCP's collectives reach rank 1 as the same typed error, not as RankLost.
    for tag, says in (("second_writer", "lock"), ("save_broken_clock", "clock unavailable (injected)")):
        kinds = [r[tag][0] for r in reports]
        assert kinds == ["CheckpointError", "CheckpointError"], reports
        assert reports[0][tag][1] == reports[1][tag][1] and says in reports[1][tag][1], reports
    # A corrupt checkpoint named by id is CheckpointCorrupt on every rank (not a plain CheckpointError).
    assert [r["corrupt_manifest"][0] for r in reports] == ["CheckpointCorrupt"] * 2, reports
    assert reports[0]["corrupt_manifest"][1] == reports[1]["corrupt_manifest"][1], reports
    assert f"checkpoint {save1} is invalid" in reports[1]["corrupt_manifest"][1], reports
