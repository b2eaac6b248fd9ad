"""The suite's own tools: per-test CPU accounting (tests/cpu_profile.py) and the longest-first file order
(tests/file_costs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO
from tests.file_costs import from_durations

SAMPLE = textwrap.dedent(
    """
    import subprocess, sys, time

    def test_sleeps():
        time.sleep(1.0)

    def test_child_works():
        subprocess.run([sys.executable, "-c", "t = __import__('time').process_time()\\nwhile __import__('time').process_time() - t < 1.0: pass"], check=True)
    """
)


def test_cpu_profile_tells_a_waiting_test_from_a_working_one(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = tmp_path / "cpu.jsonl"
    env = {"ROLLBACK_TEST_CPU": str(out), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "tests.cpu_profile",
        "-p",
        "no:cacheprovider",
        "test_sample.py",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["test"]: r for r in map(json.loads, out.read_text().splitlines())}
    sleeps, works = rows["test_sample.py::test_sleeps"], rows["test_sample.py::test_child_works"]
    assert sleeps["wall_s"] >= 1.0 and sleeps["cpu_s"] < 0.5, sleeps
    assert works["cpu_s"] >= 1.0, works  # a reaped child's CPU counts
    summary = subprocess.run(
        [sys.executable, "-m", "tests.cpu_profile", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert summary.splitlines()[1].endswith("test_sample.py::test_sleeps"), summary  # most idle first


def test_file_costs_sums_each_files_phases_and_leaves_short_files_out():
    text = "\n".join(
        [
            "12.50s call     tests/test_a.py::test_one",
            "3.00s setup    tests/test_a.py::test_one",
            "2.00s call     tests/test_b.py::test_two[x]",
            "4.10s teardown tests/test_c.py::test_three",
            "(12 durations < 0.005s hidden.)",
        ]
    )
    assert from_durations(text) == {"tests/test_a.py": 16, "tests/test_c.py": 4}
    assert list(from_durations(text)) == ["tests/test_a.py", "tests/test_c.py"]  # longest first
