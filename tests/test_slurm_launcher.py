"""The SLURM launcher's handle against the real test cluster: output, exit codes, stop, queue, reclaim."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.launcher.base import LaunchSpec
from supervisor.launcher.slurm import SlurmLauncher
from supervisor.launcher.slurm_script import SlurmOptions
from supervisor.launcher.slurm_states import last_jobcomp
from tests.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

#: A task that prints its environment and directory, then exits with its argument; SIGUSR2 exits 3.
TASK = """
import os, signal, sys, time
signal.signal(signal.SIGUSR2, lambda *a: sys.exit(3))
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("plan", os.environ.get("PLAN"), "cwd", os.getcwd(), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] in ("sleep", "ignore"):
    print("ready", flush=True)
    time.sleep(300)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def launcher(slurm_cluster, tmp_path):  # noqa: F811
    (tmp_path / "task.py").write_text(TASK)
    return SlurmLauncher(SlurmOptions(job_dir=tmp_path / "jobs", poll_seconds=0.2, warning_seconds=None))


def spec(tmp_path: Path, arg: str, name: str = "t-0") -> LaunchSpec:
    command = (sys.executable, "-u", str(tmp_path / "task.py"), arg)
    return LaunchSpec(command, env_overrides={"PLAN": "p 1"}, cwd=str(tmp_path), name=name)


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_job_streams_its_output_and_reports_its_exit_code(launcher, tmp_path, slurm_cluster):  # noqa: F811
    lines: list[tuple[str, str]] = []
    job = launcher.start(spec(tmp_path, "7"), lambda stream, line: lines.append((stream, line)))
    info = job.wait(120)
    assert (info.returncode, info.cause, info.signal_sent, info.handle_id) == (7, None, None, job.job_id)
    assert ("stdout", f"plan p 1 cwd {tmp_path}") in lines and ("stderr", "to stderr") in lines
    assert "to stderr" in info.stderr_tail
    assert job.details() == {
        "slurm_job_id": job.job_id, "slurm_job_name": "t-0", "slurm_relaunch": "sbatch", "slurm_restarts": 0,
    }  # fmt: skip
    done = last_jobcomp(
        slurm_cluster.jobcomp.read_text(), job.job_id
    )  # the record once the controller forgets
    assert (done.state, done.returncode) == ("FAILED", 7)


def test_stop_sends_the_signal_to_the_task(launcher, tmp_path):
    lines: list[str] = []
    job = launcher.start(spec(tmp_path, "sleep"), lambda stream, line: lines.append(line))
    wait_for(lambda: "ready" in lines)
    assert job.started() and job.poll() is None
    job.stop(30, sig=signal.SIGUSR2)
    info = job.wait(60)
    assert (info.returncode, info.signal_sent, info.cause) == (3, signal.SIGUSR2, None)


def test_a_job_ignoring_the_stop_is_cancelled_after_the_grace(launcher, tmp_path):
    lines: list[str] = []
    job = launcher.start(spec(tmp_path, "ignore"), lambda stream, line: lines.append(line))
    wait_for(lambda: "ready" in lines)
    job.stop(1, sig=signal.SIGUSR2)
    info = job.wait(60)  # scancel: SIGTERM (ignored), then SIGKILL after KillWait
    assert info.cause is None and info.signal_sent == signal.SIGUSR2  # our own cancel is no outside stop
    assert job.refresh().state == "CANCELLED"


def test_a_queued_job_has_not_started_and_is_cancelled_at_once(slurm_cluster, tmp_path):  # noqa: F811
    (tmp_path / "task.py").write_text(TASK)
    held = SlurmLauncher(SlurmOptions(job_dir=tmp_path / "jobs", poll_seconds=0.2, extra_sbatch=("--hold",)))
    job = held.start(spec(tmp_path, "0"))
    assert not job.started() and job.poll() is None and job.wait_exit(0.5) is None
    job.stop(30)
    info = job.wait(30)
    assert job.refresh().state == "CANCELLED" and info.cause is None


def test_reclaim_cancels_the_job_a_vanished_supervisor_left(launcher, tmp_path):
    lines: list[str] = []
    job = launcher.start(spec(tmp_path, "sleep", name="lin-4"), lambda stream, line: lines.append(line))
    wait_for(lambda: "ready" in lines)
    fresh = SlurmLauncher(launcher.options)  # the next supervisor knows the job only from the record
    fresh.reclaim({**job.details(), "slurm_job_name": "other-4", "index": 4})  # not that job: left alone
    assert job.wait_exit(1) is None
    fresh.reclaim({**job.details(), "index": 4})
    assert job.wait_exit(60) is not None and job.refresh().state == "CANCELLED"
    fresh.reclaim({**job.details(), "index": 4})  # finished: nothing to do
    fresh.reclaim({"pid": 123, "index": 0})  # a local segment's record: not ours


def test_sbatch_refusing_the_job_is_a_user_error(slurm_cluster, tmp_path):  # noqa: F811
    from supervisor.errors import UserError

    bad = SlurmLauncher(SlurmOptions(job_dir=tmp_path / "jobs", partition="nosuchpartition"))
    with pytest.raises(UserError, match="sbatch refused the job.*invalid partition"):
        bad.start(spec(tmp_path, "0"))
    assert (
        subprocess.run(["squeue", "-h", "-n", "t-0", "-t", "PD"], capture_output=True, text=True).stdout == ""
    )


def test_the_environment_is_ours_plus_the_plan_or_only_the_plan(launcher, tmp_path, monkeypatch):
    """`--export=ALL` with the supervisor's environment, or `--export=NONE` when the spec inherits nothing."""
    probe = tmp_path / "env.py"
    probe.write_text("import os; print('env', os.environ.get('PLAN'), os.environ.get('RS_PROBE'))\n")
    monkeypatch.setenv("RS_PROBE", "ours")
    for inherit, expected in ((True, "env p 1 ours"), (False, "env p 1 None")):
        lines: list[str] = []
        command = (sys.executable, "-u", str(probe))
        job = launcher.start(
            LaunchSpec(command, env_overrides={"PLAN": "p 1"}, inherit_env=inherit, name="env"),
            lambda stream, line, lines=lines: lines.append(line),
        )
        info = job.wait(60)
        assert info.returncode == 0 and expected in lines, (lines, info.stderr_tail)
