"""The Kubernetes launcher's manifests (built with the official client's models, checked against its OpenAPI
types by a round trip through its deserializer), its policy section, and the client as an optional extra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes launcher needs `pip install '.[kubernetes]'`")

from kubernetes.client import ApiClient  # noqa: E402

from policies import parse_policy  # noqa: E402
from policies.launcher_schema import KubernetesSpec  # noqa: E402
from supervisor.errors import PolicyError  # noqa: E402
from supervisor.launcher.base import LaunchSpec  # noqa: E402
from supervisor.launcher.kubernetes import KubernetesLauncher  # noqa: E402
from supervisor.launcher.kubernetes_manifests import job_manifest, job_name, label_value, service_manifest  # noqa: E402
from supervisor.launcher.slurm import launcher_from_policy  # noqa: E402

BASE = "version: 1\nname: t\nrules: [{when: [preemption], action: resume}]\n"
SPEC = LaunchSpec(
    (sys.executable, "-u", "examples/charlm.py", "--steps", "300"),
    env_overrides={"ROLLBACK_PLAN": "/shared/rollback/plan-3.json"},
    name="charlm-k8s-3",
)


def round_trip(obj, openapi_type: str) -> dict:
    """The manifest as JSON, read back into the client's OpenAPI model: it must come back unchanged (no field
    unknown to the type, none missing that the type requires, every value of the declared type)."""
    api = ApiClient()
    data = api.sanitize_for_serialization(obj)
    parsed = api.deserialize(json.dumps(data), openapi_type, "application/json")
    assert type(parsed).__name__ == openapi_type
    assert api.sanitize_for_serialization(parsed) == data
    return data


def test_a_single_node_job_runs_the_command_with_the_images_python():
    options = KubernetesSpec(
        image="registry.example/rs:1", namespace="training", gpus_per_node=1, cpu="4", memory="16Gi",
        service_account="trainer", node_selector={"pool": "spot-gpu"},
        tolerations=[{"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
        env={"AWS_DEFAULT_REGION": "us-east-1"}, termination_grace_seconds=45,
        shared_volume_claim="rollback", shared_mount_path="/shared",
    )  # fmt: skip
    job = round_trip(job_manifest(options, SPEC, "charlm-k8s-3-abc123"), "V1Job")
    assert (job["apiVersion"], job["kind"], job["metadata"]["namespace"]) == ("batch/v1", "Job", "training")
    spec = job["spec"]
    assert (spec["backoffLimit"], spec["completionMode"], spec["completions"], spec["parallelism"]) == (
        0,
        "Indexed",
        1,
        1,
    )
    pod = spec["template"]["spec"]
    assert (pod["restartPolicy"], pod["terminationGracePeriodSeconds"], pod["serviceAccountName"]) == (
        "Never",
        45,
        "trainer",
    )
    assert (
        pod["nodeSelector"] == {"pool": "spot-gpu"}
        and pod["tolerations"][0]["key"] == "cloud.google.com/gke-spot"
    )
    assert "subdomain" not in pod  # one node: no Service
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-u", "examples/charlm.py", "--steps", "300"]
    assert container["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"},
    }
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["ROLLBACK_PLAN"] == "/shared/rollback/plan-3.json" and env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert pod["volumes"] == [{"name": "shared", "persistentVolumeClaim": {"claimName": "rollback"}}]
    assert container["volumeMounts"] == [{"name": "shared", "mountPath": "/shared"}]
    assert job["metadata"]["labels"] == spec["template"]["metadata"]["labels"] == {
        "rollback-supervisor/job": "charlm-k8s-3-abc123", "rollback-supervisor/segment": "charlm-k8s-3",
    }  # fmt: skip


def test_a_multi_node_job_is_indexed_with_torchrun_rendezvous_on_pod_zero():
    options = KubernetesSpec(image="rs:1", nodes=4, nproc_per_node=8, rendezvous_port=29400)
    name = "charlm-k8s-3-abc123"
    job = round_trip(job_manifest(options, SPEC, name), "V1Job")
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 4, 4)
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == name  # pods resolve as <job>-<index>.<service>
    command = pod["containers"][0]["command"]
    assert command[:3] == ["python", "-u", "-m"] and command[3] == "torch.distributed.run"
    flags = dict(zip(command[4:-3:2], command[5:-3:2], strict=False))
    assert flags["--nnodes"] == "4" and flags["--nproc-per-node"] == "8"
    assert flags["--node-rank"] == "$(NODE_RANK)"  # expanded by Kubernetes from the env var below
    assert (flags["--master-addr"], flags["--master-port"]) == (f"{name}-0.{name}", "29400")
    assert command[-3:] == ["examples/charlm.py", "--steps", "300"]
    (rank,) = [e for e in pod["containers"][0]["env"] if e["name"] == "NODE_RANK"]
    assert (
        rank["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    service = round_trip(service_manifest(options, SPEC, name), "V1Service")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {
        "rollback-supervisor/job": name
    }
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["ports"] == [{"name": "rendezvous", "port": 29400}]


def test_one_node_with_several_processes_runs_torchrun_standalone():
    command = (
        job_manifest(KubernetesSpec(image="rs:1", nproc_per_node=2), SPEC, "x-1")
        .spec.template.spec.containers[0]
        .command
    )
    assert "--standalone" in command and "--node-rank" not in command


def test_names_and_labels_are_valid_kubernetes_names():
    assert job_name("Charlm_Run.7-12", "abc123") == "charlm-run-7-12-abc123"
    assert len(job_name("x" * 200, "abc123")) <= 47
    assert label_value("a/b c" + "y" * 100).startswith("a-b-c") and len(label_value("z" * 100)) == 63


def test_the_policy_section_builds_the_launcher(tmp_path):
    policy = parse_policy(
        BASE + "launcher:\n  type: kubernetes\n  kubernetes: {image: 'rs:1', namespace: training, nodes: 2,"
        " tolerations: [{key: spot, operator: Exists}]}\n"
    )
    launcher = launcher_from_policy(policy.launcher, tmp_path)
    assert isinstance(launcher, KubernetesLauncher)
    assert (launcher.options.namespace, launcher.options.nodes, launcher.options.tolerations[0].operator) == (
        "training", 2, "Exists",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("launcher: {type: kubernetes}\n", "launcher.kubernetes.image: expected the training container's image"),
        ("launcher: {kubernetes: {image: x}}\n", "launcher.type: expected kubernetes (a `kubernetes:` section"),
        ("launcher: {type: kubernetes, kubernetes: {image: x, memory: 3GB}}\n", "launcher.kubernetes.memory: expected a Kubernetes quantity"),
        ("launcher: {type: kubernetes, kubernetes: {image: x, namespace: Training}}\n", "launcher.kubernetes.namespace: expected a Kubernetes name"),
        ("launcher: {type: kubernetes, kubernetes: {image: x, shared_volume_claim: c}}\n", "shared_mount_path: expected set together"),
        ("launcher: {type: kubernetes, kubernetes: {image: x, tolerations: [{value: a}]}}\n", "tolerations\\[0\\].key: expected a taint key with operator Equal"),
        ("launcher: {type: kubernetes, kubernetes: {image: x, tolerations: [{operator: Maybe}]}}\n", "tolerations\\[0\\].operator: expected one of Exists, Equal"),
    ],
)  # fmt: skip
def test_bad_sections_name_the_key(yaml, message):
    with pytest.raises(PolicyError, match=message.replace("(", r"\(")):
        parse_policy(BASE + yaml)


def test_without_the_client_the_supervisor_imports_and_the_launcher_names_the_extra(tmp_path):
    """`kubernetes` is an optional extra: imports stay lazy, and asking for the launcher says how to install it."""
    policy = tmp_path / "p.yaml"
    policy.write_text(BASE + "launcher: {type: kubernetes, kubernetes: {image: 'rs:1'}}\n")
    code = (
        "import sys; sys.modules['kubernetes'] = None\n"  # what an environment without the package sees
        "import supervisor.cli, flows.supervised, supervisor.launcher.kubernetes\n"
        "from policies import load_policy\n"
        "from supervisor.errors import UserError\n"
        "from supervisor.launcher.slurm import launcher_from_policy\n"
        f"try:\n    launcher_from_policy(load_policy({str(policy)!r}).launcher, '.')\n"
        "except UserError as exc:\n    print(exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pip install 'rollback-supervisor[kubernetes]'" in done.stdout
