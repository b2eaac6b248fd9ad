"""The SLURM launcher against a real one-node SLURM cluster (tests/slurm_cluster.py), nothing mocked.

The real Prefect flow supervises the example workload with the policy's `launcher: {type: slurm}`: each
segment is an `sbatch` job (or a `scontrol requeue` of the last one) that runs the training with `srun`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from tests.flowkit import CHARLM, FAST_POLICY, assert_same_state, live_series, record, run_flow
from tests.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CLI = Path(sys.executable).with_name("rollback-supervisor")


def slurm_policy(tmp_path: Path, **slurm) -> Path:
    """The fast test policy, its segments run as SLURM jobs with `slurm` options."""
    data = yaml.safe_load(FAST_POLICY.read_text())
    data["launcher"] = {"type": "slurm", "slurm": {"poll_seconds": 0.25, **slurm}}
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def job_ids(rec: dict) -> list[str]:
    return [seg["slurm_job_id"] for seg in rec["segments"]]


def job_state(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(part.partition("=")[::2] for part in out.split() if "=" in part)


def test_a_killed_and_a_nan_run_finishes_through_slurm(slurm_cluster, prefect_harness, tmp_path):  # noqa: F811
    """`rollback-supervisor run` with `launcher: {type: slurm}`: a SIGKILL, then a NaN rolled back in process."""
    from prefect.settings import PREFECT_API_URL

    work = tmp_path / "w"
    argv = [
        str(CLI),
        "run",
        "--policy",
        str(slurm_policy(tmp_path)),
        "--lineage",
        "t",
        "--workdir",
        str(work),
    ]
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        # nan@41: the rollback's target is the best checkpoint 20 steps before it (step 20's), as with nan@45.
        "ROLLBACK_SUPERVISOR_FAULTS": "kill@30,nan@41",
    }
    proc = subprocess.run(
        [*argv, "--stop-grace", "10", "--", "python", CHARLM, "--steps", "50", "--eval-every", "20"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = record(work)
    assert rec["status"] == "finished"
    ids = job_ids(rec)
    assert len(ids) >= 2 and len(set(ids)) == len(ids), ids  # one sbatch job per segment
    assert all(seg["slurm_relaunch"] == "sbatch" for seg in rec["segments"])
    first = rec["segments"][0]
    # srun exits 128+9 for a SIGKILLed task; the classifier reads it as the local launcher's -9 (sigkill rule).
    assert first["returncode"] == 137 and first["event"]["evidence"]["rule"] == "sigkill", first
    assert first["decision"]["action"] == "resume"
    assert rec["segments"][1]["restore"]["checkpoint_id"]  # resumed from a checkpoint, not from scratch
    assert any(
        r["event"]["type"] == "non_finite" for seg in rec["segments"] for r in seg["in_process"]
    ) or any((seg["event"] or {}).get("type") == "non_finite" for seg in rec["segments"])
    for job in ids:
        assert job_state(job)["JobState"] in ("COMPLETED", "FAILED"), job


def test_requeue_runs_the_next_segment_in_the_same_job(slurm_cluster, prefect_harness, tmp_path):  # noqa: F811
    work = tmp_path / "w"
    # 32 steps: the requeued segment resumes from step 20's checkpoint and needs only to reach an end.
    result = run_flow(work, 32, faults="kill@30", policy=slurm_policy(tmp_path, relaunch="requeue"))
    assert result["status"] == "finished", result
    rec = record(work)
    ids = job_ids(rec)
    assert len(ids) == 2 and ids[0] == ids[1], ids
    assert [s["slurm_relaunch"] for s in rec["segments"]] == ["sbatch", "requeue"]
    assert [s["slurm_restarts"] for s in rec["segments"]] == [0, 1]
    assert rec["segments"][1]["start_step"] >= 20 and rec["segments"][1]["outcome"] == "finished"
    assert job_state(ids[0])["Restarts"] == "1"


def test_an_outside_scancel_is_recorded_as_a_stop(slurm_cluster, prefect_harness, tmp_path):  # noqa: F811
    work = tmp_path / "w"
    cancelled: list[str] = []

    def cancel_once_running() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            lineage = work / "lineages" / "t" / "lineage.json"
            if lineage.exists():
                segs = record(work)["segments"]
                job = segs[0].get("slurm_job_id") if segs else None
                if job and (work / "lineages" / "t" / "heartbeat.json").exists():
                    subprocess.run(["scancel", job], check=True)
                    cancelled.append(job)
                    return
            time.sleep(0.3)

    canceller = threading.Thread(target=cancel_once_running, daemon=True)
    canceller.start()
    result = run_flow(work, 100000, policy=slurm_policy(tmp_path))
    canceller.join(5)
    assert cancelled, "the job never ran"
    rec = record(work)
    seg = rec["segments"][0]
    assert (result["status"], len(rec["segments"])) == ("stopped", 1), result
    assert seg["outcome"] == "stopped" and seg["decision"] is None
    assert seg["event"]["type"] == "stop" and seg["event"]["source"] == "launcher"
    assert seg["event"]["evidence"]["slurm_state"] == "CANCELLED"
    assert seg["event"]["evidence"]["kind"] == "outside_cancel"
    assert job_state(cancelled[0])["JobState"] == "CANCELLED"


def test_a_job_at_its_time_limit_resumes_from_its_emergency_checkpoint(
    slurm_cluster,  # noqa: F811
    prefect_harness,
    tmp_path,
):
    """`--time=1 --signal=TERM@50`: the tasks get SIGTERM 10-20 s in, save, and the next job resumes there.

    The second job is not left to reach its own warning (up to 30 s more: slurmctld looks at time limits every
    30 s): once it has trained a step past the restore, its task is SIGKILLed (srun exits 137, the `sigkill`
    rule), a resumable end like the warning's, so the flow gives up after 2 segments all the same.
    """
    work = tmp_path / "w"
    policy = slurm_policy(tmp_path, time_limit=1, warning_seconds=50)
    killed: list[str] = []
    done = threading.Event()

    def kill_the_second_job_once_it_trains() -> None:
        lineage = work / "lineages" / "t"
        while not done.wait(0.25):
            try:
                segs = record(work)["segments"]
                beat = json.loads((lineage / "heartbeat.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                continue
            if len(segs) < 2 or not segs[1].get("slurm_job_id") or segs[0].get("last_step") is None:
                continue
            if beat.get("step", 0) > segs[0]["last_step"]:  # the second job restored and trained on
                # Its training process dies as under a `kill` fault (`scancel --signal=KILL` would not do:
                # slurmctld takes a SIGKILL of the job for a cancel, an outside stop). One node: a local PID.
                task = psutil.Process(beat["pid"])
                assert CHARLM in task.cmdline(), task.cmdline()
                task.kill()
                killed.append(segs[1]["slurm_job_id"])
                return

    killer = threading.Thread(target=kill_the_second_job_once_it_trains, daemon=True)
    killer.start()
    try:
        result = run_flow(work, 100000, policy=policy, max_segments=2)
    finally:
        done.set()
        killer.join(5)
    rec = record(work)
    first, second = rec["segments"]
    assert first["event"]["type"] == "preemption", first
    assert first["event"]["evidence"]["kind"] == "time_limit"
    assert first["returncode"] == 75 and first["signal_sent"] is None  # SLURM's warning, not our stop
    assert first["decision"]["action"] == "resume"
    # The decision and the record, not the store: by the time the second job ends, retention may have
    # deleted the first job's checkpoints (on an idle machine it runs hundreds of steps further).
    assert first["decision"]["target_step"] == first["last_step"]  # the emergency save, not a periodic one
    assert second["restore"]["checkpoint_id"] == first["decision"]["target_id"]
    assert second["start_step"] == first["last_step"]
    assert result["status"] == "failed" and "gave up after 2 segments" in result["reason"]
    # Ended by our SIGKILL, or by its own warning if that came first; resumable either way.
    assert second["decision"]["action"] == "resume", second
    assert killed or second["event"]["evidence"].get("kind") == "time_limit", second


def run_ddp_slurm(workdir: Path, policy: Path, faults: str = "") -> dict:
    """The real flow supervising the example as a SLURM job: `srun` of torchrun with 2 gloo ranks."""
    from flows.supervised import supervised_training
    from tests.test_ddp import BATCH, STEPS

    command = ["python", CHARLM, "--steps", str(STEPS), "--eval-every", "20", "--batch-size", str(BATCH)]
    return supervised_training(
        command=[*command, "--threads", "1"],
        policy=str(policy),
        lineage="ddp",
        workdir=str(workdir),
        stop_grace_seconds=15,
        env={"ROLLBACK_SUPERVISOR_FAULTS": faults} if faults else {},
    )


def start_ddp_slurm_cli(cwd: Path, workdir: Path, policy: Path) -> subprocess.Popen:
    """`rollback-supervisor run` of what run_ddp_slurm runs, with no faults, in the background."""
    from prefect.settings import PREFECT_API_URL

    from tests.test_ddp import BATCH, STEPS

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    env.pop("ROLLBACK_SUPERVISOR_FAULTS", None)
    argv = [str(CLI), "run", "--policy", str(policy), "--lineage", "ddp", "--workdir", str(workdir)]
    command = ["python", CHARLM, "--steps", str(STEPS), "--eval-every", "20", "--batch-size", str(BATCH)]
    with open(cwd / "clean.log", "wb") as log:  # a file, not a pipe: nobody reads while the faulted run runs
        return subprocess.Popen(
            [*argv, "--stop-grace", "15", "--", *command, "--threads", "1"],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def test_two_ranks_under_srun_and_torchrun_resume_bit_identically(
    slurm_cluster,  # noqa: F811
    prefect_harness,
    tmp_path,
):
    """SIGTERM then SIGKILL of rank 1 inside the job; the finish equals a clean SLURM run's, bit for bit."""
    from tests.test_ddp import STEPS, load_rank

    policy = slurm_policy(tmp_path, nproc_per_node=2)
    # The clean run is a second supervisor (the CLI) beside the faulted one: its job runs while the faulted
    # lineage's jobs start, fail and are relaunched, instead of before them all.
    clean_run = start_ddp_slurm_cli(tmp_path, tmp_path / "clean", policy)
    try:
        result = run_ddp_slurm(tmp_path / "faulted", policy, faults="term@30:rank1,kill@45:rank1")
        clean_run.wait(timeout=600)
    finally:
        if clean_run.poll() is None:
            clean_run.kill()
            clean_run.wait()
    assert clean_run.returncode == 0, (tmp_path / "clean.log").read_text(errors="replace")[-3000:]
    clean_rec = record(tmp_path / "clean", "ddp")
    assert clean_rec["status"] == "finished", clean_rec["final_reason"]
    assert result["status"] == "finished", result
    clean = {
        "final_checkpoint": clean_rec["final_checkpoint"],
        "tracking_uri": clean_rec["mlflow"]["tracking_uri"],
        "mlflow_run_id": clean_rec["mlflow"]["run_id"],
    }
    rec = record(tmp_path / "faulted", "ddp")
    termed, killed, last = rec["segments"]
    assert len({s["slurm_job_id"] for s in rec["segments"]}) == 3
    # The failed rank's exit code stands for torchrun's (as under the local torchrun launcher).
    assert termed["returncode"] == 75 and termed["event"]["type"] == "preemption", termed["event"]
    assert killed["restore"]["checkpoint_id"].startswith("0000000030-")
    assert killed["returncode"] == -9 and killed["event"]["type"] == "unknown_exit", killed["event"]
    assert last["restore"]["checkpoint_id"].startswith("0000000040-") and last["outcome"] == "finished"
    clean_dir = Path(record(tmp_path / "clean", "ddp")["storage"]["checkpoints"])
    for rank in (0, 1):
        a = load_rank(clean_dir, clean["final_checkpoint"], rank)
        b = load_rank(Path(rec["storage"]["checkpoints"]), result["final_checkpoint"], rank)
        assert_same_state(a, b)
        assert torch.equal(a["torch_rng"], b["torch_rng"]) and torch.equal(a["next_batch"], b["next_batch"])
    la, lb = live_series(clean, "loss"), live_series(result, "loss")
    assert [la[s] for s in range(21, STEPS + 1)] == [lb[s] for s in range(21, STEPS + 1)]
