"""A segment's Job and pods in the supervisor's words (pure, table-driven): phases and pod failure reasons."""

from __future__ import annotations

import pytest

from supervisor.launcher.kubernetes_states import pending_reason, pod_cause, segment_state


def pod(
    phase="Running",
    *,
    exit_code=None,
    reason="Error",
    pod_reason=None,
    disruption=None,
    node="n1",
    name="p-0",
):
    status: dict = {"phase": phase}
    if exit_code is not None:
        status["containerStatuses"] = [
            {"name": "training", "state": {"terminated": {"exitCode": exit_code, "reason": reason}}}
        ]
    if pod_reason:
        status["reason"] = pod_reason
    if disruption:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": disruption}]
    return {"metadata": {"name": name}, "spec": {"nodeName": node}, "status": status}


def job(*conditions, completions=1, deleting=False):
    meta = {"name": "j"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-24T22:00:00Z"
    return {
        "metadata": meta,
        "spec": {"completions": completions},
        "status": {"conditions": [{"type": t, "status": "True", "reason": r} for t, r in conditions]},
    }


@pytest.mark.parametrize(
    ("failed", "gone", "expected"),
    [
        (pod("Failed", exit_code=137, reason="OOMKilled"), (), ("oom", None)),
        (pod("Failed", exit_code=143, disruption="PreemptionByScheduler"), (), ("preemption", "disruption")),
        (pod("Failed", exit_code=143, disruption="EvictionByEvictionAPI"), (), ("preemption", "disruption")),
        (pod("Failed", exit_code=143, disruption="TerminationByKubelet"), (), ("preemption", "disruption")),
        (pod("Failed", exit_code=137, disruption="DeletionByTaintManager"), (), ("hardware_fault", "node_lost")),
        (pod("Failed", exit_code=137, disruption="DeletionByPodGC"), (), ("hardware_fault", "node_lost")),
        (pod("Failed", pod_reason="NodeLost"), (), ("hardware_fault", "node_lost")),
        (pod("Failed", exit_code=137, pod_reason="Evicted"), (), ("preemption", "disruption")),
        (pod("Failed", exit_code=137, pod_reason="Evicted"), ("n1",), ("hardware_fault", "node_lost")),
        # A disruption beats the OOM kill it may have caused; a lost node beats both.
        (pod("Failed", exit_code=137, reason="OOMKilled", disruption="EvictionByEvictionAPI"), (), ("preemption", "disruption")),
        (pod("Failed", exit_code=137, reason="OOMKilled", pod_reason="NodeLost"), (), ("hardware_fault", "node_lost")),
        (pod("Failed", exit_code=1), (), (None, None)),
        (pod("Failed", exit_code=137, reason="Error"), ("n2",), (None, None)),  # another node gone: not this pod's
    ],
)  # fmt: skip
def test_pod_failure_reasons(failed, gone, expected):
    cause, evidence = pod_cause(failed, gone)
    assert (cause, evidence.get("kind")) == expected
    assert evidence["k8s_pod"] == "p-0" and evidence["k8s_node"] == "n1"


@pytest.mark.parametrize(
    ("the_job", "pods", "deleted_by_us", "expected"),
    [
        (job(), [pod("Pending")], False, ("pending", None, None)),
        (job(), [], False, ("pending", None, None)),
        (job(), [pod("Running")], False, ("running", None, None)),
        (job(("Complete", "")), [pod("Succeeded", exit_code=0)], False, ("finished", 0, None)),
        (job(), [pod("Succeeded", exit_code=0)], False, ("finished", 0, None)),  # before the controller says so
        (job(completions=2), [pod("Succeeded", exit_code=0), pod("Running")], False, ("running", None, None)),
        (job(), [pod("Failed", exit_code=3)], False, ("finished", 3, None)),
        (job(), [pod("Failed", exit_code=137, reason="OOMKilled")], False, ("finished", 137, "oom")),
        (job(), [pod("Failed", pod_reason="NodeLost")], False, ("finished", 1, "hardware_fault")),
        (job(("Failed", "DeadlineExceeded")), [], False, ("finished", 1, None)),
        (None, [], True, ("finished", -15, None)),  # we deleted it and it is gone
        (job(deleting=True), [pod("Running")], True, ("running", None, None)),  # still terminating
        (job(deleting=True), [pod("Failed", exit_code=143)], True, ("finished", 143, None)),
        (None, [], False, ("finished", -15, "stop")),  # deleted from outside
        (job(completions=2), [pod("Failed", exit_code=143, disruption="PreemptionByScheduler"), pod("Running")], False,
         ("finished", 143, "preemption")),  # one node's pod fails the Job (backoffLimit 0)
    ],
)  # fmt: skip
def test_segment_states(the_job, pods, deleted_by_us, expected):
    state = segment_state(the_job, pods, deleted_by_us=deleted_by_us)
    assert (state.phase, state.returncode, state.cause) == expected
    assert state.finished == (expected[0] == "finished")


def test_a_stop_without_grace_reports_a_kill():
    assert segment_state(None, [], deleted_by_us=True, stop_signal=9).returncode == -9


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        ({"phase": "Pending"}, None),
        ({"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
          "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]},
         "Unschedulable: 0/3 nodes are available: 3 Insufficient nvidia.com/gpu."),
        ({"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}, None),
        ({"phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff",
          "message": "Back-off pulling image"}}}]}, "ImagePullBackOff: Back-off pulling image"),
        ({"phase": "Running"}, None),
    ],
)  # fmt: skip
def test_why_a_pod_waits(status, expected):
    assert pending_reason([{"metadata": {"name": "p"}, "status": status}]) == expected
