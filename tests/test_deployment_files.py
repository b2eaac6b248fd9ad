"""deployments/ files agree with the code: entrypoint, parameters, presets, pull step, Automation schema."""

from __future__ import annotations

import ast
import json
import shlex

import pytest
import yaml

from tests.conftest import REPO

DEPLOYMENTS = REPO / "deployments"


@pytest.fixture(scope="module")
def prefect_yaml() -> dict:
    return yaml.safe_load((DEPLOYMENTS / "prefect.yaml").read_text())


def _flow_function(path: str, name: str) -> ast.FunctionDef:
    tree = ast.parse((REPO / path).read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"{path} defines no function {name!r}"
    return found[0]


def test_every_deployment_targets_the_flow_with_parameters_it_accepts(prefect_yaml: dict):
    assert prefect_yaml["deployments"], "prefect.yaml defines no deployment"
    for deployment in prefect_yaml["deployments"]:
        path, _, name = deployment["entrypoint"].partition(":")
        fn = _flow_function(path, name)
        # The flow's name is what `prefect deployment run 'supervised-training/...'` and the Automation use.
        (decorator,) = [d for d in fn.decorator_list if isinstance(d, ast.Call) and d.func.id == "flow"]
        assert {k.arg: k.value.value for k in decorator.keywords}["name"] == "supervised-training"
        accepted = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
        assert set(deployment["parameters"]) <= accepted, set(deployment["parameters"]) - accepted
        assert deployment["concurrency_limit"] == 1, deployment["name"]


def test_default_parameters_run_the_example_under_the_palm_spike_preset(prefect_yaml: dict):
    from policies import load_policy

    params = prefect_yaml["deployments"][0]["parameters"]
    argv = shlex.split(params["command"])
    assert argv[0] == "python" and (REPO / argv[1]).is_file(), argv
    assert params["policy"] == "policies/presets/palm-spike.yaml"
    assert load_policy(REPO / params["policy"]).name == "palm-spike"
    assert params["lineage"] and params["workdir"]
    # A run started right after a crash must outwait the dead supervisor's lease (60 s TTL).
    assert params["lease_wait_seconds"] > 60


def test_pull_step_sets_the_working_directory_from_the_environment(prefect_yaml: dict):
    assert prefect_yaml["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $ROLLBACK_SUPERVISOR_REPO }}"}}
    ]
    env = prefect_yaml["deployments"][0]["work_pool"]["job_variables"]["env"]
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert int(env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) >= 30  # Prefect rejects less


def test_resume_automation_is_a_valid_prefect_automation():
    from prefect.events.schemas.automations import AutomationCore

    data = yaml.safe_load((DEPLOYMENTS / "resume-on-crash.yaml").read_text())
    automation = AutomationCore.model_validate(data)
    assert automation.trigger.expect == {"prefect.flow-run.Crashed"}
    (action,) = automation.actions
    assert action.type == "run-deployment" and action.source == "inferred"


def test_zombie_automation_marks_silent_runs_crashed_after_missed_heartbeats(prefect_yaml: dict):
    from prefect.events.schemas.automations import AutomationCore, Posture

    data = yaml.safe_load((DEPLOYMENTS / "crash-zombies.yaml").read_text())
    automation = AutomationCore.model_validate(data)
    assert automation.trigger.posture == Posture.Proactive
    assert automation.trigger.after == {"prefect.flow-run.heartbeat"}
    (action,) = automation.actions
    assert action.type == "change-flow-run-state" and action.state.value == "CRASHED"
    frequency = int(
        prefect_yaml["deployments"][0]["work_pool"]["job_variables"]["env"][
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"
        ]
    )
    assert automation.trigger.within.total_seconds() >= 2 * frequency  # one late heartbeat is not a crash


def test_the_slurm_deployment_runs_each_segment_as_a_slurm_job(prefect_yaml: dict):
    from policies import load_policy

    (slurm,) = [d for d in prefect_yaml["deployments"] if d["name"] == "charlm-slurm"]
    policy = load_policy(REPO / slurm["parameters"]["policy"])
    assert policy.launcher.type == "slurm"
    # A SIGTERM comes before the time limit, so the training writes its emergency checkpoint.
    assert policy.launcher.slurm.time_limit and policy.launcher.slurm.warning_seconds
    # Everything but the launcher is the palm-spike preset: the same rules on a cluster as on one machine.
    preset = load_policy(REPO / "policies" / "presets" / "palm-spike.yaml")
    assert policy.rules == preset.rules and policy.checkpoint == preset.checkpoint
    assert slurm["work_pool"]["work_queue_name"] == "slurm"


