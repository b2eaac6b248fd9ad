"""`rollback-supervisor bench monitor` writes its JSON; bad options are user errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.e2e
def test_bench_monitor_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["bench", "monitor", "--json", str(out), "--trials", "2", "--points", "150", "--metrics", "2"]
    assert main([*argv, "--backends", "sqlite"]) == 0
    data = json.loads(out.read_text())
    latency, cost = data["latency"]["sqlite"], data["poll_cost"]["sqlite"]
    assert len(latency["samples_s"]) == 2 and all(s > 0 for s in latency["samples_s"])
    assert latency["target_s"] == 1.5
    assert cost["first_poll_points"] == 300 and cost["idle_poll_ms"]["median"] > 0


@pytest.mark.e2e
def test_bench_monitor_rejects_unknown_backends_through_the_real_cli(tmp_path):
    exe = Path(sys.executable).parent / "rollback-supervisor"
    proc = subprocess.run(
        [str(exe), "bench", "monitor", "--json", str(tmp_path / "x.json"), "--backends", "sqlite,s3"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert proc.returncode == 2
    assert "--backends: expected a comma-separated subset of sqlite, http, got 'sqlite,s3'" in proc.stderr
    assert not (tmp_path / "x.json").exists()
