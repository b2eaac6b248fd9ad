"""Preemption-notice pollers for AWS spot, GCP preemptible/spot and Azure Scheduled Events metadata."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from supervisor.errors import SupervisorError, UserError

if TYPE_CHECKING:  # requests is imported when a poller is built: the training side rarely needs it
    import requests

log = logging.getLogger("rollback_supervisor.monitor")

#: Documented link-local metadata endpoints; tests and unusual setups pass their own.
DEFAULT_ENDPOINTS = {
    "aws": "http://169.254.169.254",
    "gcp": "http://metadata.google.internal",
    "azure": "http://169.254.169.254",
}
#: Azure event types after which the VM is gone.
AZURE_NOTICE_TYPES = frozenset({"Preempt", "Terminate"})
_AWS_TOKEN_TTL = 21600


class NoticeError(UserError):
    """An unknown provider was named."""


class NoticeUnavailable(SupervisorError):
    """The metadata endpoint could not be asked (unreachable, timed out, or an unexpected answer)."""


@dataclass(frozen=True)
class Notice:
    """A preemption notice: who sent it, what will happen, when (ISO 8601 when the provider says), raw detail."""

    provider: str
    action: str
    time: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def _get(session: requests.Session, url: str, headers: dict[str, str], timeout: float) -> requests.Response:
    import requests

    try:
        return session.get(url, headers=headers, timeout=timeout)
    except requests.RequestException as exc:
        raise NoticeUnavailable(f"{url}: {type(exc).__name__}: {exc}") from exc


def _unexpected(resp: requests.Response) -> NoticeUnavailable:
    return NoticeUnavailable(f"{resp.url}: expected 200 or 404, got {resp.status_code} {resp.text[:200]!r}")


class _Aws:
    """IMDSv2 first (PUT a session token), then IMDSv1 if the token call is refused."""

    def __init__(self) -> None:
        self._token: str | None = None
        self._expires = 0.0

    def _token_for(self, session: requests.Session, endpoint: str, timeout: float) -> str | None:
        if self._token and time.monotonic() < self._expires:
            return self._token
        import requests

        try:
            resp = session.put(
                f"{endpoint}/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": str(_AWS_TOKEN_TTL)},
                timeout=timeout,
            )
        except requests.RequestException as exc:
            raise NoticeUnavailable(f"{endpoint}/latest/api/token: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            return None
        self._token, self._expires = resp.text.strip(), time.monotonic() + _AWS_TOKEN_TTL / 2
        return self._token

    def poll(self, session: requests.Session, endpoint: str, timeout: float) -> Notice | None:
        token = self._token_for(session, endpoint, timeout)
        headers = {"X-aws-ec2-metadata-token": token} if token else {}
        resp = _get(session, f"{endpoint}/latest/meta-data/spot/instance-action", headers, timeout)
        if resp.status_code == 401 and token:
            self._token = None  # expired or revoked; fetch a new one next time
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise _unexpected(resp)
        try:
            body = resp.json()
            return Notice("aws", str(body["action"]), body.get("time"), body)
        except (ValueError, KeyError, TypeError) as exc:
            raise NoticeUnavailable(
                f"{resp.url}: expected JSON with 'action', got {resp.text[:200]!r}"
            ) from exc


class _Gcp:
    def poll(self, session: requests.Session, endpoint: str, timeout: float) -> Notice | None:
        url = f"{endpoint}/computeMetadata/v1/instance/preempted"
        resp = _get(session, url, {"Metadata-Flavor": "Google"}, timeout)
        if resp.status_code != 200:
            raise _unexpected(resp)
        text = resp.text.strip().upper()
        if text == "FALSE":
            return None
        if text == "TRUE":
            return Notice("gcp", "preempted", None, {"preempted": True})
        raise NoticeUnavailable(f"{url}: expected TRUE or FALSE, got {resp.text[:200]!r}")


class _Azure:
    def poll(self, session: requests.Session, endpoint: str, timeout: float) -> Notice | None:
        url = f"{endpoint}/metadata/scheduledevents?api-version=2020-07-01"
        resp = _get(session, url, {"Metadata": "true"}, timeout)
        if resp.status_code != 200:
            raise _unexpected(resp)
        try:
            events = resp.json().get("Events") or []
        except (ValueError, AttributeError) as exc:
            raise NoticeUnavailable(
                f"{url}: expected Scheduled Events JSON, got {resp.text[:200]!r}"
            ) from exc
        for event in events:
            if isinstance(event, dict) and event.get("EventType") in AZURE_NOTICE_TYPES:
                return Notice("azure", str(event["EventType"]).lower(), event.get("NotBefore") or None, event)
        return None


_PROVIDERS: dict[str, type] = {"aws": _Aws, "gcp": _Gcp, "azure": _Azure}


class NoticePoller:
    """Asks one provider's metadata service for a preemption notice; keeps the AWS token between polls."""

    def __init__(self, provider: str, endpoint: str | None = None, timeout: float = 1.0):
        if provider not in _PROVIDERS:
            raise NoticeError(f"notice provider: expected one of {', '.join(_PROVIDERS)}, got {provider!r}")
        self.provider = provider
        self.endpoint = (endpoint or DEFAULT_ENDPOINTS[provider]).rstrip("/")
        self.timeout = timeout
        self._impl = _PROVIDERS[provider]()
        import requests

        self._session = requests.Session()
        self._session.trust_env = False  # a proxy must never sit between us and link-local metadata

    def poll(self) -> Notice | None:
        """The current notice, or None; raises NoticeUnavailable when the endpoint cannot answer."""
        return self._impl.poll(self._session, self.endpoint, self.timeout)

    def close(self) -> None:
        self._session.close()


def poll_notice(provider: str, endpoint: str | None = None, timeout: float = 1.0) -> Notice | None:
    """One-shot poll of `provider`'s metadata endpoint."""
    poller = NoticePoller(provider, endpoint, timeout)
    try:
        return poller.poll()
    finally:
        poller.close()


class NoticeWatcher:
    """Polls for a notice on a thread and calls `on_notice` once per distinct notice; `stop()` joins it."""

    def __init__(
        self,
        provider: str,
        on_notice: Callable[[Notice], None],
        *,
        endpoint: str | None = None,
        interval: float = 5.0,
        timeout: float = 1.0,
    ):
        self._poller = NoticePoller(provider, endpoint, timeout)
        self._on_notice = on_notice
        self.interval = interval
        self._stop = threading.Event()
        self._seen: list[Notice] = []
        self._thread = threading.Thread(target=self._run, name=f"rbs-notice-{provider}", daemon=True)

    def start(self) -> NoticeWatcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        failing = False
        while not self._stop.is_set():
            try:
                notice = self._poller.poll()
                failing = False
            except NoticeUnavailable as exc:
                if not failing:  # one warning per outage, not one per poll
                    log.warning("preemption notices unavailable: %s", exc)
                failing, notice = True, None
            if notice is not None and notice not in self._seen:
                self._seen.append(notice)
                try:
                    self._on_notice(notice)
                except Exception:
                    log.exception("preemption notice callback failed")
            self._stop.wait(self.interval)

    @property
    def notices(self) -> list[Notice]:
        """Every distinct notice seen so far."""
        return list(self._seen)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._poller.close()

    def __enter__(self) -> NoticeWatcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
