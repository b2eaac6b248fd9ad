"""A local stand-in for the Kubernetes API: the Job, Pod, log, Service and Node calls the launcher makes, with
the documented JSON shapes, on 127.0.0.1. No cluster can run here; this is the one stand-in the project allows.

It plays the Job controller's part too: creating a Job creates its pods (one per completion index, Pending),
a failed pod fails the Job (backoffLimit 0), all pods succeeded completes it, and deleting a Job removes it
with its pods. Tests move pods along with `run_pod`, `log`, `end_pod` and `remove_node`.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

INDEX = "batch.kubernetes.io/job-completion-index"


def _stamp() -> str:
    """Now in RFC3339Nano, trailing zeros of the fraction trimmed (Go's time.RFC3339Nano)."""
    now = time.time_ns()
    whole = datetime.fromtimestamp(now // 10**9, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{now % 10**9:09d}".rstrip("0")
    return f"{whole}.{fraction}Z" if fraction else f"{whole}Z"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }  # fmt: skip


class Cluster:
    """The stand-in's objects: Jobs, pods, Services, nodes and logs, and every request it answered."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[tuple[str, str], dict] = {}
        self.pods: dict[tuple[str, str], dict] = {}
        self.services: dict[tuple[str, str], dict] = {}
        self.nodes: set[str] = {"node-a", "node-b"}
        self.logs: dict[str, list[tuple[str, float, bytearray]]] = {}  # per pod: (stamp, time, line so far)
        self.streams_dropped = 0  # bumped by drop_streams(): open log streams end, as when the API restarts
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, body)
        self.forbidden: set[str] = set()  # namespaces where our service account may not create Jobs (RBAC)
        self.closed = threading.Event()  # set on shutdown: open log streams end

    # -- what tests do to the objects --------------------------------------------------------------
    def pods_of(self, job: str) -> list[str]:
        with self.lock:
            return sorted(
                p["metadata"]["name"]
                for p in self.pods.values()
                if p["metadata"]["labels"].get("job-name") == job
            )

    def run_pod(self, pod: str, node: str = "node-a") -> None:
        with self.lock:
            obj = self._pod(pod)
            obj["spec"]["nodeName"] = node
            obj["status"].update(
                phase="Running",
                startTime=_now(),
                containerStatuses=[self._container(obj, {"running": {"startedAt": _now()}})],
            )

    def log(self, pod: str, text: str) -> None:
        """Append `text` to the pod's log; each line is stamped when it starts, as the kubelet stamps it."""
        with self.lock:
            entries = self.logs.setdefault(pod, [])
            for piece in text.encode().splitlines(keepends=True):
                if entries and not entries[-1][2].endswith(b"\n"):
                    entries[-1][2].extend(piece)
                else:
                    entries.append((_stamp(), time.time(), bytearray(piece)))

    def drop_streams(self) -> None:
        """End every open log stream (an API server restart, a load balancer's idle timeout)."""
        with self.lock:
            self.streams_dropped += 1

    def rendered_log(self, pod: str, *, timestamps: bool, since: float | None) -> bytes:
        """The log as the API returns it: lines since `since` (epoch seconds), stamped if asked."""
        out = bytearray()
        for stamp, at, line in self.logs.get(pod, []):
            if since is None or at >= since:
                out += (stamp.encode() + b" " if timestamps else b"") + line
        return bytes(out)

    def end_pod(
        self, pod: str, exit_code: int | None, *, reason: str = "Error", pod_reason: str | None = None,
        disruption: str | None = None,
    ) -> None:  # fmt: skip
        """The pod's container ends with `exit_code` and `reason` (None: it never ran); `pod_reason` (e.g.
        Evicted, NodeLost) and a `DisruptionTarget` condition with reason `disruption` as Kubernetes sets them."""
        with self.lock:
            obj = self._pod(pod)
            failed = exit_code != 0 or pod_reason is not None or disruption is not None
            status = obj["status"]
            status["phase"] = "Failed" if failed else "Succeeded"
            if exit_code is not None:
                state = {"terminated": {"exitCode": exit_code, "reason": reason if failed else "Completed",
                                        "startedAt": status.get("startTime", _now()), "finishedAt": _now()}}  # fmt: skip
                status["containerStatuses"] = [self._container(obj, state)]
            if pod_reason is not None:
                status["reason"] = pod_reason
                status["message"] = f"the pod was {pod_reason}"
            if disruption is not None:
                status.setdefault("conditions", []).append(
                    {
                        "type": "DisruptionTarget",
                        "status": "True",
                        "reason": disruption,
                        "message": f"{disruption} (stand-in)",
                        "lastTransitionTime": _now(),
                    }  # fmt: skip
                )
            self._controller(obj["metadata"]["labels"]["job-name"], obj["metadata"]["namespace"])

    def remove_node(self, node: str) -> None:
        with self.lock:
            self.nodes.discard(node)

    # -- the Job controller's part ------------------------------------------------------------------
    def _pod(self, name: str) -> dict:
        (obj,) = [p for (ns, n), p in self.pods.items() if n == name]
        return obj

    @staticmethod
    def _container(pod: dict, state: dict) -> dict:
        container = pod["spec"]["containers"][0]
        return {
            "name": container["name"], "image": container["image"], "imageID": "", "ready": "running" in state,
            "restartCount": 0, "state": state,
        }  # fmt: skip

    def _controller(self, job: str, namespace: str) -> None:
        obj = self.jobs.get((namespace, job))
        if obj is None:
            return
        pods = [p for p in self.pods.values() if p["metadata"]["labels"].get("job-name") == job]
        failed = sum(p["status"]["phase"] == "Failed" for p in pods)
        succeeded = sum(p["status"]["phase"] == "Succeeded" for p in pods)
        status = obj["status"]
        status.update(failed=failed, succeeded=succeeded, active=len(pods) - failed - succeeded)
        if failed > obj["spec"].get("backoffLimit", 6):
            status["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "message": "Job has reached the specified backoff limit", "lastTransitionTime": _now()}]  # fmt: skip
        elif succeeded >= obj["spec"].get("completions", 1):
            status["conditions"] = [{"type": "Complete", "status": "True", "lastTransitionTime": _now()}]
            status["completionTime"] = _now()

    def create_job(self, namespace: str, body: dict) -> tuple[int, dict]:
        name = body["metadata"]["name"]
        if namespace in self.forbidden:
            message = f'jobs.batch is forbidden: User "system:serviceaccount:{namespace}:default" cannot create resource "jobs" in API group "batch" in the namespace "{namespace}"'
            return 403, _status(403, "Forbidden", message)
        if (namespace, name) in self.jobs:
            return 409, _status(409, "AlreadyExists", f'jobs.batch "{name}" already exists')
        if not body["spec"]["template"]["spec"].get("containers"):
            return 422, _status(
                422,
                "Invalid",
                f'Job.batch "{name}" is invalid: spec.template.spec.containers: Required value',
            )
        job = copy.deepcopy(body)
        uid = str(uuid.uuid4())
        job["metadata"].update(namespace=namespace, uid=uid, creationTimestamp=_now(), resourceVersion="1")
        job["status"] = {"startTime": _now(), "active": 0}
        self.jobs[(namespace, name)] = job
        template = job["spec"]["template"]
        for index in range(job["spec"].get("completions", 1)):
            pod_name = f"{name}-{index}-{uuid.uuid4().hex[:5]}"
            labels = {
                **template["metadata"].get("labels", {}),
                "job-name": name,
                "batch.kubernetes.io/job-name": name,
                INDEX: str(index),
            }
            spec = copy.deepcopy(template["spec"])
            spec["hostname"] = f"{name}-{index}"
            self.pods[(namespace, pod_name)] = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": namespace, "labels": labels, "annotations": {INDEX: str(index)},
                             "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                             "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "controller": True}]},
                "spec": spec,
                "status": {"phase": "Pending", "conditions": []},
            }  # fmt: skip
        self._controller(name, namespace)
        return 201, job

    def delete_job(self, namespace: str, name: str) -> tuple[int, dict]:
        job = self.jobs.pop((namespace, name), None)
        if job is None:
            return 404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
        for key in [k for k, p in self.pods.items() if p["metadata"]["labels"].get("job-name") == name]:
            del self.pods[key]
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": {"name": name, "group": "batch", "kind": "jobs", "uid": job["metadata"]["uid"]}}  # fmt: skip


