"""SLURM job states in the supervisor's words: parsing `scontrol show job -o` and jobcomp lines, and what an end means.

Pure: text in, data out. The launcher (slurm.py) runs the commands and feeds their output here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from supervisor import exitcodes

#: States in which the job has not run yet (or waits to run again after a requeue).
QUEUED = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
#: States in which the job is done: nothing of it runs any more (COMPLETING still cleans up, so it is not).
FINISHED = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "REVOKED",
        "SPECIAL_EXIT",
        "TIMEOUT",
    }
)
#: What SLURM's own verdict on a job means, as an event type; TIMEOUT and an outside CANCELLED are decided
#: separately (the policy says what a time limit is; a cancel is a stop unless we sent it).
STATE_EVENTS = {
    "PREEMPTED": "preemption",
    "NODE_FAIL": "hardware_fault",
    "BOOT_FAIL": "hardware_fault",
    "OUT_OF_MEMORY": "oom",
}
#: The event type for a job stopped from outside the supervisor (`scancel` by a user or an admin).
OUTSIDE_STOP = "stop"
_FIELD = re.compile(r"(\w+)=(\S*)")


@dataclass(frozen=True)
class JobStatus:
    """One job as `scontrol show job` (or the jobcomp file, once it is gone) describes it."""

    job_id: str
    state: str
    exit_code: int = 0  #: the batch script's exit code
    exit_signal: int = 0  #: the signal that ended the batch script, 0 if none
    derived_signal: int = 0  #: the signal that ended a job step (a task killed by SIGKILL: 9), 0 if none
    restarts: int = 0  #: how often it was requeued
    run_seconds: int | None = None
    limit_seconds: int | None = None  #: its time limit; None when unlimited
    reason: str = ""
    fields: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def queued(self) -> bool:
        return self.state in QUEUED

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    @property
    def returncode(self) -> int:
        """The exit in `Popen.returncode` terms: a signal that ended the batch script as its negative number,
        else the script's (that is, srun's) exit code.

        A task killed by signal n makes srun exit 128+n, which the log classifier reads as that signal. The
        derived exit code (the step's signal) is not used: `scontrol` shows it only with accounting on, and
        the code must not depend on where it was read.
        """
        if self.exit_signal:
            return -self.exit_signal
        return self.exit_code


def parse_duration(text: str) -> int | None:
    """SLURM's `[days-]hours:minutes:seconds` (or minutes:seconds) in seconds; None for UNLIMITED or junk."""
    days, _, clock = text.rpartition("-") if "-" in text else ("0", "", text)
    parts = clock.split(":")
    if not days.isdigit() or not parts or not all(p.isdigit() for p in parts) or len(parts) > 3:
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return int(days) * 86400 + seconds


def _pair(text: str) -> tuple[int, int]:
    code, _, sig = text.partition(":")
    return (int(code) if code.isdigit() else 0, int(sig) if sig.isdigit() else 0)


def _elapsed(fields: dict[str, str]) -> int | None:
    """Seconds from StartTime to EndTime (a jobcomp line has no RunTime)."""
    try:
        start = datetime.fromisoformat(fields["StartTime"])
        end = datetime.fromisoformat(fields["EndTime"])
    except (KeyError, ValueError):
        return None
    return int((end - start).total_seconds())


def parse_job(text: str) -> JobStatus | None:
    """A job from one record of `scontrol show job -o` or one jobcomp/filetxt line; None if it names none."""
    fields = dict(_FIELD.findall(text))
    job_id = fields.get("JobId")
    if not job_id:
        return None
    code, sig = _pair(fields.get("ExitCode", "0:0"))
    _, derived = _pair(fields.get("DerivedExitCode", "0:0"))
    limit = fields.get("TimeLimit", "")
    limit_seconds = int(limit) * 60 if limit.isdigit() else parse_duration(limit)  # jobcomp writes minutes
    restarts = fields.get("Restarts", "0")
    run_seconds = parse_duration(fields.get("RunTime", "")) if "RunTime" in fields else _elapsed(fields)
    return JobStatus(
        job_id=job_id,
        state=fields.get("JobState", "UNKNOWN").upper(),
        exit_code=code,
        exit_signal=sig,
        derived_signal=derived,
        restarts=int(restarts) if restarts.isdigit() else 0,
        run_seconds=run_seconds,
        limit_seconds=limit_seconds,
        reason=fields.get("Reason", ""),
        fields=fields,
    )


def last_jobcomp(text: str, job_id: str) -> JobStatus | None:
    """The newest jobcomp line for `job_id` (a requeued job has one per run)."""
    found = None
    for line in text.splitlines():
        if line.startswith(f"JobId={job_id} "):
            found = parse_job(line)
    return found


#: Seconds early a warning signal may seem to arrive: RunTime is whole seconds. (It often comes late, by up to
#: the ~30 s at which SLURM checks time limits, never early.)
WARNING_SLACK_SECONDS = 5


def signalled_before_limit(status: JobStatus, warning_seconds: float | None) -> bool:
    """Whether the job ended of the warning signal before its time limit: it saved and exited "preempted"
    within the last `warning_seconds` of its limit (a SIGTERM before that came from elsewhere)."""
    if warning_seconds is None or status.limit_seconds is None or status.run_seconds is None:
        return False
    return (
        status.returncode == exitcodes.EXIT_PREEMPTED
        and status.run_seconds >= status.limit_seconds - warning_seconds - WARNING_SLACK_SECONDS
    )


def job_cause(
    status: JobStatus, *, cancelled_by_us: bool, time_limit_event: str, warning_seconds: float | None = None
) -> tuple[str | None, dict[str, Any]]:
    """The event type SLURM's verdict on a finished job means, with its evidence; (None, {}) when the exit
    code and the log classifier should decide (a plain COMPLETED or FAILED).

    A time limit, whether the job hit it (TIMEOUT) or saved on the warning signal and exited before it, is
    `time_limit_event` (the policy's choice), with evidence `kind: time_limit`. A CANCELLED job we did not
    cancel was stopped from outside.
    """
    evidence: dict[str, Any] = {"slurm_job": status.job_id, "slurm_state": status.state}
    if status.state in ("TIMEOUT", "DEADLINE") or (
        status.state in ("COMPLETED", "FAILED")
        and not cancelled_by_us  # our own SIGTERM (the supervisor going away) is no time limit
        and signalled_before_limit(status, warning_seconds)
    ):
        return time_limit_event, {**evidence, "kind": "time_limit"}
    if status.state in STATE_EVENTS:
        return STATE_EVENTS[status.state], evidence
    if status.state == "CANCELLED" and not cancelled_by_us:
        return OUTSIDE_STOP, {**evidence, "kind": "outside_cancel"}
    return None, {}
