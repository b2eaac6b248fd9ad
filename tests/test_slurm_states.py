"""SLURM job states in the supervisor's words (pure): parsing scontrol and jobcomp records, and what an end means."""

from __future__ import annotations

import pytest

from supervisor.launcher.slurm_states import (
    JobStatus,
    job_cause,
    last_jobcomp,
    parse_duration,
    parse_job,
    signalled_before_limit,
)

#: `scontrol show job -o 1` on the test cluster, for a job whose task was SIGKILLed (accounting off).
SCONTROL = (
    "JobId=1 JobName=job.sh UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901759 Nice=0 "
    "Account=(null) QOS=(null) JobState=FAILED Reason=NonZeroExitCode Dependency=(null) Requeue=1 Restarts=0 "
    "BatchFlag=1 Reboot=0 ExitCode=137:0 RunTime=00:00:01 TimeLimit=365-00:00:00 TimeMin=N/A "
    "SubmitTime=2026-11-24T21:35:56 StartTime=2026-11-24T21:35:56 EndTime=2026-11-24T21:35:57 "
    "Command=/tmp/j/job.sh kill WorkDir=/tmp/j StdErr=/tmp/j/out-1.txt StdOut=/tmp/j/out-1.txt Power= "
)
#: Two jobcomp/filetxt lines of a requeued job (one per run), as the test cluster writes them.
JOBCOMP = (
    "JobId=5 UserId=root(0) GroupId=root(0) Name=t-0 JobState=FAILED Partition=debug TimeLimit=1 "
    "StartTime=2026-11-24T21:30:00 EndTime=2026-11-24T21:30:18 NodeList=localhost DerivedExitCode=0:9 "
    "ExitCode=137:0 \n"
    "JobId=7 UserId=root(0) GroupId=root(0) Name=x JobState=COMPLETED Partition=debug TimeLimit=525600 "
    "StartTime=2026-11-24T21:31:00 EndTime=2026-11-24T21:31:02 DerivedExitCode=0:0 ExitCode=0:0 \n"
    "JobId=5 UserId=root(0) GroupId=root(0) Name=t-0 JobState=TIMEOUT Partition=debug TimeLimit=1 "
    "StartTime=2026-11-24T21:32:00 EndTime=2026-11-24T21:33:31 NodeList=localhost DerivedExitCode=0:0 "
    "ExitCode=0:15 \n"
)


def test_a_scontrol_record_parses():
    job = parse_job(SCONTROL)
    assert (job.job_id, job.state, job.exit_code, job.exit_signal, job.restarts) == ("1", "FAILED", 137, 0, 0)
    assert (job.run_seconds, job.limit_seconds, job.reason) == (1, 365 * 86400, "NonZeroExitCode")
    assert job.finished and not job.queued and job.returncode == 137
    assert job.fields["JobName"] == "job.sh"


def test_the_newest_jobcomp_line_of_a_job_wins():
    job = last_jobcomp(JOBCOMP, "5")
    assert (job.state, job.exit_signal, job.returncode, job.limit_seconds, job.run_seconds) == (
        "TIMEOUT",
        15,
        -15,
        60,
        91,
    )
    assert last_jobcomp(JOBCOMP, "7").returncode == 0
    assert last_jobcomp(JOBCOMP, "50") is None  # "JobId=5 " must not match job 50
    assert parse_job("no job here") is None


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("00:00:18", 18), ("1:02", 62), ("2-03:00:00", 183600), ("365-00:00:00", 31536000), ("UNLIMITED", None),
     ("", None), ("1:2:3:4", None), ("x-1:00", None)],
)  # fmt: skip
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def status(state: str, code: int = 0, sig: int = 0, run: int | None = None, limit: int | None = None):
    return JobStatus("9", state, exit_code=code, exit_signal=sig, run_seconds=run, limit_seconds=limit)


CAUSES = [
    # (state, exit code, run s, limit s, cancelled by us) -> cause, kind
    ("PREEMPTED", 75, 30, None, False, "preemption", None),
    ("NODE_FAIL", 0, 30, None, False, "hardware_fault", None),
    ("BOOT_FAIL", 0, 0, None, False, "hardware_fault", None),
    ("OUT_OF_MEMORY", 0, 30, None, False, "oom", None),
    ("TIMEOUT", 0, 60, 60, False, "preemption", "time_limit"),
    ("DEADLINE", 0, 60, 60, False, "preemption", "time_limit"),
    ("FAILED", 75, 18, 60, False, "preemption", "time_limit"),  # saved on the warning at -50 s, exited
    ("FAILED", 75, 18, 60, True, None, None),  # our own SIGTERM inside the window: no time limit
    ("FAILED", 75, 3, 60, False, None, None),  # a SIGTERM long before the warning: the classifier's
    ("FAILED", 1, 18, 60, False, None, None),  # a crash inside the warning window is a crash
    ("FAILED", 75, 18, None, False, None, None),  # no time limit: no time-limit kind
    ("CANCELLED", 75, 5, None, False, "stop", "outside_cancel"),
    ("CANCELLED", 3, 5, None, True, None, None),  # our own stop
    ("COMPLETED", 0, 5, 60, False, None, None),
    ("FAILED", 137, 5, None, False, None, None),
]


@pytest.mark.parametrize(("state", "code", "run", "limit", "ours", "cause", "kind"), CAUSES)
def test_what_a_job_end_means(state, code, run, limit, ours, cause, kind):
    found, evidence = job_cause(
        status(state, code, run=run, limit=limit),
        cancelled_by_us=ours,
        time_limit_event="preemption",
        warning_seconds=50,
    )
    assert found == cause
    assert evidence.get("kind") == kind
    if cause is not None:
        assert evidence["slurm_state"] == state and evidence["slurm_job"] == "9"


def test_the_policy_says_what_a_time_limit_is():
    found, evidence = job_cause(
        status("TIMEOUT", 0, 15, run=60, limit=60), cancelled_by_us=False, time_limit_event="stop"
    )
    assert (found, evidence["kind"]) == ("stop", "time_limit")


def test_the_warning_window():
    assert signalled_before_limit(status("FAILED", 75, run=5, limit=60), 50)  # within RunTime's slack
    assert not signalled_before_limit(status("FAILED", 75, run=4, limit=60), 50)
    assert not signalled_before_limit(status("FAILED", 75, run=59, limit=60), None)  # no warning asked for


@pytest.mark.parametrize(
    ("state", "queued", "finished"),
    [("PENDING", True, False), ("REQUEUED", True, False), ("CONFIGURING", True, False), ("RUNNING", False, False),
     ("COMPLETING", False, False), ("SUSPENDED", False, False), ("COMPLETED", False, True),
     ("CANCELLED", False, True), ("TIMEOUT", False, True)],
)  # fmt: skip
def test_queued_and_finished_states(state, queued, finished):
    assert (status(state).queued, status(state).finished) == (queued, finished)
