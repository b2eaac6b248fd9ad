"""The Kubernetes launcher through the real `kubernetes` client against the local API stand-in
(tests/k8s_api_server.py; no cluster can run here): create, watch, logs, pod failure reasons, stop, reclaim."""

from __future__ import annotations

import signal
import time

import pytest

pytest.importorskip("kubernetes", reason="the Kubernetes launcher needs `pip install '.[kubernetes]'`")

from kubernetes import client  # noqa: E402

from policies.launcher_schema import KubernetesSpec  # noqa: E402
from supervisor.errors import UserError  # noqa: E402
from supervisor.launcher.base import LaunchSpec  # noqa: E402
from supervisor.launcher.kubernetes import KubernetesLauncher  # noqa: E402
from tests.k8s_api_server import k8s_api_server  # noqa: E402

SPEC = LaunchSpec(
    ("python", "-u", "train.py"), env_overrides={"ROLLBACK_PLAN": "/shared/plan.json"}, name="lin-3"
)


@pytest.fixture
def stand_in():
    with k8s_api_server() as (url, cluster):
        yield url, cluster


def launcher_for(url: str, **options) -> KubernetesLauncher:
    configuration = client.Configuration()
    configuration.host = url
    spec = KubernetesSpec(
        image="registry.example/train:1", namespace="training", poll_seconds=0.05, **options
    )
    return KubernetesLauncher(spec, api=client.ApiClient(configuration))


def wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_segment_runs_streams_its_log_and_succeeds(stand_in):
    url, cluster = stand_in
    lines: list[tuple[str, str]] = []
    job = launcher_for(url).start(SPEC, lambda stream, line: lines.append((stream, line)))
    (pod,) = cluster.pods_of(job.name)
    assert not job.started() and job.poll() is None  # Pending: not started yet
    created = cluster.jobs[("training", job.name)]
    assert (
        created["spec"]["backoffLimit"] == 0
        and created["metadata"]["labels"]["rollback-supervisor/segment"] == "lin-3"
    )
    cluster.run_pod(pod)
    assert job.started() and job.poll() is None
    cluster.log(pod, "step 1 loss 2.0\nstep 2 ")
    wait_for(lambda: ("stdout", "step 1 loss 2.0") in lines)
    cluster.log(pod, "loss 1.5\n")
    cluster.end_pod(pod, 0)
    info = job.wait(20)
    assert (info.returncode, info.cause, info.signal_sent, info.handle_id) == (0, None, None, job.name)
    assert lines == [("stdout", "step 1 loss 2.0"), ("stdout", "step 2 loss 1.5")]
    assert info.stdout_tail == info.stderr_tail == "step 1 loss 2.0\nstep 2 loss 1.5"
    assert job.details() == {"k8s_job": job.name, "k8s_namespace": "training", "k8s_segment": "lin-3"}


def test_a_broken_log_stream_is_opened_again_without_losing_or_repeating_lines(stand_in):
    url, cluster = stand_in
    lines: list[str] = []
    job = launcher_for(url).start(SPEC, lambda stream, line: lines.append(line))
    (pod,) = cluster.pods_of(job.name)
    cluster.run_pod(pod)
    assert job.started()
    cluster.log(pod, "one\ntwo\n")
    wait_for(lambda: lines == ["one", "two"])
    cluster.drop_streams()  # the API server restarts: the follow stream ends while the pod runs
    cluster.log(pod, "three\n")
    wait_for(lambda: "three" in lines)
    cluster.log(pod, "four")  # the last line has no newline
    cluster.end_pod(pod, 0)
    info = job.wait(20)
    assert lines == ["one", "two", "three", "four"] and info.returncode == 0
    follows = [body for method, path, body in cluster.requests if path.endswith("/log")]
    assert len(follows) >= 2 and "sinceSeconds" in follows[-1] and follows[0]["timestamps"] == "true"


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        (dict(exit_code=137, reason="OOMKilled"), (137, "oom", None)),
        (dict(exit_code=143, disruption="PreemptionByScheduler"), (143, "preemption", "disruption")),
        (dict(exit_code=143, disruption="EvictionByEvictionAPI"), (143, "preemption", "disruption")),
        (dict(exit_code=None, pod_reason="NodeLost"), (1, "hardware_fault", "node_lost")),
        (dict(exit_code=3), (3, None, None)),  # the exit code goes to the classifier as today
    ],
)
def test_pod_failure_reasons_become_events(stand_in, end, expected):
    url, cluster = stand_in
    job = launcher_for(url).start(SPEC)
    (pod,) = cluster.pods_of(job.name)
    cluster.run_pod(pod)
    cluster.end_pod(pod, **end)
    info = job.wait(20)
    assert (info.returncode, info.cause, info.cause_evidence.get("kind")) == expected
    assert info.cause_evidence.get("k8s_pod", pod) == pod


