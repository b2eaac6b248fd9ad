"""`bench rollback --integration`: the summary arithmetic, option errors, and a tiny run of each integration
through the real CLI (real Lightning and HF Trainer processes, real checkpoints, the framework's own resume)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.integration import summarize
from benchmarks.integration_child import AT_STEP, fault_spec
from supervisor.cli import main
from tests.conftest import REPO

PREP = {
    "checkpoint_id": "0000000010-000001",
    "checkpoint_step": 10,
    "checkpoint_bytes": 4000,
    "framework_checkpoint": "/w/resume/lightning/step=10.ckpt",
    "framework_checkpoint_bytes": 4100,
    "params": 1000,
    "steps_s": [1.0, 3.0, 1.0],
}
INPROC = {
    "anomalies": [
        {
            "total_s": 1.5,
            "handler_s": 0.5,
            "step_s": 1.0,
            "restore_s": 0.25,
            "tier": "memory",
            "target_step": 2,
        },
        {
            "total_s": 1.1,
            "handler_s": 0.1,
            "step_s": 1.0,
            "restore_s": 0.05,
            "tier": "memory",
            "target_step": 4,
        },
        {
            "total_s": 1.2,
            "handler_s": 0.2,
            "step_s": 1.0,
            "restore_s": 0.1,
            "tier": "memory",
            "target_step": 6,
        },
    ],
    "steps_s": [1.0, 1.0],
}


def fresh(totals: tuple[float, ...], step: float, ours: bool) -> list[dict[str, float]]:
    phases = {"interpreter_s": 0.1, "import_s": 3.0, "build_s": 0.5, "setup_s": 0.5, "loop_start_s": 0.1}
    rows = [{**phases, "total_s": t, "ready_s": t - step, "step_s": step} for t in totals]
    return [{**r, "restore_s": 0.2} for r in rows] if ours else rows


def test_summary_reports_medians_ratios_and_the_target_both_ways():
    got = summarize(
        "lightning",
        PREP,
        INPROC,
        fresh((9.0, 13.0, 12.0), 2.0, ours=True),
        fresh((10.0, 12.0, 11.0), 1.0, ours=False),
        size="tiny",
        reps=3,
        batch_size=None,
        threads=None,
        load_start=0.5,
    )
    assert (got["in_process_s"], got["relaunch_s"], got["framework_resume_s"]) == (1.2, 12.0, 11.0)
    assert got["excluding_step"] == {"in_process_s": 0.2, "relaunch_s": 10.0, "framework_resume_s": 10.0}
    assert got["step_s"] == 1.0  # the prepare and in-process runs' steps together
    assert got["targets"]["relaunch_s/framework_resume_s"] == {
        "value": pytest.approx(12 / 11),
        "target": 1.0,
        "met": False,
    }
    assert got["targets"]["relaunch_s/framework_resume_s (step excluded)"] == {
        "value": pytest.approx(1.0),
        "target": 1.0,
        "met": True,
    }
    assert got["ratios"] == {
        "in_process_s/framework_resume_s": pytest.approx(1.2 / 11),
        "in_process_s/framework_resume_s (step excluded)": pytest.approx(0.02),
    }
    assert got["in_process"]["tiers"] == ["memory"] * 3 and got["in_process"]["restore_s"] == 0.1
    assert (got["relaunch"]["restore_s"], got["framework_resume"]["import_s"]) == (0.2, 3.0)
    assert "restore_s" not in got["framework_resume"]  # its restore is inside its set-up and loop start
    assert got["framework_resume"]["checkpoint"] == "step=10.ckpt"
    assert got["machine"]["load_average_1m_start"] == 0.5


def test_without_an_in_process_path_the_figures_are_null_with_the_reason():
    got = summarize(
        "transformers",
        PREP,
        None,
        fresh((4.0,), 0.5, ours=True),
        fresh((5.0,), 0.5, ours=False),
        size="tiny",
        reps=1,
        batch_size=None,
        threads=None,
        load_start=0.0,
    )
    assert got["in_process_s"] is None and got["excluding_step"]["in_process_s"] is None
    assert set(got["ratios"].values()) == {None}
    assert got["in_process"]["available"] is False and "exits 76" in got["in_process"]["reason"]
    assert got["targets"]["relaunch_s/framework_resume_s"]["met"] is True
    assert any("in_process_s is null" in note for note in got["notes"])


def test_each_anomaly_fires_after_the_previous_rollback():
    assert fault_spec(1) == "nan@3"
    assert fault_spec(3) == "nan@3,nan@5,nan@7"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--integration", "script", "--size", "tiny"], "--size tiny with --integration script"),
        (
            ["--integration", "keras"],
            "--integration: expected one of lightning, transformers, script, got 'keras'",
        ),
        (["--integration", "lightning", "--size", "1T"], "--size: expected one of tiny, small, 10M, 100M"),
        (["--integration", "transformers", "--device", "cuda"], "--device cuda with --integration"),
        (["--integration", "script", "--world-size", "2"], "--world-size 2 with --integration script"),
        (["--world-size", "2"], "--world-size: only with --integration lightning or transformers"),
    ],
)
def test_option_mistakes_are_user_errors(argv: list[str], message: str, capsys, tmp_path: Path):
    assert main(["bench", "rollback", *argv, "--json", str(tmp_path / "x.json")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def positive_figures(tree: Any, path: str = "") -> list[str]:
    """The path of every figure (a key ending in _s or _bytes, or params) that is not a positive number."""
    bad = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            where = f"{path}.{key}" if path else key
            if isinstance(value, dict | list):
                bad += positive_figures(value, where)
            elif key.endswith(("_s", "_bytes")) or key in ("params", "value"):
                if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                    bad.append(f"{where}={value!r}")
    elif isinstance(tree, list):
        for i, item in enumerate(tree):
            bad += positive_figures(item, f"{path}[{i}]")
    return bad


def test_at_world_size_2_lightning_runs_ddp_over_a_plain_loader_and_the_trainer_as_it_is():
    from benchmarks.integration_child import Workload

    lightning = Workload("lightning", "tiny", world_size=2).example_args()
    assert lightning[-5:] == ["--devices", "2", "--strategy", "ddp", "--plain-loader"]
    assert "--devices" not in Workload("lightning", "tiny").example_args()
    assert Workload("transformers", "tiny", world_size=2).example_args() == ["--steps", "1000", "--cpu"]


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("integration", "world_size"), [("lightning", 1), ("transformers", 2), ("script", 1)]
)
def test_tiny_run_through_the_cli_writes_every_key(integration: str, world_size: int, tmp_path: Path):
    """The HF Trainer's case runs on 2 torchrun ranks (DDP): our relaunch and its own resume of the group."""
    out = tmp_path / f"rollback-integration-{integration}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    exe = Path(sys.executable).with_name("rollback-supervisor")
    size = [] if integration == "script" else ["--size", "tiny"]  # the script runs as it is
    cmd = [str(exe), "bench", "rollback", "--integration", integration, *size, "--reps", "1"]
    cmd += ["--world-size", str(world_size)]
    cmd += ["--json", str(out), "--workdir", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    keys = {
        "integration",
        "example",
        "params",
        "state_bytes",
        "framework_checkpoint_bytes",
        "resumed_at_step",
        "in_process_s",
        "relaunch_s",
        "framework_resume_s",
        "step_s",
        "step_included",
        "excluding_step",
        "targets",
        "ratios",
        "in_process",
        "relaunch",
        "framework_resume",
        "machine",
        "notes",
    }
    assert keys <= result.keys()
    assert result["integration"] == integration and result["resumed_at_step"] == AT_STEP
    assert result["world_size"] == world_size
    if integration != "script":  # the relaunch in a parked standby (at world size 2 a parked torchrun agent)
        assert result["relaunch_standby_s"] > 0 and len(result["relaunch_standby"]["samples"]) == 1
    assert set(result["targets"]) == {
        "relaunch_s/framework_resume_s",
        "relaunch_s/framework_resume_s (step excluded)",
    }
    assert set(result["excluding_step"]) == {"in_process_s", "relaunch_s", "framework_resume_s"}
    assert result["relaunch"]["checkpoint_id"].startswith(f"{AT_STEP:010d}-")
    assert len(result["relaunch"]["samples"]) == len(result["framework_resume"]["samples"]) == 1
    assert "load_average_1m_start" in result["machine"]
    if integration == "lightning":
        assert result["in_process"]["tiers"] == ["memory"]  # rolled back from the memory ring
        assert result["ratios"]["in_process_s/framework_resume_s"] > 0
    else:  # no in-process path: its figures are null, and the rest must be positive
        assert result["in_process_s"] is None and result["excluding_step"]["in_process_s"] is None
        assert set(result["ratios"].values()) == {None}
        assert result["in_process"] == {"available": False, "reason": result["in_process"]["reason"]}
        del result["in_process_s"], result["excluding_step"]["in_process_s"], result["ratios"]
    if integration == "script":  # read from outside: its file is never unpickled, so no parameter count
        assert result["params"] is None and result["size"] is None
        assert result["relaunch"]["put_back_s"] > 0  # the supervisor's part: our version put back in place
        del result["params"]
    assert positive_figures(result) == []


def test_the_figure_walk_names_every_figure_that_is_not_a_positive_number():
    tree = {
        "relaunch_s": 1.0,
        "params": 0,
        "relaunch": {"samples": [{"step_s": -0.1, "setup_s": 0.2}], "restore_s": None},
        "targets": {"a/b": {"value": "1", "target": 1.0, "met": True}},
        "state_bytes": True,
        "reps": 0,  # not a figure
    }
    assert positive_figures(tree) == [
        "params=0",
        "relaunch.samples[0].step_s=-0.1",
        "relaunch.restore_s=None",
        "targets.a/b.value='1'",
        "state_bytes=True",
    ]
