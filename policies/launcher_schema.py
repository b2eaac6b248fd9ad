"""The `launcher:` section: what runs each segment (a local process group, a SLURM batch job, a Kubernetes Job)."""

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


#: A Kubernetes object name (DNS-1123 label) and a quantity such as `500m`, `16Gi`.
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")


class TolerationSpec(Spec):
    """One pod toleration, as Kubernetes writes it (e.g. for a spot node pool's taint)."""

    key: str | None = Field(None, min_length=1, description="The taint key; null with `Exists`: any taint.")
    operator: Literal["Exists", "Equal"] = Field(
        "Equal", description="`Equal` matches `value`; `Exists` any."
    )
    value: str | None = Field(None, description="The taint value, for `Equal`.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="The taint effect; null: all effects."
    )

    @model_validator(mode="after")
    def _key_for_equal(self) -> TolerationSpec:
        if self.operator == "Equal" and self.key is None:  # Kubernetes: an empty key needs `Exists`
            raise problem("key", "a taint key with operator Equal (or operator: Exists)", None)
        return self


class KubernetesSpec(Spec):
    """Each segment a Kubernetes Job: one pod per node (an Indexed Job), torchrun in each for several."""

    image: str | None = Field(
        None, min_length=1, description="The container image with the training code (required)."
    )
    namespace: str = Field("default", description="The namespace the Job and its Service are created in.")
    nodes: int = Field(
        1, ge=1, description="Pods, one per node: an Indexed Job (completions = parallelism = nodes)."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        description="Processes per pod; above 1, or with several nodes, the command runs under torchrun.",
    )
    gpus_per_node: int | None = Field(
        None, ge=0, description="`nvidia.com/gpu` requested and limited per pod; null asks for none."
    )
    cpu: str | None = Field(None, description="CPU request per pod, e.g. `8` or `500m`; null: none.")
    memory: str | None = Field(None, description="Memory request and limit per pod, e.g. `32Gi`; null: none.")
    service_account: str | None = Field(
        None, min_length=1, description="The pods' service account; null: the namespace's default."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the pods must run on, e.g. a GPU node pool."
    )
    tolerations: list[TolerationSpec] = Field(
        default_factory=list, description="Taints the pods tolerate, e.g. a spot pool's."
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="Further environment variables of the training container."
    )
    working_dir: str | None = Field(
        None, min_length=1, description="The container's working directory; null: the image's."
    )
    python: str = Field(
        "python",
        min_length=1,
        description="The interpreter inside the image, which replaces the supervisor's own in the command.",
    )
    shared_volume_claim: str | None = Field(
        None,
        min_length=1,
        description="A PersistentVolumeClaim (ReadWriteMany) mounted at `shared_mount_path` in every pod: "
        "the supervisor's workdir (plan, heartbeat) and local checkpoints must be on it.",
    )
    shared_mount_path: str | None = Field(
        None, min_length=1, description="Where the claim is mounted: the path the supervisor sees it at."
    )
    termination_grace_seconds: int = Field(
        30,
        ge=1,
        description="The pods' terminationGracePeriodSeconds: SIGTERM to SIGKILL when a pod is evicted or "
        "preempted; it must cover an emergency checkpoint.",
    )
    rendezvous_port: int = Field(
        29500, ge=1, le=65535, description="torchrun's port on pod 0, for several nodes."
    )
    ttl_seconds_after_finished: int | None = Field(
        3600, ge=0, description="Seconds a finished Job (and its pods' logs) is kept; null: forever."
    )
    poll_seconds: float = Field(
        2.0, gt=0, allow_inf_nan=False, description="How often the Job and its pods are read."
    )
    kubeconfig: str | None = Field(
        None,
        min_length=1,
        description="A kubeconfig file; null: the in-cluster service account when the supervisor runs in a "
        "pod, else ~/.kube/config.",
    )
    context: str | None = Field(
        None, min_length=1, description="The kubeconfig context; null: its current one."
    )

    @field_validator("namespace", "service_account")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 63 or not _K8S_NAME.match(value)):
            raise problem("", "a Kubernetes name (lowercase letters, digits, '-'; at most 63)", value)
        return value

    @field_validator("cpu", "memory")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and not _QUANTITY.match(value):
            raise problem("", "a Kubernetes quantity, e.g. 8, 500m, 32Gi", value)
        return value

    @model_validator(mode="after")
    def _mount_with_claim(self) -> KubernetesSpec:
        if (self.shared_volume_claim is None) != (self.shared_mount_path is None):
            raise problem(
                "shared_mount_path", "set together with shared_volume_claim", self.shared_mount_path
            )
        return self


