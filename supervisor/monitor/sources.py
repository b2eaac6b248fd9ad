"""Paged reads of one run's metric history: over MLflow's REST API, or through its SQL store layer.

Both read `metrics/get-history` pages by offset (MLflow orders a metric's history by timestamp,
step, value and pages it by offset), so a poll reads only the tail it has not seen yet.
"""

from __future__ import annotations

import os
import sys
from typing import Protocol

from supervisor.errors import SupervisorError, UserError

#: A row of history: (step, value, timestamp in ms).
Row = tuple[int, float, int]
_FLOAT_MAX = sys.float_info.max
_SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


class MetricsUnavailable(SupervisorError):
    """The tracking store could not be read right now (down, timing out, locked); try again later."""


class MetricsSourceError(UserError):
    """The tracking store refused the read for a reason retrying will not fix (URI, run id, auth)."""


class HistorySource(Protocol):
    """Reads one page of one metric's history."""

    def page(self, metric: str, offset: int, limit: int) -> tuple[list[Row], bool]:
        """Up to `limit` rows starting at `offset`, and whether more rows follow."""
        ...

    def close(self) -> None: ...


def _value(raw: float | str) -> float:
    value = float(raw)
    # MLflow stores +-inf as +-float max; turn them back so non_finite sees them.
    if value == _FLOAT_MAX:
        return float("inf")
    if value == -_FLOAT_MAX:
        return float("-inf")
    return value


def _token(offset: int) -> str | None:
    from mlflow.utils.search_utils import SearchUtils

    return SearchUtils.create_page_token(offset).decode() if offset else None


class HttpHistory:
    """`GET /api/2.0/mlflow/metrics/get-history` on a reused session with short timeouts and no retries.

    Retrying is the watcher's job (tenacity); MLflow's own client would retry a dead server for minutes.
    """

    def __init__(self, base_url: str, run_id: str, *, timeout: float = 5.0, connect_timeout: float = 2.0):
        self.url = base_url.rstrip("/") + "/api/2.0/mlflow/metrics/get-history"
        self.run_id = run_id
        self.timeout = (connect_timeout, timeout)
        import requests  # here, not at module level: the training side imports this package

        self._errors = requests.RequestException
        self.session = requests.Session()
        token = os.environ.get("MLFLOW_TRACKING_TOKEN")
        user, password = (
            os.environ.get("MLFLOW_TRACKING_USERNAME"),
            os.environ.get("MLFLOW_TRACKING_PASSWORD"),
        )
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"
        elif user and password:
            self.session.auth = (user, password)
        if os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() == "true":
            self.session.verify = False

    def page(self, metric: str, offset: int, limit: int) -> tuple[list[Row], bool]:
        params: dict[str, str | int] = {"run_id": self.run_id, "metric_key": metric, "max_results": limit}
        if (token := _token(offset)) is not None:
            params["page_token"] = token
        try:
            resp = self.session.get(self.url, params=params, timeout=self.timeout)
        except self._errors as exc:
            raise MetricsUnavailable(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        if resp.status_code >= 500 or resp.status_code == 429:
            raise MetricsUnavailable(f"{self.url}: HTTP {resp.status_code} {resp.text[:200]!r}")
        if resp.status_code != 200:
            raise MetricsSourceError(
                f"{self.url} (run {self.run_id}, metric {metric}): expected HTTP 200, "
                f"got {resp.status_code} {resp.text[:300]!r}"
            )
        try:
            body = resp.json()
            rows = [
                (int(m.get("step", 0)), _value(m["value"]), int(m["timestamp"]))
                for m in body.get("metrics", [])
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise MetricsUnavailable(f"{self.url}: unreadable answer {resp.text[:200]!r}: {exc}") from exc
        return rows, bool(body.get("next_page_token"))

    def close(self) -> None:
        self.session.close()


class StoreHistory:
    """MLflow's SQL store layer (`SqlAlchemyStore.get_metric_history` with `max_results`/`page_token`)."""

    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        self.run_id = run_id
        self.tracking_uri = tracking_uri
        try:
            # The artifact root is never touched by reads; the store just insists on one.
            self.store = SqlAlchemyStore(tracking_uri, default_artifact_root=os.devnull)
        except Exception as exc:
            raise MetricsUnavailable(f"{tracking_uri}: cannot open the tracking store: {exc}") from exc

    def page(self, metric: str, offset: int, limit: int) -> tuple[list[Row], bool]:
        from mlflow.exceptions import MlflowException
        from sqlalchemy.exc import SQLAlchemyError

        try:
            paged = self.store.get_metric_history(
                self.run_id, metric, max_results=limit, page_token=_token(offset)
            )
        except SQLAlchemyError as exc:
            raise MetricsUnavailable(f"{self.tracking_uri}: {type(exc).__name__}: {exc}") from exc
        except MlflowException as exc:
            if "locked" in str(exc) or "OperationalError" in str(exc):
                raise MetricsUnavailable(f"{self.tracking_uri}: {exc}") from exc
            raise MetricsSourceError(
                f"{self.tracking_uri} (run {self.run_id}, metric {metric}): {exc}"
            ) from exc
        rows = [(int(m.step), _value(m.value), int(m.timestamp)) for m in paged]
        return rows, bool(paged.token)

    def close(self) -> None:
        """Nothing to release: MLflow shares one engine per database URI across the process."""


def open_source(tracking_uri: str, run_id: str, *, timeout: float = 5.0) -> HistorySource:
    """The history reader for a tracking URI: HTTP(S) servers over REST, SQL databases via the store layer."""
    scheme = tracking_uri.split(":", 1)[0].split("+", 1)[0].lower()
    if scheme in ("http", "https"):
        return HttpHistory(tracking_uri, run_id, timeout=timeout)
    if scheme in _SQL_SCHEMES:
        return StoreHistory(tracking_uri, run_id)
    raise MetricsSourceError(
        f"tracking URI {tracking_uri!r}: expected http(s)://, sqlite://, postgresql://, mysql:// or mssql://"
    )
