"""The supervisor's side of the metric spool: ships a segment's points to the lineage's MLflow run.

A thread ships every `interval` seconds while the segment runs, so the monitor (which reads MLflow) sees a
point within about `interval` plus its own poll; `drain()` ships the rest once the segment has exited,
before anything reads the run to decide or report. A batch that fails for a transient reason (an outage)
stays in the spool and is retried on the next round. A point MLflow refuses for good (an invalid key) is
found by halving the batch and dropped with a warning, so it cannot block the points after it. See
`supervisor/spool.py` for the format and why it exists.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from supervisor.spool import SpoolReader

log = logging.getLogger("rollback_supervisor.spool")

#: MLflow's limit on metrics in one `log_batch` request.
MAX_BATCH = 1000
#: MLflow error codes that no retry will change (an invalid key or value): the point is dropped, not retried.
PERMANENT = {"INVALID_PARAMETER_VALUE", "BAD_REQUEST"}


class SpoolShipper:
    """Ships one spool file into one MLflow run.

    Thread-safe: `ship()` is serialized by a lock, so the background thread and `drain()` never send the same
    points concurrently.
    """

    def __init__(self, client: Any, run_id: str, path: Path | str, *, interval: float = 0.25):
        self.client, self.run_id = client, run_id
        self.reader = SpoolReader(path)
        self.interval = interval
        self.shipped_points = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def ship(self, timeout: float | None = None) -> int:
        """Send every complete point not yet shipped, in batches; returns how many were sent.

        Raises on a transient failure (what is unsent stays for the next round), and TimeoutError if another
        `ship()` holds the spool for longer than `timeout`. Points MLflow refuses for good are dropped.
        """
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"shipping {self.reader.path} is stuck in another call")
        sent = 0
        try:
            while True:
                points, end = self.reader.pending(MAX_BATCH)
                if not points:
                    if end != self.reader.shipped():
                        self.reader.mark(end)  # only malformed lines in between
                    return sent
                n = self._send(points)
                self.reader.mark(end)
                sent += n
                self.shipped_points += n
        finally:
            self._lock.release()

    def _send(self, points: list[Any]) -> int:
        """log_batch; on a permanent refusal (a bad key, say), halve the batch down to the points refused."""
        from mlflow.entities import Metric
        from mlflow.exceptions import MlflowException

        try:
            self.client.log_batch(self.run_id, metrics=[Metric(*p) for p in points], synchronous=True)
            return len(points)
        except MlflowException as exc:
            if exc.error_code not in PERMANENT:
                raise
            if len(points) == 1:
                log.warning("MLflow refused metric point %s for good, dropped: %s", points[0], exc.message)
                return 0
        half = len(points) // 2
        return self._send(points[:half]) + self._send(points[half:])

    def _round(self) -> None:
        try:
            self.ship()
        except Exception as exc:  # an outage: the points wait in the spool for the next round
            if not self._failing:
                log.warning("could not ship metrics to MLflow (they stay in the spool; will retry): %s", exc)
            self._failing = True
            return
        if self._failing:
            log.info("shipping metrics to MLflow again")
        self._failing = False

    def start(self) -> SpoolShipper:
        def run() -> None:
            while not self._stop.wait(self.interval):
                self._round()

        self._thread = threading.Thread(target=run, name="rbs-spool-shipper", daemon=True)
        self._thread.start()
        return self

    def drain(self, timeout: float = 60.0) -> bool:
        """Stop the thread and ship what is left; False (with a warning) if MLflow refused it."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        try:
            self.ship(timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:
            log.warning(
                "%d bytes of metrics stay in %s: MLflow refused them (%s); the next run of this lineage ships them",
                self.reader.unshipped_bytes(),
                self.reader.path,
                exc,
            )
            return False
        return True


def ship_leftovers(client: Any, run_id: str, spool_dir: Path) -> int:
    """Ship what earlier segments left unshipped (their supervisor died); returns the number of points."""
    total = 0
    for path in sorted(Path(spool_dir).glob("*.jsonl")):
        shipper = SpoolShipper(client, run_id, path)
        if shipper.reader.unshipped_bytes() and shipper.drain():
            total += shipper.shipped_points
    if total:
        log.info("shipped %d metric points that an earlier supervisor left in %s", total, spool_dir)
    return total