class TorchrunSpec(Spec):
    """Each segment under torchrun, on this machine or on several nodes (one torchrun agent per node).

    The supervisor's node hosts the rendezvous; every other node's agent is run by a follower
    (`rollback-supervisor follow`), see docs/design/multinode.md.
    """

    nodes: int = Field(
        1, ge=1, description="Nodes, each with its own torchrun agent; above 1 the lineage spans nodes."
    )
    nproc_per_node: int = Field(1, ge=1, description="Processes (ranks) per node: `--nproc-per-node`.")
    rdzv_endpoint: str | None = Field(
        None,
        min_length=3,
        description="host:port of the c10d rendezvous on the supervisor's node, reachable from every node "
        "(required for several nodes); null on one node: a free local port.",
    )
    followers: Literal["local", "external"] = Field(
        "local",
        description="`local`: the supervisor starts each follower as a local process (several nodes simulated "
        "on one machine); `external`: they are started on their nodes by something else (srun, an Indexed "
        "Job) with the command the supervisor logs.",
    )
    channel_dir: str | None = Field(
        None,
        min_length=1,
        description="Where the supervisor and its followers exchange orders and beats, on storage every node "
        "shares; null: `multinode/` in the supervisor's work directory.",
    )
    node_timeout_seconds: float = Field(
        30.0,
        gt=0,
        allow_inf_nan=False,
        description="A follower silent this long is a lost node; followers wait as long for a silent "
        "supervisor before they kill their agent.",
    )
    peer_exit_grace_seconds: float = Field(
        30.0,
        ge=0,
        allow_inf_nan=False,
        description="After one node failed, how long the others get to end on their own before they are killed.",
    )
    rdzv_join_timeout_seconds: int = Field(
        600, ge=1, description="torchrun's `join_timeout`: how long the agents wait for every node to join."
    )

    @model_validator(mode="after")
    def _endpoint_for_nodes(self) -> TorchrunSpec:
        if self.nodes > 1 and self.rdzv_endpoint is None:
            raise problem(
                "rdzv_endpoint", f"host:port reachable from every node (nodes is {self.nodes})", None
            )
        if self.rdzv_endpoint is not None:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
                raise problem("rdzv_endpoint", "host:port, e.g. 10.0.0.1:29400", self.rdzv_endpoint)
            if self.nodes > 1 and int(port) == 0:
                raise problem("rdzv_endpoint", "a fixed port (0 works on one node only)", self.rdzv_endpoint)
        return self


class LauncherConfig(Spec):
    """What starts each training segment."""

    type: Literal["local", "torchrun", "slurm", "kubernetes"] = Field(
        "local",
        description="`local`: a process group on this machine; `torchrun`: the command under torchrun, on "
        "one node or several; `slurm`: a SLURM batch job; `kubernetes`: a Kubernetes Job.",
    )
    torchrun: TorchrunSpec = Field(
        default_factory=TorchrunSpec, description="torchrun's nodes and ranks, for type `torchrun`."
    )
    slurm: SlurmSpec = Field(default_factory=SlurmSpec, description="The SLURM job, for type `slurm`.")
    kubernetes: KubernetesSpec = Field(
        default_factory=KubernetesSpec, description="The Kubernetes Job, for type `kubernetes`."
    )

    @model_validator(mode="after")
    def _slurm_only_for_slurm(self) -> LauncherConfig:
        if self.type != "slurm" and "slurm" in self.model_fields_set:
            raise problem("type", "slurm (a `slurm:` section is given)", self.type)
        if self.type != "torchrun" and "torchrun" in self.model_fields_set:
            raise problem("type", "torchrun (a `torchrun:` section is given)", self.type)
        if self.type != "kubernetes" and "kubernetes" in self.model_fields_set:
            raise problem("type", "kubernetes (a `kubernetes:` section is given)", self.type)
        if self.type == "kubernetes" and self.kubernetes.image is None:
            raise problem("kubernetes.image", "the training container's image", None)
        return self
