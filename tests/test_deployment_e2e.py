"""deployments/ end to end: a real server, a process pool and worker, `prefect deploy`, runs, an Automation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import psutil
import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import REPO
from tests.prefect_servers import PrefectServer, ProcessWorker, descendants, kill_leftovers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFECT_YAML = REPO / "deployments" / "prefect.yaml"
AUTOMATION_YAML = REPO / "deployments" / "resume-on-crash.yaml"
ZOMBIE_YAML = REPO / "deployments" / "crash-zombies.yaml"
DEPLOYMENT = "supervised-training/charlm-palm-spike"
POOL = "training"  # the pool named in prefect.yaml
COMMAND = "python examples/charlm.py --steps 60 --eval-every 20"  # relative: only resolves in the checkout

# Checkpoints every 20 steps, resumes in place after infrastructure faults; nothing that a healthy
# 60-step run could trip.
TEST_POLICY = """\
version: 1
name: deploy-test
checkpoint:
  every_steps: 20
  keep_last: 3
  async: true
  storage: ./checkpoints
  verify: fast
monitor:
  poll_seconds: 0.5
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [preemption, hardware_fault, unknown_exit]
    action: resume
    target: {select: latest}
    allow_scratch: true
  - when: [software_error, oom]
    action: fail
limits:
  max_rollbacks: 1
  max_restarts: 2
  backoff: {initial_seconds: 0.1, max_seconds: 1, multiplier: 2, jitter: false}
