"""The SLURM launcher against a real one-node SLURM cluster (tests/slurm_cluster.py), nothing mocked.

The real Prefect flow supervises the example workload with the policy's `launcher: {type: slurm}`: each
segment is an `sbatch` job (or a `scontrol requeue` of the last one) that runs the training with `srun`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

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
    data["launcher"] = {"type": "slurm", "slurm": {"poll_seconds": 0.5, **slurm}}
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
        "ROLLBACK_SUPERVISOR_FAULTS": "kill@30,nan@45",
    }
    proc = subprocess.run(
        [*argv, "--stop-grace", "10", "--", "python", CHARLM, "--steps", "60", "--eval-every", "20"],
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
    result = run_flow(work, 40, faults="kill@30", policy=slurm_policy(tmp_path, relaunch="requeue"))
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
    """`--time=1 --signal=TERM@50`: the tasks get SIGTERM 10-20 s in, save, and the next job resumes there."""
    work = tmp_path / "w"
    policy = slurm_policy(tmp_path, time_limit=1, warning_seconds=50)
    result = run_flow(work, 100000, policy=policy, max_segments=2)
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


def test_two_ranks_under_srun_and_torchrun_resume_bit_identically(
    slurm_cluster,  # noqa: F811
    prefect_harness,
    tmp_path,
):
    """SIGTERM then SIGKILL of rank 1 inside the job; the finish equals a clean SLURM run's, bit for bit."""
    from tests.test_ddp import STEPS, load_rank

    policy = slurm_policy(tmp_path, nproc_per_node=2)
    clean = run_ddp_slurm(tmp_path / "clean", policy)
    assert clean["status"] == "finished", clean
    result = run_ddp_slurm(tmp_path / "faulted", policy, faults="term@30:rank1,kill@45:rank1")
    assert result["status"] == "finished", result
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
