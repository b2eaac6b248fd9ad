"""Asynchronous metric logging: the training step only enqueues; a thread connects, batches and sends.

Where points go is the connection's sink. Under the supervisor, a spool file the supervisor ships to MLflow
(`supervisor/spool.py`): the training process never imports MLflow. Stand-alone (or on a plan without a
spool), MLflow itself, opened on this thread: importing MLflow and opening its store cost seconds (the import
alone is ~1-2.5 s of CPU here, a fresh sqlite store another ~3 s of schema migrations). The session starts the
thread once the checkpoint is restored: started earlier, the import competes with the restore for the GIL
and the cores. Points logged before it connects queue up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from tenacity import retry, stop_after_attempt, wait_exponential

log = logging.getLogger("rollback_supervisor.metrics")
_STOP = object()

#: How long a checkpoint's commit waits for the metrics logged before it to reach MLflow.
METRICS_BEFORE_COMMIT_S = 10.0

#: (key, value, timestamp in ms, step)
Point = tuple[str, float, int, int]


class MetricSink(Protocol):
    """Where the logger's thread sends a batch: MLflow (`MlflowSink`) or the supervisor's spool."""

    def send(self, points: list[Point]) -> None: ...


#: Opens the sink on the logger's thread: returns `(sink, run_id)`.
Connect = Callable[[], tuple[MetricSink, str]]


class AsyncMetricLogger:
    """Batches `(key, value, step)` points into `sink.send` calls on a background thread.

    A batch goes out `interval` seconds after its first point (or at `max_batch` points), however fast
    points keep coming: the monitor sees them within about `interval`, and a checkpoint's commit waits only
    for the last fraction of a second instead of sending everything since the previous checkpoint.

    Thread-safe: `log()` and `barrier()` may be called from any thread; `flush()` and `close()` from the owner.
    A tracking outage never blocks or fails training: connecting and sending are retried, then points
    are dropped with a warning.
    """

    def __init__(self, connect: Connect, *, max_batch: int = 500, interval: float = 0.2, start: bool = True):
        self._connect = connect
        self._sink: Any = None
        self._run_id: str | None = None
        self._connected = threading.Event()
        self._queue: queue.Queue = queue.Queue()
        self._max_batch = max_batch
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="rbs-metrics", daemon=True)
        self._start_lock = threading.Lock()
        if start:
            self.start()

    def start(self) -> None:
        """Start connecting and sending (idempotent); every other verb starts it too."""
        with self._start_lock:
            if not self._thread.is_alive() and self._thread.ident is None:
                self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        for key, value in metrics.items():
            self._queue.put((key, float(value), now, int(step)))

    def connection(self, timeout: float = 120.0) -> tuple[Any, str | None]:
        """`(sink, run_id)` once connected; `(None, None)` if connecting failed or timed out."""
        self.start()
        self._connected.wait(timeout)
        return self._sink, self._run_id

    def barrier(self) -> threading.Event:
        """Send every point queued before this call now; the event is set once they are sent (or dropped)."""
        self.start()
        done = threading.Event()
        self._queue.put(done)
        return done

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every point queued before this call was sent (or dropped); False on timeout."""
        return self.barrier().wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    @retry(stop=stop_after_attempt(5), wait=wait_exponential(multiplier=0.2, max=5), reraise=True)
    def _open(self) -> tuple[MetricSink, str]:
        return self._connect()

    @retry(stop=stop_after_attempt(5), wait=wait_exponential(multiplier=0.2, max=5), reraise=True)
    def _send(self, batch: list[Point]) -> None:
        self._sink.send(batch)

    def _ship(self, batch: list[Point]) -> None:
        if not batch:
            return
        if self._sink is None:
            log.warning("dropped %d metric points: the tracking store could not be opened", len(batch))
            return
        try:
            self._send(batch)
        except Exception as exc:  # metrics must never kill training
            log.warning("dropped %d metric points after retries: %s", len(batch), exc)

    def _run(self) -> None:
        try:
            self._sink, self._run_id = self._open()
        except Exception as exc:  # metrics must never kill training
            log.warning(
                "could not open the MLflow tracking store after retries; metrics are dropped: %s", exc
            )
        finally:
            self._connected.set()
        batch: list[Point] = []
        deadline: float | None = None  # a batch is shipped `interval` after its first point, whatever follows
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            if isinstance(item, tuple):
                batch.append(item)
                if deadline is None:
                    deadline = time.monotonic() + self._interval
                if len(batch) < self._max_batch and time.monotonic() < deadline:
                    continue
            self._ship(batch)
            batch, deadline = [], None
            if item is None or isinstance(item, tuple):
                continue
            if item is _STOP:
                if hasattr(self._sink, "close"):
                    self._sink.close()
                return
            item.set()


class MetricsSent:
    """One checkpoint's "its metrics were sent" condition (to MLflow, or to the supervisor's spool, which it
    ships), for the store to wait on before the commit.

    The training thread asks for it once the state is copied (`ask()` after `save()` returns), not before:
    sending to MLflow is a store write, and started before the copy it ran beside it and doubled the time the save
    blocked training (measured on the example). A synchronous save commits inside `save()`, so the commit
    asks first; whichever asks first makes the one request.
    """

    def __init__(self, metrics: Any, step: int, timeout: float = METRICS_BEFORE_COMMIT_S):
        self._metrics, self._step, self._timeout = metrics, step, timeout
        self._lock = threading.Lock()
        self._sent: threading.Event | None = None

    def ask(self) -> threading.Event:
        with self._lock:
            if self._sent is None:
                self._sent = self._metrics.barrier()
            return self._sent

    def wait(self) -> None:
        """Runs before the commit (on the writer thread with async saves): wait, boundedly, for the metrics."""
        sent = self.ask()
        if not sent.wait(self._timeout):
            log.warning(
                "checkpoint at step %d commits before its metrics reached MLflow (waited %.0f s): after a "
                "crash, MLflow may miss points up to this step",
                self._step,
                self._timeout,
            )
