"""The SLURM launcher: each segment a batch job (`sbatch`, or `scontrol requeue` of the last one), watched
through `scontrol show job`, its output files followed, stopped with `scancel`.

Accounting may be off: a job's state and exit code come from `scontrol show job` while the controller
remembers it (`MinJobAge`), then from the jobcomp file (`JobCompType=jobcomp/filetxt`) if there is one.
The job's own verdict (PREEMPTED, NODE_FAIL, TIMEOUT, OUT_OF_MEMORY, a CANCELLED we did not send) becomes
`ExitInfo.cause`; any other end is left to the exit code and the log classifier (slurm_states.py).
Everything the job touches (the job directory, the lineage's plan, heartbeat and checkpoints) must be on
storage the compute nodes share with the supervisor.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.launcher_schema import LauncherConfig, SlurmSpec
from supervisor.errors import SupervisorError, UserError
from supervisor.launcher.base import ExitInfo, Launcher, LaunchSpec, OnLine
from supervisor.launcher.local import environment
from supervisor.launcher.slurm_output import OutputFollower, size_of
from supervisor.launcher.slurm_script import SlurmOptions, batch_script, sbatch_command, segment_file
from supervisor.launcher.slurm_states import JobStatus, job_cause, last_jobcomp, parse_job
from supervisor.launcher.torchrun import TorchrunLauncher, TorchrunOptions, root_cause_exitcode
from supervisor.lineage.exclusions import HostPool

log = logging.getLogger("rollback_supervisor.launcher")

#: How long one SLURM command may take before the controller counts as unreachable.
COMMAND_TIMEOUT_SECONDS = 60.0


class SlurmError(SupervisorError):
    """A SLURM command failed (the controller is unreachable, or it refused a request)."""


def slurm(
    args: list[str], *, env: Mapping[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    """Run one SLURM client command; SlurmError when it is missing or, with `check`, fails."""
    exe = shutil.which(args[0])
    if exe is None:
        raise UserError(
            f"slurm launcher: `{args[0]}` is not on PATH; run the supervisor where the SLURM client commands "
            "are installed (a login node), or choose another launcher"
        )
    done = subprocess.run(
        [exe, *args[1:]],
        env=dict(env) if env is not None else None,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_SECONDS,
    )
    if check and done.returncode != 0:
        raise SlurmError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return done


@dataclass
class _Submitted:
    """A job this launcher submitted: its id, and the segment file a requeue rewrites."""

    job_id: str
    name: str
    segment_file: Path
    exclude_hosts: tuple[str, ...] = ()


class SlurmLauncher:
    """Starts each segment as a SLURM batch job (see module docstring); one per lineage runner."""

    def __init__(self, options: SlurmOptions, *, clock: Callable[[], float] = time.monotonic):
        self.options = options
        self.clock = clock
        self._last: _Submitted | None = None  # the previous segment's job, which a requeue runs again
        self._jobcomp: Path | None | bool = False  # False: not looked up yet

    def command(self, user_command: tuple[str, ...]) -> tuple[str, ...]:
        """What each task runs: the command, or torchrun around it for several processes per node."""
        if self.options.nproc_per_node == 1:
            return user_command
        torchrun = TorchrunLauncher(TorchrunOptions(nproc_per_node=self.options.nproc_per_node))
        return torchrun.command(user_command)

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> SlurmJob:
        job_dir = self.options.job_dir.resolve()
        job_dir.mkdir(parents=True, exist_ok=True)
        command = self.command(spec.command)
        if self.options.relaunch == "requeue" and self._last is not None:
            if self._last.exclude_hosts == spec.exclude_hosts:
                job = self._requeue(self._last, spec, command, on_line)
                if job is not None:
                    return job
            else:  # a requeued job keeps its node constraints: only a new job can avoid the new hosts
                log.warning(
                    "SLURM job %s is not requeued: the lineage now excludes %s; submitting a new job",
                    self._last.job_id,
                    ",".join(spec.exclude_hosts) or "no host",
                )
        token = uuid.uuid4().hex[:12]
        seg_file = job_dir / f"{token}.segment.sh"
        seg_file.write_text(segment_file(spec, command))
        name = spec.name or f"rollback-{token}"
        script = job_dir / f"{token}.sbatch"
        script.write_text(batch_script(self.options, name, seg_file))
        env = environment(spec)
        env = dict(env) if env is not None else dict(os.environ)
        if not spec.inherit_env and "SLURM_CONF" in os.environ:  # the client still needs to find its cluster
            env.setdefault("SLURM_CONF", os.environ["SLURM_CONF"])
        submit = sbatch_command(script, inherit_env=spec.inherit_env, exclude_hosts=spec.exclude_hosts)
        if spec.exclude_hosts:
            log.warning("SLURM job %s: excluding %s (the lineage's excluded hosts)", name,
                        ",".join(spec.exclude_hosts))  # fmt: skip
        done = slurm(submit, env=env, check=False)
        if done.returncode != 0:
            raise UserError(
                f"slurm launcher: sbatch refused the job ({done.stderr.strip()[-300:]}); check the policy's "
                f"launcher.slurm options (script: {script})"
            )
        job_id = done.stdout.strip().split(";")[0]
        self._last = _Submitted(job_id, name, seg_file, spec.exclude_hosts)
        log.info("submitted SLURM job %s (%s): %s", job_id, name, " ".join(submit))
        return SlurmJob(self, job_id, name=name, relaunch="sbatch", on_line=on_line, offsets={})

    def _requeue(
        self, last: _Submitted, spec: LaunchSpec, command: tuple[str, ...], on_line: OnLine | None
    ) -> SlurmJob | None:
        """Run the previous job again with this segment's file; None (a new sbatch) if SLURM refuses."""
        paths = self.output_paths(last.job_id)
        offsets = {name: size_of(path) for name, path in paths.items()}
        last.segment_file.write_text(segment_file(spec, command))
        done = slurm(["scontrol", "requeue", last.job_id], check=False)
        if done.returncode != 0:
            log.warning(
                "scontrol requeue %s failed (%s); submitting a new job instead",
                last.job_id,
                done.stderr.strip(),
            )
            return None
        log.info("requeued SLURM job %s for the next segment", last.job_id)
        return SlurmJob(
            self, last.job_id, name=last.name, relaunch="requeue", on_line=on_line, offsets=offsets
        )

    def host_pool(self) -> HostPool:
        """The nodes of the job's partition (`sinfo`; the default one without `partition`), of which a segment
        needs `nodes`; a node's hostname, where it differs from its name, is an alias of it."""
        args = ["sinfo", "--noheader", "--Node", "--format=%N %n %P"]
        if self.options.partition:
            args.append(f"--partition={self.options.partition}")
        rows = [row for row in (line.split() for line in slurm(args).stdout.splitlines()) if len(row) == 3]
        where = f"partition {self.options.partition}" if self.options.partition else "the cluster"
        default = [row for row in rows if row[2].endswith("*")]  # sinfo marks the default partition with *
        if not self.options.partition and default:
            rows, where = default, f"partition {default[0][2].rstrip('*')} (the default)"
        nodes = tuple(dict.fromkeys(name for name, _, _ in rows))
        aliases = {host: name for name, host, _ in rows if host != name}
        return HostPool(self.options.nodes, nodes, f"{where} has {len(nodes)} node(s)", aliases)

    def hostnames(self, nodelist: str) -> tuple[str, ...]:
        """A job's NodeList (`gpu[01-03]`) as node names (`scontrol show hostnames`); none when unassigned."""
        if not nodelist or nodelist in ("(null)", "None", "None assigned"):
            return ()
        done = slurm(["scontrol", "show", "hostnames", nodelist], check=False)
        if done.returncode != 0:
            return tuple(nodelist.split(","))
        return tuple(line.strip() for line in done.stdout.splitlines() if line.strip())

    def output_paths(self, job_id: str) -> dict[str, Path]:
        job_dir = self.options.job_dir.resolve()
        return {"stdout": job_dir / f"{job_id}.out", "stderr": job_dir / f"{job_id}.err"}

    def status(self, job_id: str) -> JobStatus | None:
        """The job's state: from the controller, else (purged) from the jobcomp file; None if neither knows it."""
        done = slurm(["scontrol", "show", "job", "-o", job_id], check=False)
        if done.returncode == 0:
            found = parse_job(done.stdout)
            if found is not None:
                return found
        elif "Invalid job id" not in done.stderr:
            raise SlurmError(f"`scontrol show job {job_id}` failed: {done.stderr.strip()[-300:]}")
        jobcomp = self.jobcomp_path()
        if jobcomp is not None and jobcomp.is_file():
            return last_jobcomp(jobcomp.read_text(errors="replace"), job_id)
        return None

    def jobcomp_path(self) -> Path | None:
        """Where the cluster writes finished jobs (jobcomp/filetxt), if it does."""
        if self._jobcomp is False:
            self._jobcomp = None
            done = slurm(["scontrol", "show", "config"], check=False)
            conf = dict(
                (k.strip(), v.strip())
                for k, _, v in (line.partition("=") for line in done.stdout.splitlines())
            )
            if conf.get("JobCompType") == "jobcomp/filetxt" and conf.get("JobCompLoc"):
                self._jobcomp = Path(conf["JobCompLoc"])
        return self._jobcomp  # type: ignore[return-value]

    def reclaim(self, details: Mapping[str, Any]) -> None:
        """Cancel the job a vanished supervisor left, if it still runs under the recorded name."""
        job_id, name = details.get("slurm_job_id"), details.get("slurm_job_name")
        if not job_id:
            return
        status = self.status(str(job_id))
        if status is None or status.finished:
            log.info(
                "segment %s: SLURM job %s is gone or finished; nothing to cancel",
                details.get("index"),
                job_id,
            )
            return
        if name and status.fields.get("JobName") not in (None, name):
            log.info(
                "segment %s: SLURM job %s is not %s any more; left alone", details.get("index"), job_id, name
            )
            return
        slurm(["scancel", str(job_id)], check=False)
        log.warning("cancelled stale SLURM job %s of segment %s", job_id, details.get("index"))


