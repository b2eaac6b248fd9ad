"""A local metadata server speaking the documented AWS, GCP and Azure preemption-notice formats."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MetadataState:
    """What the fake metadata service currently says; tests flip it while a poller runs."""

    def __init__(self) -> None:
        self.aws_action: dict[str, Any] | None = None
        self.aws_require_token = True
        self.gcp_preempted = False
        self.azure_events: list[dict[str, Any]] = []
        self.aws_tokens_enabled = True
        self.fail_with: int | None = None  # answer every GET with this status (an unhealthy service)
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.token = "AQAEAFakeTokenForTests=="
        self._served = threading.Condition()

    def record(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self._served:
            self.requests.append((method, path, headers))
            self._served.notify_all()

    def wait_requests(self, count: int, timeout: float = 10.0) -> bool:
        """Block until at least `count` requests have been served in total."""
        with self._served:
            return self._served.wait_for(lambda: len(self.requests) >= count, timeout)


class _Handler(BaseHTTPRequestHandler):
    state: MetadataState

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: str = "", content_type: str = "text/plain") -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        self.state.record("PUT", self.path, dict(self.headers))
        if not self.state.aws_tokens_enabled:
            return self._send(403, "Forbidden")
        # IMDSv2: the token needs the TTL header; without it AWS answers 400.
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            return self._send(200, self.state.token)
        return self._send(400, "Bad Request")

    def do_GET(self) -> None:
        s = self.state
        s.record("GET", self.path, dict(self.headers))
        if s.fail_with is not None:
            return self._send(s.fail_with, "Service Unavailable")
        if self.path == "/latest/meta-data/spot/instance-action":
            if s.aws_require_token and self.headers.get("X-aws-ec2-metadata-token") != s.token:
                return self._send(401, "Unauthorized")
            if s.aws_action is None:
                return self._send(404, "Not Found")
            return self._send(200, json.dumps(s.aws_action), "text/plain")
        if self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            return self._send(200, "TRUE" if s.gcp_preempted else "FALSE", "application/text")
        if self.path == "/metadata/scheduledevents?api-version=2020-07-01":
            if self.headers.get("Metadata") != "true":
                return self._send(
                    400, json.dumps({"error": "Bad request. Required metadata header not specified"})
                )
            doc = {"DocumentIncarnation": len(s.azure_events), "Events": s.azure_events}
            return self._send(200, json.dumps(doc), "application/json")
        return self._send(404, "Not Found")


class MetadataServer:
    """Serves on 127.0.0.1 from a thread; `stop()` shuts it down and frees the port."""

    def __init__(self) -> None:
        self.state = MetadataState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> MetadataServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
