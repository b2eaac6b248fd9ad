"""The Kubernetes objects of one segment: an Indexed Job (one pod per node) and, for several nodes, the
headless Service its pods find each other through for torchrun's rendezvous.

Pure: options and a LaunchSpec in, `kubernetes.client` models out (built with the official client's types, so
the API's own schema checks them); the launcher (kubernetes.py) sends them.
"""

from __future__ import annotations

import re
from typing import Any

from policies.launcher_schema import KubernetesSpec
from supervisor.launcher.base import LaunchSpec
from supervisor.launcher.kubernetes_api import client_module
from supervisor.launcher.torchrun import split_command

#: Labels on the Job, its pods and its Service: ours, and which segment (`<lineage>-<index>`) it runs.
JOB_LABEL = "rollback-supervisor/job"
SEGMENT_LABEL = "rollback-supervisor/segment"
#: The training container's name in every pod.
CONTAINER = "training"
#: The pod's index in an Indexed Job, set by the Job controller as this annotation.
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: The node label an excluded host is kept off by (the node's name is matched too: they may differ).
HOSTNAME_LABEL = "kubernetes.io/hostname"
_NOT_NAME = re.compile(r"[^a-z0-9-]+")


def label_value(text: str) -> str:
    """`text` as a label value (at most 63 of letters, digits, `-_.`, alphanumeric at both ends)."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value or "segment"


def job_name(segment: str, token: str) -> str:
    """A Job name from the segment's name and a unique token: a DNS label short enough for pod hostnames
    (`<job>-<index>`) and the Service."""
    stem = _NOT_NAME.sub("-", segment.lower()).strip("-")[:40].strip("-") or "segment"
    return f"{stem}-{token}"


def pod_command(options: KubernetesSpec, spec: LaunchSpec, name: str) -> list[str]:
    """What each pod runs: the command with the image's Python, under torchrun for several processes or nodes."""
    split = split_command(spec.command)
    is_python = bool(spec.command) and split.interpreter == spec.command[0]
    if options.nodes == 1 and options.nproc_per_node == 1:
        return [options.python, *split.flags, *split.script] if is_python else list(spec.command)
    torchrun = [options.python, *split.flags, "-m", "torch.distributed.run"]
    torchrun += ["--nnodes", str(options.nodes), "--nproc-per-node", str(options.nproc_per_node)]
    if options.nodes == 1:
        torchrun.append("--standalone")
    else:  # static rendezvous on pod 0, reached by its stable name under the headless Service
        torchrun += [
            "--node-rank", "$(NODE_RANK)",
            "--master-addr", f"{name}-0.{name}",
            "--master-port", str(options.rendezvous_port),
        ]  # fmt: skip
    return [*torchrun, "--max-restarts", "0", *split.script]


def _env(options: KubernetesSpec, spec: LaunchSpec) -> list[Any]:
    """The plan and the policy's variables; NODE_RANK from the pod's completion index."""
    k8s = client_module()
    merged = {**options.env, **spec.env_overrides}
    env = [k8s.V1EnvVar(name=key, value=str(value)) for key, value in sorted(merged.items())]
    source = k8s.V1EnvVarSource(
        field_ref=k8s.V1ObjectFieldSelector(field_path=f"metadata.annotations['{INDEX_ANNOTATION}']")
    )
    return [*env, k8s.V1EnvVar(name="NODE_RANK", value_from=source)]


def _resources(options: KubernetesSpec) -> Any:
    k8s = client_module()
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if options.cpu:
        requests["cpu"] = options.cpu
    if options.memory:  # a memory limit makes an overrun an OOMKilled container, which we can name
        requests["memory"] = limits["memory"] = options.memory
    if options.gpus_per_node:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(options.gpus_per_node)
    return k8s.V1ResourceRequirements(requests=requests or None, limits=limits or None)


def exclusion_affinity(exclude_hosts: tuple[str, ...]) -> Any:
    """A node affinity that keeps every pod off the excluded hosts (by hostname label and node name); None
    when there are none. Required at scheduling: a pod never lands there, and waits if nothing else fits."""
    if not exclude_hosts:
        return None
    k8s = client_module()
    hosts = list(exclude_hosts)
    term = k8s.V1NodeSelectorTerm(
        match_expressions=[k8s.V1NodeSelectorRequirement(key=HOSTNAME_LABEL, operator="NotIn", values=hosts)],
        match_fields=[k8s.V1NodeSelectorRequirement(key="metadata.name", operator="NotIn", values=hosts)],
    )
    selector = k8s.V1NodeSelector(node_selector_terms=[term])
    return k8s.V1Affinity(
        node_affinity=k8s.V1NodeAffinity(required_during_scheduling_ignored_during_execution=selector)
    )


def job_manifest(options: KubernetesSpec, spec: LaunchSpec, name: str) -> Any:
    """The segment's Job: Indexed, one pod per node, never retried by Kubernetes (the supervisor decides)."""
    k8s = client_module()
    labels = {JOB_LABEL: name, SEGMENT_LABEL: label_value(spec.name or name)}
    volumes, mounts = None, None
    if options.shared_volume_claim:
        claim = k8s.V1PersistentVolumeClaimVolumeSource(claim_name=options.shared_volume_claim)
        volumes = [k8s.V1Volume(name="shared", persistent_volume_claim=claim)]
        mounts = [k8s.V1VolumeMount(name="shared", mount_path=options.shared_mount_path)]
    container = k8s.V1Container(
        name=CONTAINER,
        image=options.image,
        command=pod_command(options, spec, name),
        env=_env(options, spec),
        working_dir=options.working_dir,
        resources=_resources(options),
        volume_mounts=mounts,
    )
    tolerations = [
        k8s.V1Toleration(key=t.key, operator=t.operator, value=t.value, effect=t.effect)
        for t in options.tolerations
    ]
    pod = k8s.V1PodSpec(
        containers=[container],
        restart_policy="Never",
        termination_grace_period_seconds=options.termination_grace_seconds,
        service_account_name=options.service_account,
        node_selector=dict(options.node_selector) or None,
        affinity=exclusion_affinity(spec.exclude_hosts),
        tolerations=tolerations or None,
        volumes=volumes,
        subdomain=name if options.nodes > 1 else None,
    )
    return k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k8s.V1ObjectMeta(name=name, namespace=options.namespace, labels=labels),
        spec=k8s.V1JobSpec(
            completion_mode="Indexed",
            completions=options.nodes,
            parallelism=options.nodes,
            backoff_limit=0,
            ttl_seconds_after_finished=options.ttl_seconds_after_finished,
            template=k8s.V1PodTemplateSpec(metadata=k8s.V1ObjectMeta(labels=labels), spec=pod),
        ),
    )


def service_manifest(options: KubernetesSpec, spec: LaunchSpec, name: str) -> Any:
    """The headless Service that gives each pod of a multi-node Job a DNS name (`<job>-<index>.<job>`)."""
    k8s = client_module()
    labels = {JOB_LABEL: name, SEGMENT_LABEL: label_value(spec.name or name)}
    return k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=k8s.V1ObjectMeta(name=name, namespace=options.namespace, labels=labels),
        spec=k8s.V1ServiceSpec(
            cluster_ip="None",
            selector={JOB_LABEL: name},
            publish_not_ready_addresses=True,  # rendezvous happens before any pod is ready
            ports=[k8s.V1ServicePort(name="rendezvous", port=options.rendezvous_port)],
        ),
    )