def _matches(labels: dict, selector: str) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class _Handler(BaseHTTPRequestHandler):
    cluster: Cluster

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(length) or b"{}") if length else {}

    def _route(self, method: str) -> None:
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")
        body = self._body() if method in ("POST", "DELETE") else {}
        c = self.cluster
        with c.lock:
            c.requests.append((method, url.path, body or query))
        match method, parts:
            case "POST", ["apis", "batch", "v1", "namespaces", ns, "jobs"]:
                with c.lock:
                    self._send(*c.create_job(ns, body))
            case "GET", ["apis", "batch", "v1", "namespaces", ns, "jobs", name]:
                with c.lock:
                    job = copy.deepcopy(c.jobs.get((ns, name)))
                self._send(200, job) if job else self._send(
                    404, _status(404, "NotFound", f'jobs.batch "{name}" not found')
                )
            case "DELETE", ["apis", "batch", "v1", "namespaces", ns, "jobs", name]:
                with c.lock:
                    self._send(*c.delete_job(ns, name))
            case "GET", ["api", "v1", "namespaces", ns, "pods"]:
                selector = query.get("labelSelector", "")
                with c.lock:
                    items = [
                        copy.deepcopy(p)
                        for (n, _), p in sorted(c.pods.items())
                        if n == ns and _matches(p["metadata"]["labels"], selector)
                    ]
                self._send(
                    200,
                    {
                        "kind": "PodList",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": "1"},
                        "items": items,
                    },
                )
            case "GET", ["api", "v1", "namespaces", ns, "pods", name, "log"]:
                self._log(ns, name, query)
            case "POST", ["api", "v1", "namespaces", ns, "services"]:
                with c.lock:
                    service = {**copy.deepcopy(body), "status": {"loadBalancer": {}}}
                    service["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
                    c.services[(ns, body["metadata"]["name"])] = service
                self._send(201, service)
            case "DELETE", ["api", "v1", "namespaces", ns, "services", name]:
                with c.lock:
                    gone = c.services.pop((ns, name), None)
                if gone is None:
                    self._send(404, _status(404, "NotFound", f'services "{name}" not found'))
                else:
                    self._send(
                        200,
                        gone,  # a Service delete answers with the Service, as the API does
                    )
            case "GET", ["api", "v1", "nodes", name]:
                with c.lock:
                    exists = name in c.nodes
                if exists:
                    self._send(200, {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name}})
                else:
                    self._send(404, _status(404, "NotFound", f'nodes "{name}" not found'))
            case _:
                self._send(404, _status(404, "NotFound", f"the stand-in does not serve {method} {url.path}"))

    def _log(self, namespace: str, name: str, query: dict[str, str]) -> None:
        """The pod's log: all of it, or (follow) streamed until the container ends or the pod is deleted;
        `timestamps` and `sinceSeconds` as the API reads them."""
        c = self.cluster
        timestamps = query.get("timestamps") == "true"
        since = time.time() - int(query["sinceSeconds"]) if "sinceSeconds" in query else None
        with c.lock:
            pod = c.pods.get((namespace, name))
            generation = c.streams_dropped
        if pod is None:
            self._send(404, _status(404, "NotFound", f'pods "{name}" not found'))
            return
        if query.get("follow") != "true":
            with c.lock:
                self._send(200, c.rendered_log(name, timestamps=timestamps, since=since), "text/plain")
            return
        self.send_response(200)  # HTTP/1.0: no length, the body ends when the connection closes
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        sent = 0
        while True:
            with c.lock:
                data = c.rendered_log(name, timestamps=timestamps, since=since)  # grows only at its end
                live = c.pods.get((namespace, name))
                ended = live is None or live["status"]["phase"] in ("Succeeded", "Failed")
                dropped = c.closed.is_set() or c.streams_dropped != generation
            if dropped:
                return
            if len(data) > sent:
                self.wfile.write(data[sent:])
                self.wfile.flush()
                sent = len(data)
            elif ended:
                return
            time.sleep(0.02)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_DELETE(self) -> None:
        self._route("DELETE")


@contextmanager
def k8s_api_server() -> Iterator[tuple[str, Cluster]]:
    """Serve a fresh stand-in on a free port of 127.0.0.1; yields (its URL, its Cluster); stops it after."""
    cluster = Cluster()
    handler = type("Handler", (_Handler,), {"cluster": cluster})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="k8s-api-stand-in", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", cluster
    finally:
        cluster.closed.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
