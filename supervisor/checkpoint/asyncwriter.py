"""Background work of the checkpoint manager: one thread per kind of work, failures kept until someone joins.

orbax's contract: a background failure is re-raised on join (or on the next call that checks), never lost.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from supervisor.errors import BackgroundSaveError, CheckpointError


class BackgroundErrors:
    """Failures of background work, first in first out; thread-safe."""

    def __init__(self) -> None:
        self._errors: deque[tuple[str, BaseException]] = deque()
        self._lock = threading.Lock()

    def record(self, checkpoint_id: str, exc: BaseException) -> None:
        with self._lock:
            self._errors.append((checkpoint_id, exc))

    def raise_first(self) -> None:
        """Raise the oldest failure not raised yet as BackgroundSaveError (each one is raised once)."""
        with self._lock:
            if not self._errors:
                return
            cid, exc = self._errors.popleft()
        raise BackgroundSaveError(
            f"background save of checkpoint {cid} failed: {type(exc).__name__}: {exc}"
        ) from exc


class AsyncWriter:
    """Runs jobs in order on one background thread, at most `max_in_flight` at once (None: unbounded).

    A job's failure is recorded in `errors` under the checkpoint id it was submitted with; `join()` waits for
    every job, then raises the oldest failure. Submitting from the training thread and from another job both
    work. The thread starts on the first submit and ends at close().
    """

    def __init__(self, name: str, errors: BackgroundErrors, *, max_in_flight: int | None = None):
        self._name = name
        self._errors = errors
        self._slots = None if max_in_flight is None else threading.BoundedSemaphore(max_in_flight)
        self._max = max_in_flight
        self._pool: ThreadPoolExecutor | None = None
        self._futures: deque[Future[None]] = deque()
        self._lock = threading.Lock()
        self._closed = False

    def reserve(self) -> None:
        """Take one in-flight slot, blocking while `max_in_flight` jobs are unfinished; submit() hands it on."""
        if self._slots is not None:
            self._slots.acquire()

    def unreserve(self) -> None:
        """Give back a slot taken by reserve() when nothing gets submitted after all."""
        if self._slots is not None:
            self._slots.release()

    def submit(self, checkpoint_id: str, job: Callable[..., Any], *args: Any) -> Future[None]:
        """Run `job(*args)` in the background after the jobs before it; with a bound, reserve() first."""
        with self._lock:
            if self._closed:
                raise CheckpointError(f"{self._name}: submit() after close(); open a new CheckpointManager")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, self._name)
            future = self._pool.submit(self._run, checkpoint_id, job, args)
            self._futures.append(future)
        return future

    def _run(self, checkpoint_id: str, job: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            job(*args)
        except BaseException as exc:
            self._errors.record(checkpoint_id, exc)
        finally:
            self.unreserve()

    def busy(self) -> bool:
        """Whether reserve() would block now (`max_in_flight` jobs unfinished); never with no bound."""
        with self._lock:
            unfinished = sum(not f.done() for f in self._futures)
        return self._max is not None and unfinished >= self._max

    def futures(self) -> list[Future[None]]:
        """The jobs submitted and not yet pruned or joined, oldest first (some may be finished)."""
        with self._lock:
            return list(self._futures)

    def prune(self) -> None:
        """Forget the finished jobs at the head of the queue (their failures stay recorded)."""
        with self._lock:
            while self._futures and self._futures[0].done():
                self._futures.popleft()

    def join(self) -> None:
        """Wait for every job submitted so far (and those they submit), then raise the oldest failure."""
        self.drain()
        self._errors.raise_first()

    def drain(self) -> None:
        """Wait for every job submitted so far, raising nothing."""
        while True:
            with self._lock:
                if not self._futures:
                    return
                future = self._futures.popleft()
            future.exception()

    def close(self) -> None:
        """Finish every job and stop the thread (failures stay recorded for the next join)."""
        self.drain()
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=True)


__all__ = ["AsyncWriter", "BackgroundErrors"]
