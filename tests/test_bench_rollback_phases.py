"""`bench rollback` keeps what it measured: the JSON after each phase, a bounded overhead phase, a killed run."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import benchmarks.overhead
import benchmarks.rollback
from benchmarks.common import BenchRunError, PhasedResult
from benchmarks.overhead import supervisor_cpu
from benchmarks.rollback import PATHS, phases, summarize
from supervisor.cli import main
from tests.conftest import REPO
from tests.test_bench_rollback import INPROC, NAIVE, RELAUNCH

COST = {
    "supervisor_cpu_s": 0.5,
    "steps": 7,
    "timed_out": True,
    "targets": {"supervisor_cpu_s/training_cpu_s": {"value": 0.01, "target": 0.02, "met": True}},
}


def fake_run(workdir, size, reps, batch_size, threads, device, say, on_phase) -> dict[str, Any]:
    """`benchmarks.rollback.run` without children: every phase reported, in order, with canned samples."""
    info = {"size": size, "reps": reps, "batch_size": batch_size, "threads": threads, "load_start": 0}
    result = summarize(INPROC, RELAUNCH[:reps], NAIVE[:reps], **info)
    for phase in phases(reps):
        on_phase(phase, result)
    return result


def bench(tmp_path: Path, *extra: str) -> tuple[int, Path]:
    out = tmp_path / "rollback.json"
    argv = [
        "bench",
        "rollback",
        "--size",
        "tiny",
        "--reps",
        "2",
        "--json",
        str(out),
        "--workdir",
        str(tmp_path),
    ]
    return main([*argv, *extra]), out


def test_phases_are_the_in_process_run_the_replay_then_each_path_of_each_repetition():
    assert phases(2) == ["in_process", "replay", *(f"{p}-1" for p in PATHS), *(f"{p}-2" for p in PATHS)]


def test_the_replay_is_judged_against_two_uninterrupted_steps_and_a_memory_restore():
    info = {"size": "tiny", "reps": 1, "batch_size": 1, "threads": None, "load_start": 0}
    verdict = {"verdict": "replay_mismatch", "steps": 2, "from_step": 4, "onset_step": 6}
    replayed = {"replay_s": 0.5, "steps_s": [0.2, 0.3, 0.2], "verdict": verdict, "fault": "sdc@5"}
    got = summarize(INPROC, RELAUNCH[:1], NAIVE[:1], replayed=replayed, **info)
    restore = got["in_process"]["restore_s"]
    assert got["replay"]["two_steps_and_restore_s"] == pytest.approx(2 * 0.2 + restore)
    assert got["targets"]["replay_s/(2 steps + memory restore)"] == {
        "value": pytest.approx(0.5 / (0.4 + restore)),
        "target": 1.0,
        "met": 0.5 <= 0.4 + restore,
    }
    assert got["replay_s"] == 0.5 and got["replay"]["verdict"] == "replay_mismatch"
    assert "replay" not in summarize(INPROC, RELAUNCH[:1], NAIVE[:1], **info)


def test_each_phase_rewrites_the_file_incomplete_until_the_end(tmp_path: Path):
    out = tmp_path / "r.json"
    result = PhasedResult(out, ["a", "b"])
    result.phase_done("a", {"x": 1})
    assert json.loads(out.read_text()) == {
        "x": 1,
        "complete": False,
        "phases_done": ["a"],
        "phases_planned": ["a", "b"],
    }
    result.failed("BenchRunError: b broke")
    assert json.loads(out.read_text())["error"] == "BenchRunError: b broke"
    assert json.loads(result.finish({"x": 2}))["complete"] is True
    assert json.loads(out.read_text())["x"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # no temporary file left beside it


@pytest.mark.parametrize(
    ("extra", "measured"),
    [
        pytest.param(("--overhead-steps", "0"), False, id="overhead-skipped"),
        pytest.param(
            ("--device", "cpu", "--overhead-steps", "5", "--overhead-timeout-s", "3"), True, id="bounded"
        ),
    ],
)
def test_overhead_phase_is_optional_and_gets_the_device_and_its_budget(
    tmp_path, monkeypatch, extra, measured
):
    calls = []
    monkeypatch.setattr(benchmarks.rollback, "run", fake_run)
    monkeypatch.setattr(
        benchmarks.overhead, "supervisor_cpu", lambda *a, **kw: calls.append((a, kw)) or dict(COST)
    )
    code, out = bench(tmp_path, *extra)
    assert code == 0
    result = json.loads(out.read_text())
    assert result["complete"] is True and result["phases_done"] == result["phases_planned"]
    assert ("supervisor_cpu" in result["phases_planned"]) is measured
    assert ("supervisor_cpu" in result) is measured
    assert ("supervisor_cpu_s/training_cpu_s" in result["targets"]) is measured
    if measured:
        ((args, kwargs),) = calls
        assert args[1:3] == ("tiny", 5)
        assert kwargs == {"device": "cpu", "batch_size": 1, "timeout_s": 3.0}
    else:
        assert calls == []


def test_a_failing_phase_leaves_the_phases_done_and_the_error(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise BenchRunError("overhead-tiny: the supervised run did not finish")

    monkeypatch.setattr(benchmarks.rollback, "run", fake_run)
    monkeypatch.setattr(benchmarks.overhead, "supervisor_cpu", broken)
    code, out = bench(tmp_path, "--overhead-steps", "5")
    assert code != 0
    result = json.loads(out.read_text())
    assert result["complete"] is False
    assert result["phases_done"] == phases(2) and result["phases_planned"] == [*phases(2), "supervisor_cpu"]
    assert result["error"] == "BenchRunError: overhead-tiny: the supervised run did not finish"
    assert (
        result["relaunch_s"] == 11.0
    )  # median of 9 and 13; the figures measured before the failure are kept


@pytest.mark.slow
@pytest.mark.e2e
def test_the_overhead_phase_stops_at_its_budget_and_leaves_no_process(tmp_path: Path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    budget = 6.0
    cost = supervisor_cpu(tmp_path, "tiny", 100_000, threads=1, timeout_s=budget)
    assert cost["timed_out"] is True
    assert 0 <= cost["steps"] < 100_000
    assert budget <= cost["wall_s"] < budget + 15  # killed, reaped and concluded, not run to its end
    assert cost["supervisor_cpu_s"] > 0 and cost["training_cpu_s"] > 0
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    record = json.loads((tmp_path / "lineages" / "overhead-tiny" / "lineage.json").read_text())
    assert record["status"] == "stopped" and "budget of 6 s ran out" in record["final_reason"]


def wait_for_line(proc: subprocess.Popen, text: str, timeout: float) -> list[str]:
    """Read the process's stderr until a line contains `text`; every line read. Fails on timeout or exit."""
    assert proc.stderr is not None
    lines, pending, deadline = [], b"", time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and sel.select(left), f"no {text!r} within {timeout} s: {lines[-20:]}"
            chunk = os.read(proc.stderr.fileno(), 65536)
            assert chunk, f"the bench exited {proc.wait()} before {text!r}: {lines[-20:]}"
            *new, pending = (pending + chunk).split(b"\n")
            lines += [line.decode(errors="replace") for line in new]
            if any(text in line for line in lines):
                return lines


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the bench, its process group and every descendant (standbys run in sessions of their own)."""
    os.kill(proc.pid, signal.SIGSTOP)  # it starts nothing more while its descendants are listed
    tree = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(10)
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert alive == []


@pytest.mark.slow
@pytest.mark.e2e
def test_a_run_killed_after_its_first_phase_leaves_that_phase_in_its_json(tmp_path: Path):
    out = tmp_path / "rollback.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "supervisor.cli", "bench", "rollback", "--size", "tiny", "--reps", "1"]
    cmd += ["--overhead-steps", "0", "--json", str(out), "--workdir", str(tmp_path / "work")]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stderr=subprocess.PIPE, start_new_session=True)
    try:
        wait_for_line(proc, f"in_process: done, written to {out}", timeout=120)
    finally:
        kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL
    result = json.loads(out.read_text())
    assert result["complete"] is False
    assert result["phases_done"][0] == "in_process" and result["phases_planned"] == phases(1)
    assert result["in_process_s"] > 0 and result["in_process"]["tiers"] == ["memory"]
    assert result["naive_restart_s"] is None or "naive_restart-1" in result["phases_done"]
