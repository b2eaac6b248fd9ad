"""`prefect deploy` of the kubernetes deployment against a real Prefect server whose `training-k8s` pool is a
kubernetes work pool with our base job template: the server checks the job variables against it."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "prefect_kubernetes", reason="the kubernetes work pool needs `pip install '.[kubernetes]'`"
)

from tests.conftest import REPO  # noqa: E402
from tests.prefect_servers import PrefectServer  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEMPLATE = REPO / "examples" / "kubernetes" / "base-job-template.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = PrefectServer(tmp_path_factory.mktemp("prefect-k8s")).start()
    try:
        server.cli(
            "work-pool",
            "create",
            "training-k8s",
            "--type",
            "kubernetes",
            "--base-job-template",
            str(TEMPLATE),
        )
        yield server
    finally:
        server.stop()


def deploy(server: PrefectServer, *extra: str) -> str:
    return server.cli(
        "--no-prompt", "deploy", "--prefect-file", "deployments/prefect.yaml", "--name", "charlm-k8s-spot", *extra,
        cwd=REPO, ROLLBACK_SUPERVISOR_REPO=str(REPO),
    )  # fmt: skip


def test_the_server_refuses_job_variables_the_pool_does_not_accept(server):
    """Runs first: it creates the deployment (an update of an existing one words its refusal otherwise)."""
    with pytest.raises(RuntimeError) as refused:
        deploy(server, "--job-variable", "image_pull_policy=Sometimes")
    output = str(refused.value).split("\n", 1)[1]  # what prefect printed, not the command line
    assert (
        "Validation failed for field 'image_pull_policy'" in output and "'Sometimes' is not one of" in output
    )


def test_the_kubernetes_deployment_deploys_to_a_kubernetes_pool(server):
    deploy(server)
    deployment = server.get("/deployments/name/supervised-training/charlm-k8s-spot")
    assert deployment["work_pool_name"] == "training-k8s"
    variables = deployment["job_variables"]
    assert variables["backoff_limit"] == 0 and variables["namespace"] == "training"
    assert variables["env"]["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"
    assert deployment["parameters"]["policy"] == "examples/kubernetes/charlm-k8s.yaml"
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": "/opt/rollback-supervisor"}}
    ]
    pool = server.get("/work_pools/training-k8s")
    assert pool["type"] == "kubernetes"