"""

UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


@dataclass
class Stack:
    server: PrefectServer
    worker: ProcessWorker

    def run(self, tmp_path: Path, lineage: str) -> tuple[str, Path]:
        """Trigger the deployment on the example with a test policy; returns (flow run id, workdir)."""
        policy = tmp_path / "policy.yaml"
        policy.write_text(TEST_POLICY)
        workdir = tmp_path / "rollback"
        out = self.server.cli(
            "deployment", "run", DEPLOYMENT,
            "--param", f"command={COMMAND}",
            "--param", f"policy={policy}",
            "--param", f"lineage={lineage}",
            "--param", f"workdir={workdir}",
            "--params", json.dumps({"stop_grace_seconds": 10}),
        )  # fmt: skip
        match = UUID_RE.search(out.split("UUID", 1)[-1])
        assert match, out
        return match.group(0), workdir

    def diagnostics(self, workdir: Path, lineage: str) -> str:
        parts = [f"--- worker log ---\n{self.worker.log_tail()}"]
        parts.append(f"--- server log ---\n{self.server.log.read_text(errors='replace')[-2000:]}")
        for log in sorted((workdir / "lineages" / lineage / "segments").glob("*.log")):
            parts.append(f"--- {log.name} ---\n{log.read_text(errors='replace')[-2000:]}")
        return "\n".join(parts)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """Server, process pool, the deployments from prefect.yaml, and a worker; all stopped by PID after."""
    root = tmp_path_factory.mktemp("prefect-stack")
    baseline = {p.pid for p in psutil.Process().children(recursive=True)}
    server = PrefectServer(root / "server")
    # The worker runs from a directory of its own: only the deployment's pull step can put the flow run
    # in the checkout, where the entrypoint and the relative paths in COMMAND resolve.
    worker = ProcessWorker(server, POOL, root / "worker")
    worker.root.mkdir()
    captured: list[psutil.Process] = []
    try:
        server.start()
        server.cli("work-pool", "create", POOL, "--type", "process")
        server.cli(
            # By name: --all would also need the kubernetes pool of charlm-k8s-spot (prefect refuses a
            # deployment whose pool does not exist).
            "--no-prompt", "deploy", "--prefect-file", str(PREFECT_YAML),
            "--name", "charlm-palm-spike", "--name", "charlm-slurm",
            cwd=REPO, ROLLBACK_SUPERVISOR_REPO=str(REPO),
        )  # fmt: skip
        worker.start()
        yield Stack(server, worker)
    finally:
        captured = descendants(worker.proc, server.proc)
        worker.stop()  # the worker first (SIGINT), then its server
        server.stop()
        leftovers = kill_leftovers(captured)
    assert not leftovers, f"still running after the worker and server stopped: {leftovers}"
    remaining = [p for p in psutil.Process().children(recursive=True) if p.pid not in baseline]
    assert not remaining, f"child processes left behind: {remaining}"


def _record(workdir: Path, lineage: str) -> dict[str, Any]:
    return json.loads((workdir / "lineages" / lineage / "lineage.json").read_text())


def _metric_steps(record: dict[str, Any], key: str) -> list[tuple[int, float]]:
    client = MlflowClient(tracking_uri=record["mlflow"]["tracking_uri"])
    return sorted((m.step, m.value) for m in client.get_metric_history(record["mlflow"]["run_id"], key))


def test_deploy_from_prefect_yaml_and_run_the_example_to_completion(stack: Stack, tmp_path: Path):
    deployment = stack.server.get(f"/deployments/name/{DEPLOYMENT}")
    assert deployment["pull_steps"] == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
    ]
    assert deployment["work_pool_name"] == POOL
    limit = deployment.get("global_concurrency_limit") or {}
    assert deployment.get("concurrency_limit") == 1 or limit.get("limit") == 1, deployment
    assert deployment["parameters"]["policy"] == "policies/presets/palm-spike.yaml"

    lineage = "deploy-e2e"
    run_id, workdir = stack.run(tmp_path, lineage)
    run = stack.server.wait_flow_run(run_id, timeout=300)
    state = run["state"]
    assert state["type"] == "COMPLETED", f"{state}\n{stack.diagnostics(workdir, lineage)}"
    assert run["parameters"]["lineage"] == lineage

    record = _record(workdir, lineage)
    assert record["status"] == "finished", record["final_reason"]
    assert record["final_checkpoint"].startswith("0000000060-")
    assert record["mlflow"]["tracking_uri"] == f"sqlite:///{workdir / 'mlflow.db'}"
    assert [step for step, _ in _metric_steps(record, "loss")] == list(range(1, 61))
    client = MlflowClient(tracking_uri=record["mlflow"]["tracking_uri"])
    assert client.get_run(record["mlflow"]["run_id"]).info.status == "FINISHED"


def _wait_heartbeat_step(stack: Stack, run_id: str, workdir: Path, lineage: str, step: int) -> int:
    path = workdir / "lineages" / lineage / "heartbeat.json"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        try:
            seen = json.loads(path.read_text()).get("step") or 0
        except (FileNotFoundError, json.JSONDecodeError):
            seen = 0
        if seen >= step:
            return seen
        state = stack.server.get(f"/flow_runs/{run_id}")["state"]
        assert state["type"] in ("SCHEDULED", "PENDING", "RUNNING"), stack.diagnostics(workdir, lineage)
        time.sleep(0.5)
    raise AssertionError(f"training never reached step {step}\n{stack.diagnostics(workdir, lineage)}")


#: The README's automation waits 30 s before the rerun, for a dead run's lease to expire elsewhere; on this one
#: host the lease of a dead holder is taken over at once, so the test's copy waits 2 s (still a scheduled run).
SCHEDULE_AFTER = ("    schedule_after: 30\n", "    schedule_after: 2\n")


def test_automation_on_crashed_reruns_the_deployment_and_resumes_the_lineage(stack: Stack, tmp_path: Path):
    text = AUTOMATION_YAML.read_text()
    assert text.count(SCHEDULE_AFTER[0]) == 1, "resume-on-crash.yaml's schedule_after changed"
    automation = tmp_path / AUTOMATION_YAML.name
    automation.write_text(text.replace(*SCHEDULE_AFTER))
    stack.server.cli("automation", "create", "--from-file", str(automation))
    stack.server.cli("automation", "create", "--from-file", str(ZOMBIE_YAML))  # the README installs both
    lineage = "crash-e2e"
    earlier = {r["id"] for r in stack.server.post("/flow_runs/filter")}  # runs of other tests on this server
    first_id, workdir = stack.run(tmp_path, lineage)
    _wait_heartbeat_step(stack, first_id, workdir, lineage, 25)  # past the checkpoint at step 20

    # The machine is lost: the flow-run process and its training segment die at once, with no warning.
    engines = [p for p in descendants(stack.worker.proc) if "prefect.engine" in " ".join(p.cmdline())]
    assert len(engines) == 1, engines
    tree = [engines[0], *engines[0].children(recursive=True)]
    for proc in tree:
        proc.kill()
    psutil.wait_procs(tree, timeout=10)
    first = stack.server.wait_flow_run(first_id, timeout=60)
    assert first["state"]["type"] == "CRASHED", first["state"]

    deadline = time.monotonic() + 120
    while not (
        others := [r for r in stack.server.post("/flow_runs/filter") if r["id"] not in {first_id, *earlier}]
    ):
        assert time.monotonic() < deadline, f"the Automation started no new run\n{stack.worker.log_tail()}"
        time.sleep(1)
    second = others[0]
    assert second["deployment_id"] == first["deployment_id"]
    assert second["parameters"] == first["parameters"]
    done = stack.server.wait_flow_run(second["id"], timeout=400)
    assert done["state"]["type"] == "COMPLETED", f"{done['state']}\n{stack.diagnostics(workdir, lineage)}"

    record = _record(workdir, lineage)
    assert record["status"] == "finished", record["final_reason"]
    assert [s["outcome"] for s in record["segments"]] == ["interrupted", "finished"]
    assert record["segments"][0]["event"]["type"] == "preemption"
    assert record["final_checkpoint"].startswith("0000000060-")
    restored = [int(value) for step, value in _metric_steps(record, "rollback.restored_step") if step > 0]
    assert restored and restored[-1] >= 20, "the resumed run started from scratch, not from a checkpoint"
    # The resumed segment logs every step after its checkpoint into the same MLflow run.
    steps = {step for step, _ in _metric_steps(record, "loss")}
    assert set(range(restored[-1] + 1, 61)) <= steps and max(steps) == 60


NOTIFY_POLICY = """\
version: 1
name: notify-test
checkpoint:
  every_steps: 20
  keep_last: 3
  async: true
  memory_slots: 2
  storage: ./checkpoints
  verify: fast
