"""AsyncWriter: jobs in order on one thread; a background failure is re-raised on join, once, oldest first."""

from __future__ import annotations

import threading

import pytest

from supervisor.checkpoint.asyncwriter import AsyncWriter, BackgroundErrors
from supervisor.errors import BackgroundSaveError


def test_jobs_run_in_submission_order_and_join_waits_for_all():
    done: list[int] = []
    writer = AsyncWriter("t-order", BackgroundErrors())
    for i in range(5):
        writer.submit(str(i), done.append, i)
    writer.join()
    assert done == [0, 1, 2, 3, 4]
    assert writer.futures() == []
    writer.close()


def test_a_background_failure_is_reraised_on_join_once_and_oldest_first():
    errors = BackgroundErrors()
    writer = AsyncWriter("t-fail", errors)

    def boom(msg: str) -> None:
        raise OSError(msg)

    writer.submit("0000000001-000001", boom, "disk full")
    writer.submit("0000000002-000002", boom, "still full")
    with pytest.raises(
        BackgroundSaveError, match="checkpoint 0000000001-000001 failed: OSError: disk full"
    ) as exc:
        writer.join()
    assert isinstance(exc.value.__cause__, OSError)
    with pytest.raises(BackgroundSaveError, match="0000000002-000002"):
        writer.join()
    writer.join()  # both raised: nothing left
    writer.close()


def test_failures_of_two_writers_sharing_errors_keep_their_order():
    errors = BackgroundErrors()
    errors.record("a", ValueError("first"))
    errors.record("b", ValueError("second"))
    with pytest.raises(BackgroundSaveError, match="checkpoint a failed"):
        errors.raise_first()
    with pytest.raises(BackgroundSaveError, match="checkpoint b failed"):
        errors.raise_first()
    errors.raise_first()


def test_busy_counts_unfinished_jobs_against_max_in_flight_and_the_slot_frees_when_a_job_ends():
    gate = threading.Event()
    writer = AsyncWriter("t-busy", BackgroundErrors(), max_in_flight=1)
    assert not writer.busy()
    writer.reserve()
    future = writer.submit("x", gate.wait, 30)
    assert writer.busy()
    gate.set()
    future.result(30)
    assert not writer.busy()
    writer.reserve()  # the finished job gave its slot back: this does not block
    writer.unreserve()
    writer.close()


def test_an_unbounded_writer_is_never_busy_and_prune_forgets_finished_jobs():
    gate = threading.Event()
    writer = AsyncWriter("t-unbounded", BackgroundErrors())
    first = writer.submit("a", lambda: None)
    first.result(30)
    second = writer.submit("b", gate.wait, 30)
    assert not writer.busy()
    writer.prune()
    assert writer.futures() == [second]
    gate.set()
    writer.close()
    assert writer.futures() == []


def test_close_finishes_jobs_and_keeps_failures_for_the_next_join():
    errors = BackgroundErrors()
    writer = AsyncWriter("t-close", errors)
    writer.submit("c", lambda: 1 / 0)
    writer.close()
    with pytest.raises(BackgroundSaveError, match="ZeroDivisionError"):
        errors.raise_first()
