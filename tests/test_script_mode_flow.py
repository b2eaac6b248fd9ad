"""Script mode through the Prefect flow and the `rollback-supervisor run` CLI (issue 16's acceptance): the
unmodified tests/scripts/train_mlp.py diverges for real, is rolled back to a version of its own `ckpt.pt` and
relaunched at a quarter of the learning rate, and the run finishes; a command whose learning rate the relaunch
arguments would change is refused with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = str(REPO / "tests" / "scripts" / "train_mlp.py")
POLICY = REPO / "tests" / "data" / "policies" / "script.yaml"
CLI = Path(sys.executable).parent / "rollback-supervisor"
#: The script's learning rate blows up once the warm-up passes ~0.65 (around iteration 100).
DIVERGING = ["--learning_rate=2.0", "--max_iters=240", "--warmup_iters=300", "--iter_time=0.01"]
THREADS = {"OMP_NUM_THREADS": "1"}


def _check_rolled_back_and_finished(rec: dict, job: Path) -> None:
    """The lineage record of a diverging run: rolled back once to a version of ckpt.pt, then finished."""
    first, second = rec["segments"]
    assert first["event"]["type"] in ("divergence", "non_finite") and first["outcome"] == "rollback"
    decision = first["decision"]
    assert decision["action"] == "rollback" and decision["target_step"] <= first["event"]["onset_step"] - 55
    # The relaunch put that version back and passed the scaled learning rate (2.0 x 0.25).
    assert second["restored"] == decision["target_id"]
    assert second["command"][-2:] == ["--init_from=resume", "--learning_rate=0.5"]
    assert second["outcome"] == "finished" and second["returncode"] == 0
    assert (rec["status"], rec["final_reason"]) == ("finished", "training finished")
    assert torch.load(job / "out" / "ckpt.pt", weights_only=True)["iter_num"] == 240


def test_the_prefect_flow_rolls_back_a_real_divergence_of_an_unmodified_script(
    prefect_harness, tmp_path, monkeypatch
):
    from flows.supervised import supervised_training

    job = tmp_path / "job"
    job.mkdir()
    monkeypatch.chdir(job)  # the flow runs the command in its own working directory
    result = supervised_training(
        command=["python", SCRIPT, *DIVERGING],
        policy=str(POLICY),
        lineage="flow",
        workdir=str(tmp_path / "w"),
        stop_grace_seconds=5,
        env=THREADS,
    )
    assert (result["status"], result["segments"]) == ("finished", 2), result
    rows = [r for r in result["timeline"] if r.get("action") == "rollback"]
    assert len(rows) == 1 and rows[0]["event"] in ("divergence", "non_finite"), result["timeline"]
    rec = json.loads((tmp_path / "w" / "lineages" / "flow" / "lineage.json").read_text())
    _check_rolled_back_and_finished(rec, job)
    assert result["final_checkpoint"] == rec["final_checkpoint"] is not None


def _cli(tmp_path: Path, lineage: str, args: list[str]) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    job = tmp_path / "job"
    job.mkdir(exist_ok=True)
    argv = [str(CLI), "run", "--policy", str(POLICY), "--lineage", lineage, "--workdir", str(tmp_path / "w")]
    env = {**os.environ, **THREADS, "PREFECT_API_URL": PREFECT_API_URL.value()}
    return subprocess.run(
        [*argv, "--stop-grace", "5", "--", sys.executable, SCRIPT, *args],
        cwd=job,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_run_cli_rolls_back_a_real_divergence_and_finishes(prefect_harness, tmp_path):
    proc = _cli(tmp_path, "cli", DIVERGING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads((tmp_path / "w" / "lineages" / "cli" / "lineage.json").read_text())
    _check_rolled_back_and_finished(rec, tmp_path / "job")


def test_the_run_cli_refuses_a_command_the_relaunch_would_change_with_exit_2(prefect_harness, tmp_path):
    proc = _cli(tmp_path, "mismatch", ["--learning_rate=0.3", "--max_iters=20"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"{POLICY}:" in proc.stderr
        and "script.relaunch.args: expected --learning_rate= rendered at lr_scale 1 to equal the command's "
        "--learning_rate=0.3, got --learning_rate=2.0"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert not (tmp_path / "job" / "out").exists()  # refused before the script ever ran
    assert "Traceback" not in proc.stderr  # refused in run's preflight, before Prefect starts
    assert len([line for line in proc.stderr.splitlines() if line.startswith("error:")]) == 1, proc.stderr
