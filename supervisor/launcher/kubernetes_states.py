"""A segment's Kubernetes Job and pods in the supervisor's words: running or not, and what an end means.

Pure: the Job and its pods as the API returns them (JSON dicts, camelCase), and the nodes found gone, in; a
`SegmentState` out. The launcher (kubernetes.py) reads the objects and feeds them here.

What a failed pod means, first match wins:
- its node is gone: pod reason `NodeLost`, a `DisruptionTarget` condition by `DeletionByPodGC` (the pod
  garbage collector removing pods of a deleted node) or `DeletionByTaintManager` (a `NoExecute` taint, which
  Kubernetes puts on unreachable and not-ready nodes), or an `Evicted` pod whose node no longer exists
  → `hardware_fault`;
- any other `DisruptionTarget` condition (`PreemptionByScheduler`, `EvictionByEvictionAPI`,
  `TerminationByKubelet`: a spot node shutting down) or an `Evicted` pod → `preemption`;
- a container terminated `OOMKilled` → `oom`;
- otherwise its container's exit code goes to the log classifier as today (cause None).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: DisruptionTarget reasons that mean the pod's node went away, not that the pod was pushed off a live one.
NODE_LOST_DISRUPTIONS = frozenset({"DeletionByPodGC", "DeletionByTaintManager"})
#: The event type for a Job deleted by someone other than this supervisor.
OUTSIDE_STOP = "stop"

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class SegmentState:
    """Where a segment's Job stands; `returncode` and `cause` are set once it is finished."""

    phase: str  #: "pending" (no pod runs yet), "running" or "finished"
    returncode: int | None = None
    cause: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.phase == "finished"


def _conditions(obj: Obj) -> dict[str, Obj]:
    """Status conditions that hold (status "True"), by type."""
    found = (obj.get("status") or {}).get("conditions") or []
    return {c.get("type", ""): c for c in found if c.get("status") == "True"}


def _container(pod: Obj) -> Obj:
    """The first container's status (the training container: pods have one)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return statuses[0]


def terminated(pod: Obj) -> Obj | None:
    """The container's terminated state, if it ended."""
    return (_container(pod).get("state") or {}).get("terminated")


def pod_phase(pod: Obj) -> str:
    return (pod.get("status") or {}).get("phase", "Pending")


def pod_node(pod: Obj) -> str | None:
    return (pod.get("spec") or {}).get("nodeName")


def pod_cause(pod: Obj, nodes_gone: Iterable[str] = ()) -> tuple[str | None, dict[str, Any]]:
    """The event a failed pod's end means, with its evidence; (None, {...}) for the exit code to decide."""
    status = pod.get("status") or {}
    reason = status.get("reason", "")
    node = pod_node(pod)
    disruption = _conditions(pod).get("DisruptionTarget")
    end = terminated(pod) or {}
    evidence: dict[str, Any] = {"k8s_pod": (pod.get("metadata") or {}).get("name"), "k8s_node": node}
    if reason:
        evidence["k8s_pod_reason"] = reason
    if disruption is not None:
        evidence["k8s_disruption"] = disruption.get("reason", "")
    if end.get("reason"):
        evidence["k8s_container_reason"] = end["reason"]
    node_gone = node is not None and node in set(nodes_gone)
    if (
        reason == "NodeLost"
        or (disruption is not None and disruption.get("reason") in NODE_LOST_DISRUPTIONS)
        or (reason == "Evicted" and node_gone)
    ):
        return "hardware_fault", {**evidence, "kind": "node_lost"}
    if disruption is not None or reason == "Evicted":
        return "preemption", {**evidence, "kind": "disruption"}
    if end.get("reason") == "OOMKilled":
        return "oom", evidence
    return None, evidence


def pod_returncode(pod: Obj) -> int:
    """The container's exit code (a signal kill shows as 128+n, as a shell reports it); 1 if it never ran."""
    end = terminated(pod)
    if end is None or end.get("exitCode") is None:
        return 1
    return int(end["exitCode"])


def _first_failed(pods: list[Obj]) -> Obj | None:
    """The pod whose end explains the Job's: the earliest to finish among the failed ones."""
    failed = [p for p in pods if pod_phase(p) == "Failed"]
    return min(failed, key=lambda p: (terminated(p) or {}).get("finishedAt") or "~", default=None)


def pending_reason(pods: list[Obj]) -> str | None:
    """Why a pod has not started, when Kubernetes says (unschedulable, an image it cannot pull), else None."""
    for pod in pods:
        if pod_phase(pod) != "Pending":
            continue
        scheduled = next(
            (c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"),
            {},
        )
        if scheduled.get("status") == "False" and scheduled.get("reason"):
            return f"{scheduled['reason']}: {scheduled.get('message', '')}".strip(": ")
        waiting = (_container(pod).get("state") or {}).get("waiting") or {}
        if waiting.get("reason") not in (None, "ContainerCreating", "PodInitializing"):
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
    return None


def segment_state(
    job: Obj | None,
    pods: list[Obj],
    *,
    deleted_by_us: bool,
    nodes_gone: Iterable[str] = (),
    stop_signal: int = 15,
) -> SegmentState:
    """Where the segment stands, from its Job (None once deleted) and its pods.

    With `backoffLimit: 0` one failed pod fails the Job, so the first failed pod ends the segment without
    waiting for the Job controller to say so. A Job that vanished, or is being deleted with no pod left
    running, is finished: by us (its pods' exit, or the signal we sent), or from outside (an outside stop).
    """
    name = (job or {}).get("metadata", {}).get("name") if job else None
    failed = _first_failed(pods)
    if failed is not None:
        cause, evidence = pod_cause(failed, nodes_gone)
        if deleted_by_us and cause is None:  # the exit our own delete caused is no fault of the pod
            evidence = {}
        return SegmentState("finished", pod_returncode(failed), cause, {"k8s_job": name, **evidence})
    running = [p for p in pods if pod_phase(p) in ("Running", "Pending") and terminated(p) is None]
    conditions = _conditions(job) if job is not None else {}
    deleting = job is None or bool((job.get("metadata") or {}).get("deletionTimestamp"))
    completions = ((job or {}).get("spec") or {}).get("completions") or 1
    succeeded = [p for p in pods if pod_phase(p) == "Succeeded"]
    if "Complete" in conditions or (succeeded and len(succeeded) >= completions and not running):
        return SegmentState("finished", 0, None, {})
    if "Failed" in conditions:
        reason = conditions["Failed"].get("reason", "")
        return SegmentState("finished", 1, None, {"k8s_job": name, "k8s_job_reason": reason})
    if deleting and not running:
        ended = [p for p in pods if terminated(p) is not None]
        code = pod_returncode(ended[0]) if ended else -stop_signal
        if deleted_by_us:
            return SegmentState("finished", code, None, {})
        return SegmentState("finished", code, OUTSIDE_STOP, {"k8s_job": name, "kind": "outside_delete"})
    if any(pod_phase(p) == "Running" for p in pods):
        return SegmentState("running")
    return SegmentState("pending")
