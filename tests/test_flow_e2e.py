"""The supervised flow end to end: real Prefect (test harness), real training subprocesses, real faults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from supervisor.cli import main
from tests.flowkit import assert_same_state, live_series, load_final_state, record, run_flow

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _rows(result, **match):
    return [r for r in result["timeline"] if all(r.get(k) == v for k, v in match.items())]


def test_fault_mix_recovers_and_reports(prefect_harness, tmp_path: Path, capsys):
    result = run_flow(tmp_path, steps=110, faults="spike@50,kill@70,hw@90")
    assert result["status"] == "finished", result
    rec = record(tmp_path)

    # The spike is caught in process and rolled back without a restart: best val_loss checkpoint at or
    # before onset - lookback (51 - 20 = 31), i.e. step 20.
    spike = _rows(result, event="spike")
    assert len(spike) == 1 and spike[0]["in_process"] and spike[0]["action"] == "rollback"
    assert spike[0]["onset_step"] == 51 and spike[0]["target_step"] == 20
    assert rec["segments"][0]["in_process"][0]["pid"] == rec["segments"][0]["pid"]

    # SIGKILL with no warning: unknown_exit -> resume from the latest checkpoint of the live branch.
    kill = _rows(result, event="unknown_exit")
    assert len(kill) == 1 and kill[0]["action"] == "resume"
    # The Xid line: hardware_fault -> resume.
    hw = _rows(result, event="hardware_fault")
    assert len(hw) == 1 and hw[0]["action"] == "resume"
    assert len(rec["segments"]) == 3
    assert [s["outcome"] for s in rec["segments"]] == ["resume", "resume", "finished"]

    # The rollback really skipped batches and scaled the LR: the training side logged it.
    skip = live_series(result, "rollback.skip_batches")
    assert skip.get(20) == 7
    lr_live = live_series(result, "lr")
    client = MlflowClient(tracking_uri=result["tracking_uri"])
    lr_first = {
        m.step: m.value for m in client.get_metric_history(result["mlflow_run_id"], "lr") if m.step <= 50
    }
    # Steps 21..50 ran twice: first at the original LR (abandoned), then at half of it (live).
    lr_all = [
        (m.step, m.value, m.timestamp) for m in client.get_metric_history(result["mlflow_run_id"], "lr")
    ]
    first_21 = min((t, v) for s, v, t in lr_all if s == 21)[1]
    assert lr_live[21] == pytest.approx(first_21 * 0.5, rel=1e-12)
    assert lr_first  # read back at all

    # Recovery for real: the loss after the rollback comes back to its pre-fault level.
    loss = live_series(result, "loss")
    pre = sum(loss[s] for s in range(41, 51)) / 10
    end = sum(loss[s] for s in range(101, 111)) / 10
    assert end < pre

    # status --json and the MLflow tags agree with the flow's result.
    assert main(["status", "--workdir", str(tmp_path), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)["lineages"][0]
    assert status["status"] == result["status"] == "finished"
    assert status["final_checkpoint"] == result["final_checkpoint"]
    tags = client.get_run(result["mlflow_run_id"]).data.tags
    assert tags["rollback.status"] == "finished"
    assert tags["rollback.final_checkpoint"] == result["final_checkpoint"]
    assert int(tags["rollback.rollbacks"]) == status["rollbacks"] == 1
    assert int(tags["rollback.restarts"]) == status["restarts"] == 3
    decisions = sorted(k for k in tags if k.startswith("rollback.decision."))
    assert len(decisions) == 3
    artifacts = {a.path for a in client.list_artifacts(result["mlflow_run_id"])}
    assert {"events.json", "loss.png"} <= artifacts


def test_sigkill_resume_is_bit_identical_to_uninterrupted(prefect_harness, tmp_path: Path):
    clean = run_flow(tmp_path / "clean", steps=70)
    killed = run_flow(tmp_path / "killed", steps=70, faults="kill@53")
    assert clean["status"] == killed["status"] == "finished"
    rec = record(tmp_path / "killed")
    assert len(rec["segments"]) == 2
    assert rec["segments"][1]["restore"]["checkpoint_id"].startswith("0000000040-")
    # Same final parameters and optimizer state, bit for bit.
    a = load_final_state(
        Path(record(tmp_path / "clean")["storage"]["checkpoints"]), clean["final_checkpoint"], 70
    )
    b = load_final_state(Path(rec["storage"]["checkpoints"]), killed["final_checkpoint"], 70)
    assert_same_state(a, b)
    # Same per-step losses after the resume point.
    la, lb = live_series(clean, "loss"), live_series(killed, "loss")
    assert [la[s] for s in range(41, 71)] == [lb[s] for s in range(41, 71)]


def test_software_error_fails_and_keeps_best_checkpoint(prefect_harness, tmp_path: Path):
    result = run_flow(tmp_path, steps=80, faults="exc@45")
    assert result["status"] == "failed"
    assert "software_error" in result["reason"] and "fail" in result["reason"]
    assert result["final_checkpoint"] is not None
    rec = record(tmp_path)
    assert rec["segments"][-1]["event"]["type"] == "software_error"


def test_preemption_and_hang_each_resume_from_the_right_checkpoint(prefect_harness, tmp_path: Path):
    # term: SIGTERM to the training -> emergency checkpoint at the step it was at -> exit 75 -> preemption.
    # hang: alive but silent -> the monitor's hang detector (7 s here, 20 s in fast.yaml; start-up and
    # checkpoints get 3x, 21 s, where a segment starts and trains 30 steps in 4 s idle) -> stopped -> resume
    # latest. The hung process never reaches a step boundary to act on the SIGTERM, so it is SIGKILLed after
    # the stop grace, 2 s here (nothing to wait for).
    policy = tmp_path / "hang-7s.yaml"
    text = (Path(__file__).parent / "data" / "policies" / "fast.yaml").read_text()
    assert text.count("{type: hang, seconds: 20}") == 1
    policy.write_text(text.replace("{type: hang, seconds: 20}", "{type: hang, seconds: 7}"))
    result = run_flow(tmp_path, steps=70, faults="term@30,hang@50", policy=policy, stop_grace_seconds=2)
    assert result["status"] == "finished", result
    rec = record(tmp_path)
    events = [(s["event"] or {}).get("type") for s in rec["segments"]]
    assert events == ["preemption", "hang", None]
    assert [s["outcome"] for s in rec["segments"]] == ["resume", "resume", "finished"]
    assert rec["segments"][0]["returncode"] == 75
    # The emergency checkpoint is the resume point: no step is lost to the preemption.
    assert rec["segments"][1]["restore"]["checkpoint_id"].startswith("0000000030-")
    assert rec["segments"][1]["start_step"] == 30
    # The hang at step 50 loses the steps since the last periodic checkpoint (40), no more.
    assert rec["segments"][2]["restore"]["checkpoint_id"].startswith("0000000040-")
    assert rec["segments"][1]["signal_sent"] is not None  # we stopped the hung process ourselves
    assert rec["segments"][1]["event"]["evidence"]["timeout_seconds"] == 7  # the policy's limit applied
    hang = _rows(result, event="hang")
    assert len(hang) == 1 and hang[0]["action"] == "resume"


def test_oom_fails_per_policy_and_keeps_the_best_checkpoint(prefect_harness, tmp_path: Path):
    # keep_best by the highest val_loss: the loss falls, so "best" is the oldest checkpoint, not the latest,
    # and keeping the latest by mistake would show.
    policy = tmp_path / "keep-worst.yaml"
    text = (Path(__file__).parent / "data" / "policies" / "fast.yaml").read_text()
    policy.write_text(
        text.replace("{metric: val_loss, mode: min, count: 2}", "{metric: val_loss, mode: max, count: 2}")
    )
    result = run_flow(tmp_path / "w", steps=80, faults="oom@65", policy=policy)
    assert result["status"] == "failed"
    assert "oom" in result["reason"] and "fail" in result["reason"]
    rec = record(tmp_path / "w")
    assert rec["segments"][-1]["event"]["type"] == "oom"
    from supervisor.checkpoint import open_store

    catalog = open_store(Path(rec["storage"]["checkpoints"]))
    best, latest = catalog.best("val_loss", "max"), catalog.latest()
    assert best is not None and best.id != latest.id
    assert result["final_checkpoint"] == best.id


def test_budget_exhaustion_fails_with_clear_reason(prefect_harness, tmp_path: Path):
    policy = tmp_path / "tight.yaml"
    text = (Path(__file__).parent / "data" / "policies" / "fast.yaml").read_text()
    policy.write_text(
        text.replace("max_restarts: 6", "max_restarts: 1").replace("max_rollbacks: 3", "max_rollbacks: 1")
    )
    result = run_flow(tmp_path, steps=80, faults="kill@25,kill@45", policy=policy)
    assert result["status"] == "failed"
    assert "budget" in result["reason"] or "max_restarts" in result["reason"], result["reason"]
    assert result["final_checkpoint"] is not None
    assert len(record(tmp_path)["segments"]) == 2
