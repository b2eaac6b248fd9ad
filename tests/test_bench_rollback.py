"""`bench rollback`: the summary arithmetic, option errors, and a tiny-size run through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rollback import summarize
from benchmarks.rollback_child import fault_spec
from supervisor.cli import main
from tests.conftest import REPO

INPROC = {
    "anomalies": [
        {"total_s": 1.5, "handler_s": 0.5, "step_s": 1.0, "restore_s": 0.25, "tier": "memory"},
        {"total_s": 1.1, "handler_s": 0.1, "step_s": 1.0, "restore_s": 0.05, "tier": "memory"},
        {"total_s": 1.2, "handler_s": 0.2, "step_s": 1.0, "restore_s": 0.1, "tier": "memory"},
    ],
    "steps_s": [1.0, 1.0, 3.0],
    "params": 1000,
    "naive_bytes": 12000,
    "checkpoint_id": "0000000006-000003",
}
NAIVE = [
    {
        "total_s": t,
        "ready_s": t - 1,
        "interpreter_s": 0.1,
        "import_s": 3.0,
        "build_s": 1.0,
        "load_s": 1.0,
        "step_s": 1.0,
    }
    for t in (10.0, 12.0, 11.0)
]
RELAUNCH = [
    {
        "total_s": t,
        "ready_s": t - 2,
        "interpreter_s": 0.1,
        "import_s": 6.0,
        "build_s": 1.0,
        "session_s": 2.0,
        "restore_s": 0.2,
        "step_s": 2.0,
    }
    for t in (9.0, 13.0, 12.0)
]


def test_summary_reports_medians_and_both_ratios():
    got = summarize(INPROC, RELAUNCH, NAIVE, size="tiny", reps=3, batch_size=1, threads=None, load_start=0)
    assert (got["in_process_s"], got["relaunch_s"], got["naive_restart_s"], got["step_s"]) == (
        1.2,
        12.0,
        11.0,
        1.0,
    )
    assert got["step_included"] is True
    assert got["excluding_step"] == {"in_process_s": 0.2, "relaunch_s": 10.0, "naive_restart_s": 10.0}
    t = got["targets"]
    assert t["in_process_s/naive_restart_s"] == {
        "value": pytest.approx(1.2 / 11),
        "target": 0.1,
        "met": False,
    }
    assert t["relaunch_s/naive_restart_s"] == {"value": pytest.approx(12 / 11), "target": 1.0, "met": False}
    assert t["in_process_s/naive_restart_s (step excluded)"] == {
        "value": pytest.approx(0.02),
        "target": 0.1,
        "met": True,
    }
    assert t["relaunch_s/naive_restart_s (step excluded)"] == {
        "value": pytest.approx(1.0),
        "target": 1.0,
        "met": True,
    }
    assert got["step_floor"]["in_process_s/naive_restart_s"] == pytest.approx(1.0 / 11)
    assert got["in_process"]["restore_s"] == 0.1 and got["in_process"]["tiers"] == ["memory"] * 3
    assert (got["relaunch"]["session_s"], got["naive_restart"]["load_s"]) == (2.0, 1.0)


def test_each_anomaly_fires_after_the_previous_rollback():
    assert fault_spec(1) == "nan@3"
    assert fault_spec(3) == "nan@3,nan@5,nan@7"


def test_unknown_size_is_a_user_error(capsys):
    assert main(["bench", "rollback", "--size", "1T", "--json", "x.json"]) == 2
    assert "--size: expected one of tiny, small, 10M, 100M, got '1T'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.e2e
def test_tiny_run_through_the_cli_writes_every_key(tmp_path: Path):
    out = tmp_path / "rollback.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    exe = Path(sys.executable).with_name("rollback-supervisor")
    cmd = [
        str(exe),
        "bench",
        "rollback",
        "--size",
        "tiny",
        "--reps",
        "1",
        "--json",
        str(out),
        "--workdir",
        str(tmp_path),
        "--overhead-steps",
        "12",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    keys = {
        "in_process_s",
        "relaunch_s",
        "naive_restart_s",
        "step_s",
        "step_included",
        "excluding_step",
        "in_process",
        "relaunch",
        "naive_restart",
        "targets",
        "machine",
        "params",
        "state_bytes",
    }
    assert keys <= result.keys()
    assert set(result["targets"]) == {
        "in_process_s/naive_restart_s",
        "relaunch_s/naive_restart_s",
        "in_process_s/naive_restart_s (step excluded)",
        "relaunch_s/naive_restart_s (step excluded)",
        "relaunch_standby_s/naive_restart_s",
        "relaunch_standby_s/naive_restart_s (step excluded)",
        "relaunch_parked_s/naive_restart_s",
        "relaunch_parked_s/naive_restart_s (step excluded)",
        "relaunch_preloaded_s/naive_restart_s",
        "relaunch_preloaded_s/naive_restart_s (step excluded)",
        "replay_s/(2 steps + memory restore)",
        "supervisor_cpu_s/training_cpu_s",
    }
    assert result["complete"] is True and result["phases_done"] == result["phases_planned"]
    assert result["phases_planned"][:2] == ["in_process", "replay"]
    assert result["phases_planned"][-1] == "supervisor_cpu"
    replay = result["replay"]  # one replay of a step a flipped bit made wrong: two steps and a memory restore
    assert replay["verdict"] == "replay_mismatch" and replay["steps"] == 2
    assert result["replay_s"] == replay["replay_s"] > 0 and replay["two_steps_and_restore_s"] > 0
    cost = result["supervisor_cpu"]
    assert cost["steps"] == 12 and result["supervisor_cpu_s"] == cost["supervisor_cpu_s"] > 0
    assert cost["timed_out"] is False and (cost["device"], cost["batch_size"]) == ("cpu", 1)
    assert 0 < cost["supervisor_cpu_s"] < cost["training_cpu_s"]
    assert result["relaunch_parked_s"] > 0 and result["relaunch_parked"]["parked_build_s"] > 0
    assert result["relaunch_preloaded_s"] > 0  # the run checks that its restores came from the preload
    assert result["relaunch_standby_s"] > 0 and result["relaunch_standby"]["parked_rss_bytes"] > 0
    assert result["in_process"]["tiers"] == ["memory"]  # the fast path restored from the memory ring
    assert len(result["relaunch"]["samples"]) == len(result["naive_restart"]["samples"]) == 1
    assert all(result[k] > 0 for k in ("in_process_s", "relaunch_s", "naive_restart_s", "step_s"))
    # Every figure `benchmarks/compare_commits.py` compares is a number in this JSON (its end-to-end test runs
    # the checkpoint bench only; this run is the rollback bench's).
    from benchmarks.compare_commits import FIGURES, figure_value

    assert {f.name: figure_value(result, f) for f in FIGURES["rollback"] if not figure_value(result, f)} == {}