def test_an_evicted_pod_is_a_preemption_unless_its_node_is_gone(stand_in):
    url, cluster = stand_in
    launcher = launcher_for(url)
    causes = []
    for node, remove in (("node-a", False), ("node-b", True)):
        job = launcher.start(SPEC)
        (pod,) = cluster.pods_of(job.name)
        cluster.run_pod(pod, node=node)
        if remove:
            cluster.remove_node(node)
        cluster.end_pod(pod, 137, pod_reason="Evicted")
        info = job.wait(20)
        causes.append((info.cause, info.cause_evidence["k8s_node"]))
    assert causes == [("preemption", "node-a"), ("hardware_fault", "node-b")]
    assert ("GET", "/api/v1/nodes/node-b", {}) in cluster.requests


def test_stop_deletes_the_job_in_the_foreground_with_the_grace(stand_in):
    url, cluster = stand_in
    job = launcher_for(url).start(SPEC)
    cluster.run_pod(cluster.pods_of(job.name)[0])
    job.stop(25, sig=signal.SIGUSR2)
    info = job.wait(20)
    deletes = [
        body for method, path, body in cluster.requests if method == "DELETE" and path.endswith(job.name)
    ]
    assert deletes == [{"gracePeriodSeconds": 25, "propagationPolicy": "Foreground"}]
    # Kubernetes sends SIGTERM whatever we asked for; the stop is ours, not an outside one.
    assert (info.returncode, info.signal_sent, info.cause) == (-signal.SIGTERM, signal.SIGUSR2, None)


def test_a_job_deleted_from_outside_is_an_outside_stop(stand_in):
    url, cluster = stand_in
    job = launcher_for(url).start(SPEC)
    cluster.run_pod(cluster.pods_of(job.name)[0])
    with cluster.lock:
        cluster.delete_job("training", job.name)
    info = job.wait(20)
    assert (info.cause, info.cause_evidence["kind"], info.signal_sent) == ("stop", "outside_delete", None)


def test_reclaim_deletes_the_job_a_vanished_supervisor_left(stand_in):
    url, cluster = stand_in
    job = launcher_for(url).start(SPEC)
    cluster.run_pod(cluster.pods_of(job.name)[0])
    fresh = launcher_for(url)  # the next supervisor knows the Job only from the segment record
    fresh.reclaim({**job.details(), "k8s_segment": "lin-4", "index": 4})  # another segment's: left alone
    assert ("training", job.name) in cluster.jobs
    fresh.reclaim({**job.details(), "index": 3})
    assert ("training", job.name) not in cluster.jobs and not cluster.pods_of(job.name)
    fresh.reclaim({**job.details(), "index": 3})  # gone: nothing to do
    fresh.reclaim({"pid": 123, "index": 0})  # a local segment's record: not ours


def test_a_multi_node_segment_is_an_indexed_job_with_a_headless_service(stand_in):
    url, cluster = stand_in
    lines: list[str] = []
    job = launcher_for(url, nodes=2, nproc_per_node=2).start(SPEC, lambda stream, line: lines.append(line))
    pods = cluster.pods_of(job.name)
    assert len(pods) == 2 and ("training", job.name) in cluster.services
    for pod in pods:
        cluster.run_pod(pod)
    assert job.started()  # the watch starts each running pod's log stream
    cluster.log(pods[1], "rank 2 up\n")
    wait_for(lambda: "[node 1] rank 2 up" in lines)
    cluster.end_pod(pods[0], 0)
    assert job.poll() is None  # one node done, the other still runs
    cluster.end_pod(pods[1], 0)
    assert job.wait(20).returncode == 0


def test_the_api_refusing_the_job_is_a_user_error(stand_in):
    url, cluster = stand_in
    cluster.forbidden.add("training")
    with pytest.raises(
        UserError, match="the API refused Job lin-3-.* in namespace training .*403.*forbidden"
    ):
        launcher_for(url).start(SPEC)


def test_log_stamps_sort_by_time_not_text():
    from supervisor.launcher.kubernetes import stamp_key

    # Go trims trailing zeros: as text "00.1Z" sorts after "00.12Z".
    stamps = [
        "2026-11-24T22:00:00.12Z",
        "2026-11-24T22:00:00.1Z",
        "2026-11-24T22:00:00Z",
        "2026-11-24T22:00:01.000000001Z",
    ]
    assert sorted(stamps, key=stamp_key) == [stamps[2], stamps[1], stamps[0], stamps[3]]
