"""events.jsonl records and the accounting of failed saves, on a real file with an injected clock."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from supervisor.errors import BackgroundSaveError
from supervisor.events import Event
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.seams import NullHeartbeat, NullMetrics, Outputs


class Recorded(NullMetrics):
    def __init__(self) -> None:
        self.points: list[tuple[dict[str, float], int]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.points.append((dict(metrics), step))


class Decision:
    def to_dict(self) -> dict[str, object]:
        return {"action": "rollback", "target_id": "0000000010-000001"}


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_reports_are_numbered_and_carry_the_decision(tmp_path: Path):
    reporter = EventReporter(tmp_path / "events.jsonl", 3, clock=lambda: 1000.0, pid=lambda: 77)
    event = Event("spike", "loss 9.1 > 3 sigma", metric="loss", step=12, source="in_process")
    reporter.anomaly(event, Decision(), handled=True, restore_s=0.25, tier="memory")
    reporter.anomaly(event, None, handled=False)
    first, second = records(tmp_path / "events.jsonl")
    assert {k: first[k] for k in ("seq", "pid", "segment", "time")} == {
        "seq": 1,
        "pid": 77,
        "segment": 3,
        "time": 1000.0,
    }
    assert first["decision"]["target_id"] == "0000000010-000001" and first["tier"] == "memory"
    assert first["event"]["type"] == "spike" and first["handled_in_process"] is True
    assert (second["seq"], second["decision"], second["handled_in_process"]) == (2, None, False)


def test_a_failed_save_is_counted_logged_and_reported(tmp_path: Path):
    metrics = Recorded()
    reporter = EventReporter(tmp_path / "events.jsonl", 0, clock=lambda: 5.0)
    failures = SaveFailures(reporter, Outputs(metrics, NullHeartbeat()), clock=lambda: 5.0)
    failures.failed(OSError(errno.ENOSPC, "No space left on device"), step=40)
    failures.failed(OSError(errno.EIO, "I/O error"), step=50)
    assert failures.count == 2
    assert metrics.points == [({"checkpoint.save_failures": 1}, 40), ({"checkpoint.save_failures": 2}, 50)]
    reports = records(tmp_path / "events.jsonl")
    assert [r["kind"] for r in reports] == ["save_failed", "save_failed"]
    assert reports[0]["event"]["evidence"] == {"error": "OSError", "errno": errno.ENOSPC}
    assert reports[0]["event"]["type"] == "storage_error" and reports[0]["event"]["step"] == 40


def test_a_report_that_cannot_be_written_is_only_logged(tmp_path: Path, caplog):
    reporter = EventReporter(tmp_path / "missing" / "events.jsonl", 0)
    failures = SaveFailures(reporter, Outputs(NullMetrics(), NullHeartbeat()))
    failures.failed(OSError(errno.ENOSPC, "full"), step=1)
    assert failures.count == 1 and "could not report the failed save" in caplog.text


def test_despite_reports_each_background_failure_then_retries(tmp_path: Path):
    failures = SaveFailures(
        EventReporter(tmp_path / "events.jsonl", 0), Outputs(NullMetrics(), NullHeartbeat())
    )
    raised = [BackgroundSaveError("write 1 failed"), BackgroundSaveError("write 2 failed")]
    calls: list[int] = []

    def wait() -> str:
        calls.append(1)
        if raised:
            raise raised.pop(0)
        return "done"

    assert failures.despite(7, wait) == "done"
    assert len(calls) == 3 and failures.count == 2
    assert [r["event"]["step"] for r in records(tmp_path / "events.jsonl")] == [7, 7]
    with pytest.raises(OSError):  # anything else is the caller's
        failures.despite(7, lambda: (_ for _ in ()).throw(OSError("sync write")))
