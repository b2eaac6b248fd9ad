"""The `launcher:` section: what runs each segment (a local process group, or a SLURM batch job) and how."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from policies.base import Spec, problem

#: `--time` as sbatch takes it: minutes, M:S, H:M:S, D-H, D-H:M or D-H:M:S.
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2})$")


class SlurmSpec(Spec):
    """Each segment a SLURM batch job: `srun` of the command (under torchrun for several processes per node)."""

    partition: str | None = Field(
        None, min_length=1, description="`--partition`; null: the cluster's default."
    )
    account: str | None = Field(None, min_length=1, description="`--account`; null: your default account.")
    nodes: int = Field(1, ge=1, description="`--nodes`; the command runs once per node.")
    nproc_per_node: int = Field(
        1, ge=1, description="Processes per node; above 1 the command runs under torchrun (one node only)."
    )
    gpus_per_node: int | None = Field(None, ge=0, description="`--gpus-per-node`; null asks for none.")
    cpus_per_task: int | None = Field(
        None, ge=1, description="`--cpus-per-task`; null: the cluster's default."
    )
    time_limit: int | str | None = Field(
        None,
        description="`--time`: minutes, or [days-]hours:minutes:seconds, e.g. 240 or 1-00:00:00; null: the "
        "partition's limit.",
    )
    extra_sbatch: list[str] = Field(
        default_factory=list, description="Further `#SBATCH` options, each as written, e.g. `--qos=high`."
    )
    warning_seconds: int | None = Field(
        60,
        ge=1,
        description="Seconds before the time limit that the tasks get SIGTERM (`--signal=TERM@N`) to save an "
        "emergency checkpoint; it must cover a save. null sends no warning.",
    )
    relaunch: Literal["sbatch", "requeue"] = Field(
        "sbatch",
        description="How the next segment starts: a new job (`sbatch`) or the same job again (`scontrol "
        "requeue`; the job id stays, needs the job still known to the controller).",
    )
    time_limit_event: Literal["preemption", "stop"] = Field(
        "preemption",
        description="What a job reaching its time limit is: a `preemption` (relaunched by the preemption rule "
        "from its emergency checkpoint) or a `stop` (the lineage ends, stopped). Its event records "
        "`kind: time_limit` either way.",
    )
    poll_seconds: float = Field(
        1.0, gt=0, allow_inf_nan=False, description="How often the job's state is read (`scontrol show job`)."
    )
    job_dir: str | None = Field(
        None,
        min_length=1,
        description="Directory for batch scripts and job output, on storage the compute nodes share; null: "
        "`slurm/` in the supervisor's work directory.",
    )

    @field_validator("time_limit")
    @classmethod
    def _sbatch_time(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value < 1:
            raise problem("", "a number of minutes >= 1, or [days-]hours:minutes:seconds", value)
        if isinstance(value, str) and not _TIME.match(value):
            raise problem("", "minutes or [days-]hours:minutes:seconds, e.g. 240 or 1-00:00:00", value)
        return value

    @field_validator("extra_sbatch")
    @classmethod
    def _options(cls, value: list[str]) -> list[str]:
        for i, line in enumerate(value):
            if not line.startswith("-") or "\n" in line:
                raise problem(str(i), "an sbatch option on one line, e.g. --qos=high", line)
        return value

    @model_validator(mode="after")
    def _torchrun_one_node(self) -> SlurmSpec:
        if self.nproc_per_node > 1 and self.nodes > 1:
            raise problem(
                "nodes", f"1 with nproc_per_node {self.nproc_per_node} (torchrun on one node)", self.nodes
            )
        return self


class LauncherConfig(Spec):
    """What starts each training segment."""

    type: Literal["local", "slurm"] = Field(
        "local", description="`local`: a process group on this machine; `slurm`: a SLURM batch job."
    )
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="The SLURM job, for type `slurm`.")

    @model_validator(mode="after")
    def _slurm_only_for_slurm(self) -> LauncherConfig:
        if self.type != "slurm" and "slurm" in self.model_fields_set:
            raise problem("type", "slurm (a `slurm:` section is given)", self.type)
        return self