def _ignore(stream: str, line: str) -> None:
    """The output sink when nobody listens."""


class SlurmJob:
    """One segment as a SLURM job. `stop()` may be called from any thread; everything else from the owner."""

    def __init__(
        self,
        launcher: SlurmLauncher,
        job_id: str,
        *,
        name: str,
        relaunch: str,
        on_line: OnLine | None,
        offsets: dict[str, int],
    ):
        self.launcher = launcher
        self.job_id = job_id
        self.name = name
        self.relaunch = relaunch
        self.options = launcher.options
        self._t0 = launcher.clock()
        self._signal_sent: int | None = None
        self._cancelled = False  # we sent a scancel: a CANCELLED state is ours, not an outside stop
        self._status: JobStatus | None = None
        self._restarts = 0
        paths = launcher.output_paths(job_id)
        self._output = OutputFollower(
            paths, {n: offsets.get(n, 0) for n in paths}, on_line or _ignore
        ).start()
        if relaunch == "requeue":
            self._restarts = (launcher.status(job_id) or JobStatus(job_id, "PENDING")).restarts

    @property
    def handle_id(self) -> str:
        return self.job_id

    def details(self) -> dict[str, Any]:
        return {
            "slurm_job_id": self.job_id,
            "slurm_job_name": self.name,
            "slurm_relaunch": self.relaunch,
            "slurm_restarts": self._restarts,
        }

    def refresh(self) -> JobStatus:
        """Read the job's state; while the controller does not answer, the last state read stands."""
        try:
            status = self.launcher.status(self.job_id)
        except (SlurmError, subprocess.TimeoutExpired) as exc:
            log.warning("SLURM job %s: cannot read its state (%s); asking again", self.job_id, exc)
            return self._status or JobStatus(self.job_id, "PENDING")
        if status is None:  # neither the controller nor a jobcomp file knows it any more
            status = JobStatus(
                self.job_id, "VANISHED", exit_code=1, reason="purged before it was seen to end"
            )
        self._status = status
        return status

    def started(self) -> bool:
        status = self.refresh()
        return not status.queued

    def poll(self) -> int | None:
        status = self.refresh()
        if status.finished or status.state == "VANISHED":
            return status.returncode
        return None

    def wait_exit(self, timeout: float) -> int | None:
        deadline = self.launcher.clock() + timeout
        while True:
            code = self.poll()
            if code is not None or self.launcher.clock() >= deadline:
                return code
            time.sleep(min(self.options.poll_seconds, max(0.0, deadline - self.launcher.clock())))

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        """Signal the job's steps with `sig`, wait up to `grace_seconds`, then cancel the job.

        A job still queued is cancelled at once. `scancel` itself gives the tasks SIGTERM and, after the
        cluster's KillWait, SIGKILL.
        """
        if self.poll() is not None:
            return
        self._signal_sent, self._cancelled = sig, True
        name = signal.Signals(sig).name.removeprefix("SIG")
        if self._status is not None and self._status.queued:
            log.info("cancelling queued SLURM job %s", self.job_id)
            slurm(["scancel", self.job_id], check=False)
        else:
            log.info("stopping SLURM job %s with SIG%s (grace %.0fs)", self.job_id, name, grace_seconds)
            slurm(["scancel", f"--signal={name}", self.job_id], check=False)
            if self.wait_exit(grace_seconds) is None:
                log.warning(
                    "SLURM job %s ignored SIG%s for %.0fs; cancelling it", self.job_id, name, grace_seconds
                )
                slurm(["scancel", self.job_id], check=False)

    def kill(self) -> None:
        """Cancel the job now, recorded as sent by us."""
        self._signal_sent, self._cancelled = signal.SIGKILL, True
        slurm(["scancel", "--signal=KILL", "--full", self.job_id], check=False)
        slurm(["scancel", self.job_id], check=False)

    def wait(self, timeout: float | None = None) -> ExitInfo:
        deadline = None if timeout is None else self.launcher.clock() + timeout
        while self.poll() is None:
            if deadline is not None and self.launcher.clock() >= deadline:
                raise TimeoutError(f"SLURM job {self.job_id} still running after {timeout}s")
            time.sleep(self.options.poll_seconds)
        self._output.close()
        status = self._status or self.refresh()
        cause, evidence = job_cause(
            status,
            cancelled_by_us=self._cancelled,
            time_limit_event=self.options.time_limit_event,
            warning_seconds=self.options.warning_seconds,
        )
        if cause is not None:
            log.warning("SLURM job %s ended %s: %s", self.job_id, status.state, cause)
        returncode = status.returncode
        if self.options.nproc_per_node > 1 and returncode == 1:  # torchrun's agent: report the failed rank's
            returncode = root_cause_exitcode(self._output.tail("stderr")) or returncode
        try:
            hosts = self.launcher.hostnames(status.fields.get("NodeList", ""))
        except (SupervisorError, subprocess.TimeoutExpired) as exc:
            log.warning("SLURM job %s: its nodes are unknown (%s)", self.job_id, exc)
            hosts = ()
        return ExitInfo(
            returncode=returncode,
            stderr_tail=self._output.tail("stderr"),
            stdout_tail=self._output.tail("stdout"),
            signal_sent=self._signal_sent,
            handle_id=self.job_id,
            duration_s=self.launcher.clock() - self._t0,
            cause=cause,
            cause_evidence=evidence,
            hosts=hosts,
        )


