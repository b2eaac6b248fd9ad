"""The Kubernetes launcher: each segment an Indexed Job (and, for several nodes, a headless Service), watched
by polling the Job and its pods, its pods' logs followed, stopped by deleting the Job.

Kubernetes cannot send a chosen signal: a stop deletes the Job with a grace period (the pods get SIGTERM, then
SIGKILL after the grace), so the training must write its emergency checkpoint on SIGTERM. Pods merge stdout
and stderr into one log, which is streamed as "stdout" and given whole to the log classifier as both tails.
A pod's end becomes `ExitInfo.cause` by the rules in kubernetes_states.py. The supervisor's workdir (plan,
heartbeat) and checkpoints must be on storage the pods share (a ReadWriteMany volume, or object storage).
The spec's `cwd` and the supervisor's own environment do not reach the pods: the policy's `working_dir` and
`env` (with the plan's variables) do.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from policies.launcher_schema import KubernetesSpec
from supervisor.errors import SupervisorError, UserError
from supervisor.launcher.base import ExitInfo, LaunchSpec, OnLine
from supervisor.launcher.kubernetes_api import api_client, client_module, to_dict
from supervisor.launcher.kubernetes_manifests import (
    CONTAINER,
    JOB_LABEL,
    SEGMENT_LABEL,
    job_manifest,
    job_name,
    label_value,
    service_manifest,
)
from supervisor.launcher.kubernetes_states import (
    SegmentState,
    pending_reason,
    pod_node,
    pod_phase,
    segment_state,
    terminated,
)
from supervisor.lineage.exclusions import HostPool

log = logging.getLogger("rollback_supervisor.launcher")

#: Seconds one API call may take (logs are streamed without a limit).
REQUEST_TIMEOUT_SECONDS = 30.0
#: Lines of output kept for the exit's tails.
TAIL_LINES = 200
#: Seconds to wait for the log streams to drain once the segment has ended.
LOG_DRAIN_SECONDS = 10.0


class KubernetesError(SupervisorError):
    """The Kubernetes API failed (unreachable, or an error that is not the request's fault)."""


def _api_exception() -> type[Exception]:
    return client_module().exceptions.ApiException


class KubernetesLauncher:
    """Starts each segment as a Kubernetes Job (see module docstring); one per lineage runner."""

    def __init__(
        self,
        options: KubernetesSpec,
        *,
        api: Any = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if options.image is None:
            raise UserError("kubernetes launcher: launcher.kubernetes.image is required (the training image)")
        self.options = options
        self.clock = clock
        self.sleep = sleep
        self._api = api

    @property
    def api(self) -> Any:
        """The ApiClient, from the kubeconfig or the pod's service account on first use."""
        if self._api is None:
            self._api = api_client(self.options.kubeconfig, self.options.context)
        return self._api

    @property
    def batch(self) -> Any:
        return client_module().BatchV1Api(self.api)

    @property
    def core(self) -> Any:
        return client_module().CoreV1Api(self.api)

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> KubernetesJob:
        name = job_name(spec.name or "segment", uuid.uuid4().hex[:6])
        namespace = self.options.namespace
        ApiException = _api_exception()
        try:
            if self.options.nodes > 1:
                self.core.create_namespaced_service(
                    namespace,
                    service_manifest(self.options, spec, name),
                    _request_timeout=REQUEST_TIMEOUT_SECONDS,
                )
            self.batch.create_namespaced_job(
                namespace, job_manifest(self.options, spec, name), _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except ApiException as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                raise UserError(
                    f"kubernetes launcher: the API refused Job {name} in namespace {namespace} "
                    f"({exc.status} {exc.reason}: {str(exc.body)[-300:]}); check launcher.kubernetes"
                ) from None
            raise KubernetesError(f"creating Job {name} failed: {exc}") from exc
        log.info("created Kubernetes Job %s/%s (%s)", namespace, name, spec.name)
        if spec.exclude_hosts:
            log.warning(
                "Kubernetes Job %s: its pods avoid the excluded nodes %s", name, ", ".join(spec.exclude_hosts)
            )
        return KubernetesJob(self, name, segment=spec.name or name, on_line=on_line)

    def read_job(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The Job as JSON, or None if it does not exist."""
        try:
            job = self.batch.read_namespaced_job(
                name, namespace or self.options.namespace, _request_timeout=REQUEST_TIMEOUT_SECONDS
            )
        except _api_exception() as exc:
            if exc.status == 404:
                return None
            raise
        return to_dict(self.api, job)

    def list_pods(self, name: str) -> list[dict[str, Any]]:
        found = self.core.list_namespaced_pod(
            self.options.namespace,
            label_selector=f"{JOB_LABEL}={name}",
            _request_timeout=REQUEST_TIMEOUT_SECONDS,
        )
        return [to_dict(self.api, pod) for pod in found.items]

    def host_pool(self) -> HostPool:
        """The nodes the policy's node selector allows, of which a segment needs `nodes`; unknown (None) where
        the service account may not list nodes (examples/kubernetes/rbac.yaml grants get, not list)."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.options.node_selector.items())) or None
        try:
            found = self.core.list_node(label_selector=selector, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except Exception as exc:  # forbidden, or unreachable: the scheduler's placement is the only guard
            log.warning("cannot list the cluster's nodes (%s); an exclusion is taken as named", exc)
            return HostPool(self.options.nodes, None)
        names = tuple(node.metadata.name for node in found.items)
        return HostPool(self.options.nodes, names, f"{len(names)} node(s) match the node selector")

    def node_exists(self, node: str) -> bool:
        try:
            self.core.read_node(node, _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except _api_exception() as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def delete(self, name: str, grace_seconds: int, namespace: str | None = None, *, service: bool) -> None:
        """Delete the Job (its pods first: Foreground) with this grace, and its Service; gone already is fine."""
        namespace = namespace or self.options.namespace
        body = client_module().V1DeleteOptions(
            grace_period_seconds=grace_seconds, propagation_policy="Foreground"
        )
        calls = [lambda: self.batch.delete_namespaced_job(name, namespace, body=body)]
        if service:
            calls.append(lambda: self.core.delete_namespaced_service(name, namespace))
        for call in calls:
            try:
                call()
            except _api_exception() as exc:
                if exc.status != 404:
                    raise

    def reclaim(self, details: Mapping[str, Any]) -> None:
        """Delete the Job a vanished supervisor left, if it still runs with the recorded segment label."""
        name, namespace = details.get("k8s_job"), details.get("k8s_namespace") or self.options.namespace
        if not name:
            return
        job = self.read_job(str(name), str(namespace))
        index = details.get("index")
        if job is None:
            log.info("segment %s: Kubernetes Job %s is gone; nothing to delete", index, name)
            return
        labels = (job.get("metadata") or {}).get("labels") or {}
        if labels.get(SEGMENT_LABEL) != label_value(str(details.get("k8s_segment", ""))):
            log.info("segment %s: Kubernetes Job %s runs another segment; left alone", index, name)
            return
        conditions = {
            c.get("type")
            for c in (job.get("status") or {}).get("conditions") or []
            if c.get("status") == "True"
        }
        if conditions & {"Complete", "Failed"}:
            log.info("segment %s: Kubernetes Job %s already finished; nothing to delete", index, name)
            return
        self.delete(str(name), self.options.termination_grace_seconds, str(namespace), service=True)
        log.warning("deleted stale Kubernetes Job %s/%s of segment %s", namespace, name, index)


def stamp_key(stamp: str) -> tuple[str, int]:
    """An RFC3339Nano stamp as a sortable key (Go trims the fraction's trailing zeros, so text does not sort)."""
    whole, _, fraction = stamp.rstrip("Z").partition(".")
    return whole, int(fraction.ljust(9, "0")[:9] or 0)


class _LogFollower:
    """Streams one pod's log (`follow=true`) to `sink` on a thread until `ended()`; a stream that breaks while
    the pod runs is opened again from a little before its last line, and the lines already seen (by their
    timestamps) are skipped, so nothing is lost or repeated."""

    def __init__(
        self,
        launcher: KubernetesLauncher,
        pod: str,
        prefix: str,
        sink: Callable[[str], None],
        ended: Callable[[], bool],
    ):
        self.launcher, self.pod, self.prefix, self.sink, self.ended = launcher, pod, prefix, sink, ended
        self._last: tuple[str, int] | None = None  # the newest line's stamp
        self._last_at = 0.0  # when it came (monotonic): how far back a reconnect must read
        self.thread = threading.Thread(target=self._run, name=f"k8s-log-{pod}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._stream()
            except Exception as exc:  # a lost stream is opened again below; it never ends the segment
                log.warning("log of pod %s: stream broke (%s)", self.pod, exc)
            if self.ended():
                return
            time.sleep(self.launcher.options.poll_seconds)

    def _stream(self) -> None:
        since = None if self._last is None else int(time.monotonic() - self._last_at) + 5
        response = self.launcher.core.read_namespaced_pod_log(
            self.pod,
            self.launcher.options.namespace,
            container=CONTAINER,
            follow=True,
            timestamps=True,
            since_seconds=since,
            _preload_content=False,
        )
        pending = b""
        try:
            while chunk := response.read1(65536):  # what has arrived, not a full buffer: lines as they come
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self._emit(line)
            if pending:  # the stream ended inside a line (the container's last output had no newline)
                self._emit(pending)
        finally:
            response.release_conn()

    def _emit(self, raw: bytes) -> None:
        stamp, _, text = raw.decode(errors="replace").rstrip("\r").partition(" ")
        key = stamp_key(stamp)
        if self._last is not None and key <= self._last:
            return  # read again after a reconnect
        self._last, self._last_at = key, time.monotonic()
        self.sink(self.prefix + text)


def _ignore(stream: str, line: str) -> None:
    """The output sink when nobody listens."""


class KubernetesJob:
    """One segment as a Kubernetes Job. `stop()` may be called from any thread; everything else from the owner."""

    def __init__(self, launcher: KubernetesLauncher, name: str, *, segment: str, on_line: OnLine | None):
        self.launcher = launcher
        self.name = name
        self.segment = segment
        self.options = launcher.options
        self._on_line = on_line or _ignore
        self._t0 = launcher.clock()
        self._signal_sent: int | None = None
        self._deleted = False  # we deleted the Job: its end is ours, not an outside stop
        self._pod_signal = signal.SIGTERM  # what Kubernetes sends on our delete: TERM, or KILL with no grace
        self._state = SegmentState("pending")
        self._followers: dict[str, _LogFollower] = {}
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        self._follow_lock = threading.Lock()  # stop() refreshes from another thread: one stream per pod
        self._waiting: str | None = None  # the last reason given for not starting, logged once
        self._ended_pods: set[str] = set()  # pods whose container has ended, as last read
        self._nodes: set[str] = set()  # the nodes its pods were placed on, as read so far

    @property
    def handle_id(self) -> str:
        return self.name

    def details(self) -> dict[str, Any]:
        return {"k8s_job": self.name, "k8s_namespace": self.options.namespace, "k8s_segment": self.segment}

    def _line(self, line: str) -> None:
        with self._lock:
            self._tail.append(line)
        self._on_line("stdout", line)

    def _follow(self, pods: list[dict[str, Any]]) -> None:
        """Start a log stream for each pod that has started (running, or already ended)."""
        for pod in pods:
            name = pod["metadata"]["name"]
            if name in self._followers or (pod_phase(pod) == "Pending" and terminated(pod) is None):
                continue
            index = (pod["metadata"].get("annotations") or {}).get(
                "batch.kubernetes.io/job-completion-index", "0"
            )
            prefix = f"[node {index}] " if self.options.nodes > 1 else ""
            self._followers[name] = _LogFollower(
                self.launcher, name, prefix, self._line, lambda name=name: self._pod_ended(name)
            )

    def _pod_ended(self, pod: str) -> bool:
        """Whether the pod's log is complete: its container ended, or the segment is over."""
        return self._state.finished or pod in self._ended_pods

    def refresh(self) -> SegmentState:
        """Read the Job and its pods; while the API does not answer, the last state read stands."""
        launcher = self.launcher
        try:
            job = launcher.read_job(self.name)
            pods = launcher.list_pods(self.name)
            gone = {
                node
                for pod in pods
                if (pod.get("status") or {}).get("reason") == "Evicted"
                and (node := (pod.get("spec") or {}).get("nodeName"))
                and not launcher.node_exists(node)
            }
        except Exception as exc:  # ApiException, or the connection: ask again next time
            log.warning("Kubernetes Job %s: cannot read its state (%s); asking again", self.name, exc)
            return self._state
        with self._follow_lock:
            self._follow(pods)
        self._ended_pods = {p["metadata"]["name"] for p in pods if terminated(p) is not None}
        self._nodes |= {node for pod in pods if (node := pod_node(pod))}
        waiting = pending_reason(pods)
        if waiting and waiting != self._waiting:  # e.g. no node fits, or the image cannot be pulled
            log.warning("Kubernetes Job %s waits to start: %s", self.name, waiting)
        self._waiting = waiting
        self._state = segment_state(
            job,
            pods,
            deleted_by_us=self._deleted,
            nodes_gone=gone,
            stop_signal=self._pod_signal,
        )
        return self._state

    def started(self) -> bool:
        return self.refresh().phase != "pending"

    def poll(self) -> int | None:
        state = self.refresh()
        return state.returncode if state.finished else None

    def wait_exit(self, timeout: float) -> int | None:
        deadline = self.launcher.clock() + timeout
        while True:
            code = self.poll()
            if code is not None or self.launcher.clock() >= deadline:
                return code
            self.launcher.sleep(min(self.options.poll_seconds, max(0.0, deadline - self.launcher.clock())))

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        """Delete the Job with `grace_seconds` (its pods get SIGTERM, then SIGKILL); whatever `sig` asked for,
        Kubernetes sends SIGTERM. If it is still there after the grace, delete it again with none."""
        if self.poll() is not None:
            return
        self._signal_sent, self._deleted = sig, True
        if sig != signal.SIGTERM:
            log.info(
                "Kubernetes sends SIGTERM, not %s, to the pods of Job %s", signal.Signals(sig).name, self.name
            )
        log.info("stopping Kubernetes Job %s (grace %.0fs)", self.name, grace_seconds)
        self.launcher.delete(self.name, int(grace_seconds), service=self.options.nodes > 1)
        if self.wait_exit(grace_seconds + self.options.poll_seconds) is None:
            log.warning(
                "Kubernetes Job %s still there after %.0fs; deleting it with no grace",
                self.name,
                grace_seconds,
            )
            self.launcher.delete(self.name, 0, service=self.options.nodes > 1)

    def kill(self) -> None:
        """Delete the Job with no grace, recorded as sent by us."""
        self._signal_sent, self._deleted, self._pod_signal = signal.SIGKILL, True, signal.SIGKILL
        self.launcher.delete(self.name, 0, service=self.options.nodes > 1)

    def wait(self, timeout: float | None = None) -> ExitInfo:
        deadline = None if timeout is None else self.launcher.clock() + timeout
        while self.poll() is None:
            if deadline is not None and self.launcher.clock() >= deadline:
                raise TimeoutError(f"Kubernetes Job {self.name} still running after {timeout}s")
            self.launcher.sleep(self.options.poll_seconds)
        state = self._state
        for follower in self._followers.values():
            follower.thread.join(LOG_DRAIN_SECONDS)
        if (
            not self._deleted and self.options.nodes > 1
        ):  # other nodes' pods may still run; the Service is done
            self.launcher.delete(self.name, self.options.termination_grace_seconds, service=True)
        if state.cause is not None:
            log.warning("Kubernetes Job %s ended: %s (%s)", self.name, state.cause, state.evidence)
        with self._lock:
            tail = "\n".join(self._tail)
        return ExitInfo(
            returncode=state.returncode if state.returncode is not None else 1,
            stderr_tail=tail,
            stdout_tail=tail,
            signal_sent=self._signal_sent,
            handle_id=self.name,
            duration_s=self.launcher.clock() - self._t0,
            cause=state.cause,
            cause_evidence=state.evidence,
            hosts=tuple(sorted(self._nodes)),
        )


def kubernetes_launcher(spec: KubernetesSpec) -> KubernetesLauncher:
    """The launcher for the policy's `launcher.kubernetes` section; the client is imported now, if missing a
    UserError names the extra."""
    client_module()
    return KubernetesLauncher(spec)