monitor:
  poll_seconds: 0.5
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
    skip_batches: 5
    lr_scale: 0.5
  - when: [preemption, hardware_fault, unknown_exit]
    action: resume
    target: {select: latest}
  - when: [software_error, oom]
    action: fail
limits:
  max_rollbacks: 2
  max_restarts: 2
  backoff: {initial_seconds: 0.1, max_seconds: 1, multiplier: 2, jitter: false}
"""


class _Hook(BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_notify_automation_posts_each_rollback_to_the_webhook(stack: Stack, tmp_path: Path):
    """`notify install` against the real server; a NaN rolled back in process reaches the webhook with the
    lineage, event, step, decision and a link to the flow run."""
    bodies: list[bytes] = []
    handler = type("Hook", (_Hook,), {"bodies": bodies})
    hook = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=hook.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{hook.server_port}/rollbacks"
        for _ in range(2):  # installing again replaces the automation, never duplicates it
            out = subprocess.run(
                [sys.executable, "-m", "supervisor.cli", "notify", "install", "--url", url],
                cwd=REPO, env=stack.server.env(), capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr[-3000:]
        named = [
            a
            for a in stack.server.post("/automations/filter")
            if a["name"] == "rollback-supervisor-notify-on-rollback"
        ]
        assert len(named) == 1, named

        lineage = "notify-e2e"
        policy = tmp_path / "policy.yaml"
        policy.write_text(NOTIFY_POLICY)
        workdir = tmp_path / "rollback"
        params = {"stop_grace_seconds": 10, "env": {"ROLLBACK_SUPERVISOR_FAULTS": "nan@30"}}
        out_text = stack.server.cli(
            "deployment", "run", DEPLOYMENT,
            "--param", f"command={COMMAND}",
            "--param", f"policy={policy}",
            "--param", f"lineage={lineage}",
            "--param", f"workdir={workdir}",
            "--params", json.dumps(params),
        )  # fmt: skip
        match = UUID_RE.search(out_text.split("UUID", 1)[-1])
        assert match, out_text
        flow_run_id = match.group(0)
        done = stack.server.wait_flow_run(flow_run_id, timeout=400)
        assert done["state"]["type"] == "COMPLETED", f"{done['state']}\n{stack.diagnostics(workdir, lineage)}"
        deadline = time.monotonic() + 60
        while not bodies:
            assert time.monotonic() < deadline, "the Automation posted nothing to the webhook"
            time.sleep(0.5)
    finally:
        hook.shutdown()
        hook.server_close()
        thread.join(timeout=5)

    (body,) = bodies  # one rollback, one message
    message = json.loads(body)
    record = _record(workdir, lineage)
    (taken,) = [rec for seg in record["segments"] for rec in seg["in_process"]]
    decision = taken["decision"]
    assert message["lineage"] == lineage
    assert message["action"] == "rollback" and message["event"] == "non_finite"
    assert message["step"] == decision["event"]["step"] and 30 <= message["step"] <= 31  # the NaN's step
    assert message["onset_step"] == decision["event"]["onset_step"]
    assert message["target_step"] == decision["target_step"] == 20
    assert message["target_checkpoint"] == decision["target_id"]
    assert message["skip_batches"] == 5 and message["lr_scale"] == 0.5
    assert message["reason"] == decision["reason"]
    assert message["flow_run_id"] == flow_run_id
    assert message["flow_run_url"] == f"{stack.server.env()['PREFECT_UI_URL']}/runs/flow-run/{flow_run_id}"