def slurm_options(spec: SlurmSpec, workdir: Path) -> SlurmOptions:
    """The launcher's options from the policy's `launcher.slurm` section (a `SlurmSpec`)."""
    return SlurmOptions(
        partition=spec.partition,
        nodes=spec.nodes,
        nproc_per_node=spec.nproc_per_node,
        gpus_per_node=spec.gpus_per_node,
        cpus_per_task=spec.cpus_per_task,
        time_limit=None if spec.time_limit is None else str(spec.time_limit),
        account=spec.account,
        extra_sbatch=tuple(spec.extra_sbatch),
        warning_seconds=spec.warning_seconds,
        relaunch=spec.relaunch,
        time_limit_event=spec.time_limit_event,
        poll_seconds=spec.poll_seconds,
        job_dir=Path(spec.job_dir) if spec.job_dir else Path(workdir) / "slurm",
    )


def launcher_from_policy(config: LauncherConfig, workdir: Path) -> Launcher | None:
    """The launcher the policy's `launcher:` section asks for; None for the local default."""
    if config.type == "slurm":
        return SlurmLauncher(slurm_options(config.slurm, workdir))
    if config.type == "torchrun":
        from supervisor.launcher.multinode import torchrun_launcher

        return torchrun_launcher(config.torchrun, workdir)
    if config.type == "kubernetes":  # imported here: the kubernetes client is an optional extra
        from supervisor.launcher.kubernetes import kubernetes_launcher

        return kubernetes_launcher(config.kubernetes)
    return None
