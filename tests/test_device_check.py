"""benchmarks/device/: the GPU check's scripts parse, name real options, and go on past a failed step (on a CPU)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from supervisor.cli import main
from tests.conftest import REPO

DEVICE = REPO / "benchmarks" / "device"


def run_sh(tmp_path: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """benchmarks/device/run.sh with `env` on top of ours, its results and logs in tmp_path/results."""
    env = {**os.environ, "RESULTS": str(tmp_path / "results"), "WHEELS": str(tmp_path / "none"), **env}
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(DEVICE / "run.sh")], env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("script", ["run.sh", "wheels.sh"])
def test_the_scripts_parse(script: str):
    proc = subprocess.run(["bash", "-n", str(DEVICE / script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_bench_command_names_real_options(tmp_path: Path, capsys, monkeypatch):
    proc = run_sh(tmp_path, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line[2:]) for line in proc.stdout.splitlines() if line.startswith("+ ")]
    assert [c[1:3] for c in commands] == [
        ["-m", "pytest"],
        ["-m", "supervisor.cli"],
        ["-m", "supervisor.cli"],
    ]
    assert (REPO / commands[0][-1]).is_file()  # tests/test_cuda.py
    assert commands[1][3:5] == ["bench", "checkpoint"] and commands[2][3:5] == ["bench", "rollback"]
    assert commands[2][commands[2].index("--json") + 1].endswith("/rollback-100M-cuda.json")
    monkeypatch.setenv("COLUMNS", "200")  # the help lists each option whole
    for command in commands[1:]:
        capsys.readouterr()
        assert main([*command[3:5], "--help"]) == 0
        shown = capsys.readouterr().out
        flags = [word for word in command[5:] if word.startswith("--")]
        assert flags and [f for f in flags if f not in shown] == []


@pytest.mark.slow
@pytest.mark.e2e
def test_a_failed_and_a_timed_out_step_do_not_stop_the_others(tmp_path: Path):
    """On a CPU: the tests step fails, the checkpoint step writes its JSON, the rollback step runs out of time."""
    env = {"DEVICE": "cpu", "PARAMS": "1M", "SIZE": "tiny", "REPS": "1", "TMPDIR": str(tmp_path)}
    proc = run_sh(tmp_path, TESTS="tests/no_such_test.py", T_ROLLBACK="4", KILL_AFTER_S="5", **env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    results = tmp_path / "results"
    summary = (results / "summary.txt").read_text()
    assert "tests: FAILED (exit 4)" in summary
    assert "checkpoint: ok" in summary and "rollback: TIMED OUT after 4 s" in summary
    checkpoint = json.loads((results / "checkpoint-1M-cpu.json").read_text())
    assert checkpoint["blocking_save_s"] > 0
    assert f"{results / 'checkpoint-1M-cpu.json'}:" in summary  # and the summary read it
    left = [
        p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []  # the timed-out bench's children went with it