def _load_as_prefect_deploy() -> list[dict]:
    """The deployments as `prefect deploy` reads prefect.yaml: its own loader and model (a file it cannot
    validate is skipped with a console message, so the message must be empty), then its default merge."""
    import io

    from prefect.cli.deploy._config import _load_deploy_configs_and_actions, _merge_with_default_deploy_config
    from rich.console import Console

    out = io.StringIO()
    configs, actions = _load_deploy_configs_and_actions(
        DEPLOYMENTS / "prefect.yaml", console=Console(file=out)
    )
    assert out.getvalue() == "", out.getvalue()
    assert actions["pull"], "the top-level pull step is lost"
    return [_merge_with_default_deploy_config(c) for c in configs]


def test_the_kubernetes_deployment_loads_as_prefect_deploy_and_fits_the_kubernetes_work_pool():
    from prefect.utilities.schema_tools import ValidationError, validate

    from policies import load_policy

    (k8s,) = [d for d in _load_as_prefect_deploy() if d["name"] == "charlm-k8s-spot"]
    pool = k8s["work_pool"]
    job_variables = pool["job_variables"]
    assert pool["name"] == "training-k8s" and job_variables["backoff_limit"] == 0
    assert job_variables["env"]["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"
    assert job_variables["image"] and job_variables["namespace"]
    # The job variables against the kubernetes work pool's template, as Prefect's server checks a deployment.
    template = json.loads((REPO / "examples" / "kubernetes" / "base-job-template.json").read_text())
    schema = template["variables"]
    assert set(job_variables) <= set(schema["properties"]), set(job_variables) - set(schema["properties"])

    def check(values: dict) -> None:
        validate(
            values,
            schema,
            raise_on_error=True,
            preprocess=True,
            ignore_required=True,
            allow_none_with_default=True,
        )

    check(job_variables)
    with pytest.raises(ValidationError):  # the check does refuse what the pool refuses
        check({**job_variables, "backoff_limit": -1})
    # The workdir is on the claim the pool's template mounts; checkpoints in S3; the policy runs a Job per segment.
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    (mount,) = pod["containers"][0]["volumeMounts"]
    policy = load_policy(REPO / k8s["parameters"]["policy"])
    spec = policy.launcher.kubernetes
    assert policy.launcher.type == "kubernetes" and policy.checkpoint.storage.startswith("s3://")
    assert (
        k8s["parameters"]["workdir"].startswith(mount["mountPath"] + "/")
        and mount["mountPath"] == spec.shared_mount_path
    )
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == spec.shared_volume_claim
    assert k8s["parameters"]["stop_grace_seconds"] < spec.termination_grace_seconds
    assert k8s["pull"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": spec.working_dir}}
    ]


def test_the_kubernetes_pool_template_is_prefect_kubernetes_default_plus_the_shared_claim():
    worker = pytest.importorskip("prefect_kubernetes.worker", reason="pip install '.[kubernetes]'")
    default = worker.KubernetesWorker.get_default_base_job_template()
    ours = json.loads((REPO / "examples" / "kubernetes" / "base-job-template.json").read_text())
    pod = ours["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    del pod["volumes"], pod["containers"][0]["volumeMounts"]
    assert ours == default  # regenerate the file from the installed prefect-kubernetes if this fails


def test_the_supervisor_rbac_grants_exactly_the_launchers_calls():
    pytest.importorskip("kubernetes", reason="pip install '.[kubernetes]'")
    from kubernetes.client import ApiClient

    docs = list(yaml.safe_load_all((REPO / "examples" / "kubernetes" / "rbac.yaml").read_text()))
    api = ApiClient()
    for doc in docs:  # each a valid object of its OpenAPI type
        parsed = api.deserialize(json.dumps(doc), "V1" + doc["kind"], "application/json")
        assert api.sanitize_for_serialization(parsed) == doc
    (role,) = [d for d in docs if d["kind"] == "Role"]
    grants = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert grants == {
        ("jobs", "create"), ("jobs", "get"), ("jobs", "delete"), ("services", "create"), ("services", "delete"),
        ("pods", "get"), ("pods", "list"), ("pods/log", "get"),
    }  # fmt: skip
