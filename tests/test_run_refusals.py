"""Issue 14, section 3: `run` refuses bad input and a held lineage before Prefect or MLflow start, in one
line with exit 2; two `run`s racing on a fresh workdir never crash in MLflow's table creation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = Path(sys.executable).with_name("rollback-supervisor")
POLICY = """\
version: 1
name: once
checkpoint: {every_steps: 10, keep_last: 2, async: false}
monitor: {poll_seconds: 0.2, detectors: [{type: hang, seconds: 600}]}
rules:
  - when: [software_error, unknown_exit]
    action: fail
"""
WORK = [sys.executable, "-c", "import time; time.sleep(2.5); print('done')"]


def _argv(workdir: Path, policy: Path, lineage: str, *cmd: str) -> list[str]:
    return [
        str(CLI),
        "run",
        "--policy",
        str(policy),
        "--lineage",
        lineage,
        "--workdir",
        str(workdir),
        "--",
        *cmd,
    ]


def _refusal(argv: list[str], cwd: Path) -> tuple[str, float]:
    started = time.monotonic()
    out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    return out.stderr.strip(), took


@pytest.mark.parametrize("name", ["../x", "/abs", "a b", "x" * 300])
def test_a_bad_lineage_is_refused_before_anything_starts(tmp_path: Path, name: str):
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    line, took = _refusal(_argv(tmp_path / "w", policy, name, *WORK), tmp_path)
    assert line.startswith("error: --lineage: expected 1-100 characters")
    assert took < 10  # no Prefect server start-up (13-18 s) happened first
    assert not (tmp_path / "w" / "prefect").exists() and not (tmp_path / "w" / "mlflow.db").exists()


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A real read-only file system (a tmpfs mounted ro); root ignores permission bits, so chmod would not do."""
    target = tmp_path / "ro"
    target.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_a_read_only_workdir_is_refused_in_one_line(tmp_path: Path, read_only_dir: Path):
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    line, _ = _refusal(_argv(read_only_dir / "w", policy, "ok", *WORK), tmp_path)
    assert "Read-only file system" in line and "--workdir" in line


@pytest.mark.e2e
@pytest.mark.slow
def test_runs_racing_on_a_fresh_workdir(prefect_harness, tmp_path: Path):
    """Two runs of one lineage and one of another, started at once on a new workdir: one of the pair refuses
    in one line naming the holder, the other two run, and nobody dies in MLflow's store creation."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY)
    work = tmp_path / "fresh"
    procs = [
        subprocess.Popen(_argv(work, policy, lineage, *WORK), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for lineage in ("x", "x", "y")
    ]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes[:2]) == [0, 2], outs
    assert codes[2] == 0, outs[2]
    loser = outs[codes.index(2)][1]
    assert "error: lineage at" in loser and "is driven by" in loser and len(loser.strip().splitlines()) == 1
    for _, err in outs:
        assert "Traceback" not in err and "already exists" not in err, err
