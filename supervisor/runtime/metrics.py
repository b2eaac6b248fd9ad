"""Asynchronous MLflow metric logging: the training step only enqueues; a thread batches and sends."""

from __future__ import annotations

import logging
import queue
import threading
import time

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from tenacity import retry, stop_after_attempt, wait_exponential

log = logging.getLogger("rollback_supervisor.metrics")
_STOP = object()


class AsyncMetricLogger:
    """Batches `(key, value, step)` points into `log_batch` calls on a background thread.

    Thread-safe: `log()` may be called from any thread; `flush()` and `close()` from the owner.
    A tracking outage never blocks or fails training: batches are retried, then dropped with a warning.
    """

    def __init__(self, client: MlflowClient, run_id: str, *, max_batch: int = 500, interval: float = 0.2):
        self._client = client
        self._run_id = run_id
        self._queue: queue.Queue = queue.Queue()
        self._max_batch = max_batch
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="rbs-metrics", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        for key, value in metrics.items():
            self._queue.put(Metric(key, float(value), now, int(step)))

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every point queued before this call was sent (or dropped); False on timeout."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    @retry(stop=stop_after_attempt(5), wait=wait_exponential(multiplier=0.2, max=5), reraise=True)
    def _send(self, batch: list[Metric]) -> None:
        self._client.log_batch(self._run_id, metrics=batch, synchronous=True)

    def _ship(self, batch: list[Metric]) -> None:
        if not batch:
            return
        try:
            self._send(batch)
        except Exception as exc:  # metrics must never kill training
            log.warning("dropped %d metric points after retries: %s", len(batch), exc)

    def _run(self) -> None:
        batch: list[Metric] = []
        while True:
            try:
                item = self._queue.get(timeout=self._interval if batch else None)
            except queue.Empty:
                self._ship(batch)
                batch = []
                continue
            if isinstance(item, Metric):
                batch.append(item)
                if len(batch) >= self._max_batch:
                    self._ship(batch)
                    batch = []
                continue
            self._ship(batch)
            batch = []
            if item is _STOP:
                return
            item.set()
