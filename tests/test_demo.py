"""`make demo` stays quiet (issue 30): the install is one line per phase with its log in a file, Prefect's
first-run telemetry notice never shows, and the demo ends with commands that can be pasted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.demo_time import child_env, run_in_pty, screen_text
from supervisor.demo import LINEAGE, next_steps

REPO = Path(__file__).resolve().parents[1]
NOTICE = "collects anonymous usage data"


def test_next_steps_are_paths_relative_to_the_checkout_when_run_from_it():
    steps = dict(next_steps(REPO / ".rollback" / "demo", REPO / ".venv" / "bin", {}, REPO))
    assert steps["status"] == ".venv/bin/rollback-supervisor status --workdir .rollback/demo"
    assert steps["loss plot"] == f".rollback/demo/lineages/{LINEAGE}/loss.png"
    assert steps["MLflow UI"] == ".venv/bin/mlflow ui --backend-store-uri sqlite:///.rollback/demo/mlflow.db"
    assert steps["Prefect UI"] == (
        "PREFECT_HOME=.rollback/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true "
        ".venv/bin/prefect server start --host 127.0.0.1 --port 4200"
    )
    assert steps[""] == "then open http://127.0.0.1:4200 (Runs: the demo's flow run)"


def test_next_steps_elsewhere_are_absolute_and_name_the_users_prefect(tmp_path):
    environ = {"PREFECT_HOME": str(tmp_path / "home"), "PREFECT_API_URL": "http://10.0.0.5:4200/api"}
    steps = dict(next_steps(REPO / ".rollback" / "demo", REPO / ".venv" / "bin", environ, tmp_path))
    assert steps["status"] == f"{REPO}/.venv/bin/rollback-supervisor status --workdir {REPO}/.rollback/demo"
    assert steps["MLflow UI"].endswith(f"sqlite:///{REPO}/.rollback/demo/mlflow.db")
    assert steps["Prefect UI"] == "http://10.0.0.5:4200"  # the run is on the user's server


def _import_prefect_on_a_terminal(env: dict[str, str], first: str = "") -> list[str]:
    code, raw, _ = run_in_pty([sys.executable, "-c", f"{first}import prefect"], env, REPO, 120)
    assert code == 0, raw
    return screen_text(raw)


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """A user's shell: none of our quiet settings, a fresh Prefect home (the notice shows once per home)."""
    env = child_env(dict(os.environ))
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    return env


def _ci() -> bool:
    from prefect._internal.analytics.ci_detection import is_ci_environment

    return is_ci_environment()


@pytest.mark.e2e
def test_the_demo_keeps_prefects_first_run_notice_away(tmp_path):
    env = _clean_env(tmp_path)
    quiet = _import_prefect_on_a_terminal(
        env, "from supervisor.demo import quiet_defaults; quiet_defaults(); "
    )
    assert not any(NOTICE in line for line in quiet), quiet
    if not _ci():  # the check can see the notice: without the defaults a fresh home shows it
        shutil.rmtree(tmp_path / "prefect")
        loud = _import_prefect_on_a_terminal(env)
        assert any(NOTICE in line for line in loud), loud


@pytest.mark.e2e
def test_the_makefiles_environment_keeps_the_notice_away(tmp_path):
    printed = subprocess.run(
        ["make", "-s", "--no-print-directory", "--eval", "print-env: ; @env", "print-env"],
        cwd=REPO,
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    make_env = dict(line.split("=", 1) for line in printed.splitlines() if "=" in line)
    assert make_env["DO_NOT_TRACK"] == "true"
    make_env["PREFECT_HOME"] = str(tmp_path / "fresh")  # a first run
    assert not any(NOTICE in line for line in _import_prefect_on_a_terminal(make_env))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_failed_install_prints_its_phases_and_the_logs_end(tmp_path):
    if shutil.which("make") is None or shutil.which("python3.11") is None:
        pytest.skip("needs make and python3.11")
    env = {**_clean_env(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "no-wheels")}
    log = tmp_path / "install.log"
    out = subprocess.run(
        ["make", "--no-print-directory", f"VENV={tmp_path / 'venv'}", f"INSTALL_LOG={log}", "venv"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    lines = out.stdout.splitlines()
    assert lines[:3] == [
        f"setup: creating {tmp_path / 'venv'} with python3.11",
        f"setup: installing the project and its dependencies (log: {log})",
        f"setup: failed: {tmp_path / 'venv'}/bin/python -m pip install -e .[test]",
    ]
    assert lines[3] == f"setup: the end of {log}:"
    assert "No matching distribution found" in out.stdout  # the log's end says why
    assert len(lines) <= 4 + 25
    assert (
        "$ " in log.read_text() and "pip install --upgrade pip" in log.read_text()
    )  # each step, then its output
    assert not list((tmp_path / "venv").glob(".installed-*"))  # no stamp: the next make tries again
