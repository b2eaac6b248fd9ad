"""The SLURM launcher's options and the batch script it submits: `#SBATCH` lines, and `srun` of the command.

The batch script is fixed at submission; what changes from segment to segment (the environment with the
launch plan, the working directory, the command) is in a separate segment file the script sources, so that
`scontrol requeue` runs the next segment by rewriting that file. Pure: options and a spec in, text out.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from supervisor.errors import UserError
from supervisor.launcher.base import LaunchSpec

Relaunch = Literal["sbatch", "requeue"]


@dataclass(frozen=True)
class SlurmOptions:
    """Where and how segments run as SLURM jobs; the policy's `launcher.slurm` section builds it."""

    partition: str | None = None
    """`--partition`; None: the cluster's default partition."""
    nodes: int = 1
    """`--nodes`; the command runs once per node (`srun --ntasks-per-node 1`), or under torchrun there."""
    nproc_per_node: int = 1
    """Processes per node: above 1 the command runs under `torchrun --nproc-per-node` (one node only)."""
    gpus_per_node: int | None = None
    """`--gpus-per-node`; None asks for none."""
    cpus_per_task: int | None = None
    """`--cpus-per-task`; None: the cluster's default."""
    time_limit: str | None = None
    """`--time` (minutes, or `[D-]HH:MM:SS`); None: the partition's limit."""
    account: str | None = None
    """`--account`; None: the user's default account."""
    extra_sbatch: tuple[str, ...] = ()
    """Further `#SBATCH` options, written as given (e.g. `--qos=high`)."""
    warning_seconds: int | None = 60
    """Seconds before the time limit (or a preemption) that the tasks get SIGTERM (`--signal=TERM@N`) to
    save an emergency checkpoint; None sends no warning."""
    relaunch: Relaunch = "sbatch"
    """How the next segment starts: a new job (`sbatch`) or the same job again (`scontrol requeue`)."""
    time_limit_event: Literal["preemption", "stop"] = "preemption"
    """What a job reaching its time limit is: a `preemption` (relaunched under the policy's preemption
    rule, from the emergency checkpoint) or a `stop` (the lineage ends there)."""
    poll_seconds: float = 1.0
    """How often the job's state is read (`scontrol show job`)."""
    job_dir: Path = Path(".rollback/slurm")
    """Where the batch scripts, segment files and job output live: on storage the compute nodes share."""

    def __post_init__(self) -> None:
        for name in ("nodes", "nproc_per_node"):
            if getattr(self, name) < 1:
                raise UserError(f"slurm {name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if self.nproc_per_node > 1 and self.nodes > 1:
            raise UserError(
                f"slurm nproc_per_node {self.nproc_per_node} with nodes {self.nodes}: torchrun under srun is "
                "supported on one node; set nodes to 1"
            )

    def sbatch_lines(self, name: str) -> list[str]:
        """The `#SBATCH` options of a job named `name` (its output goes to `job_dir/<jobid>.out|.err`)."""
        lines = [
            f"--job-name={name}",
            f"--output={self.job_dir.resolve()}/%j.out",
            f"--error={self.job_dir.resolve()}/%j.err",
            "--open-mode=append",  # a requeued job adds to its output; the launcher tails from where it was
            f"--nodes={self.nodes}",
            "--ntasks-per-node=1",
        ]
        optional = {
            "partition": self.partition,
            "account": self.account,
            "time": self.time_limit,
            "gpus-per-node": self.gpus_per_node,
            "cpus-per-task": self.cpus_per_task,
        }
        lines += [f"--{key}={value}" for key, value in optional.items() if value is not None]
        if self.warning_seconds is not None:
            # To the job steps, not the batch shell ("B:"): srun aborts its step when it gets SIGTERM itself,
            # killing the tasks before they can save (measured).
            lines.append(f"--signal=TERM@{self.warning_seconds}")
        lines.append("--requeue" if self.relaunch == "requeue" else "--no-requeue")
        return lines + list(self.extra_sbatch)


def sbatch_command(script: Path, *, inherit_env: bool, exclude_hosts: tuple[str, ...] = ()) -> list[str]:
    """The `sbatch` command line that submits `script`: its environment, and the lineage's excluded hosts."""
    command = ["sbatch", "--parsable", "--export=ALL" if inherit_env else "--export=NONE"]
    if exclude_hosts:
        bad = [h for h in exclude_hosts if not h or any(c in h for c in ", \t\n=")]
        if bad:
            raise UserError(f"slurm launcher: excluded host names must be SLURM node names, got {bad!r}")
        command.append(f"--exclude={','.join(exclude_hosts)}")
    return [*command, str(script)]


def batch_script(options: SlurmOptions, name: str, segment_file: Path) -> str:
    """The batch script: source the segment file, `srun` its command, and wait for it through signals."""
    sbatch = "\n".join(f"#SBATCH {line}" for line in options.sbatch_lines(name))
    return f"""#!/bin/bash
{sbatch}
# Written by rollback-supervisor. The segment file sets the launch plan's environment and the command; the
# supervisor rewrites it before a `scontrol requeue`, so a requeued job runs the next segment.
. {shlex.quote(str(segment_file.resolve()))}
# --export=ALL: the step gets this shell's environment, the segment's variables included, even when the job was
# submitted with --export=NONE (srun would inherit that through SLURM_EXPORT_ENV).
srun --export=ALL --kill-on-bad-exit=1 --ntasks-per-node=1 -- "${{cmd[@]}}" &
child=$!
# The steps get the warning and stop signals themselves; the shell only keeps waiting for srun's exit code.
trap 'echo "rollback-supervisor: batch shell got SIGTERM" >&2' TERM
trap 'echo "rollback-supervisor: batch shell got SIGUSR2" >&2' USR2
while kill -0 "$child" 2>/dev/null; do wait "$child"; done
wait "$child"
"""


def segment_file(spec: LaunchSpec, command: tuple[str, ...]) -> str:
    """What one segment runs: its environment overrides (the launch plan), its directory and its command."""
    bad = [key for key in spec.env_overrides if not key.isidentifier() or not key.isascii()]
    if bad:
        raise UserError(f"slurm launcher: environment variable names must be shell identifiers, got {bad!r}")
    lines = ["# one segment of a rollback-supervisor lineage"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(spec.env_overrides.items())]
    if spec.cwd:
        lines.append(f"cd {shlex.quote(spec.cwd)}")
    lines.append("cmd=(" + " ".join(shlex.quote(arg) for arg in command) + ")")
    return "\n".join(lines) + "\n"
