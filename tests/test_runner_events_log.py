"""EventsLog: events.jsonl read by byte offset, and the wait for the training side's own report (no sleeping)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.events import Event
from supervisor.orchestrator.events_log import EventsLog, line_offset, same_incident


def _line(event: Event, **extra) -> bytes:
    return (json.dumps({"seq": 1, "time": 1.0, "event": event.to_dict(), **extra}) + "\n").encode()


NAN_46 = Event(type="non_finite", reason="nan", metric="loss", onset_step=46, step=46)


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        (NAN_46, Event(type="non_finite", reason="", metric="grad_norm", onset_step=46), True),
        (NAN_46, Event(type="spike", reason="", metric="loss", onset_step=48), True),  # within 2 steps
        (NAN_46, Event(type="spike", reason="", metric="loss", onset_step=49), False),
        (
            NAN_46,
            Event(type="threshold", reason="", metric="grad_norm", onset_step=None),
            True,
        ),  # unknown onset
        (NAN_46, Event(type="preemption", reason="", source="notice"), False),  # not a metric event
    ],
)
def test_same_incident(a: Event, b: Event, same: bool):
    assert same_incident(a, b) is same and same_incident(b, a) is same


class _Clock:
    """A fake monotonic clock that the fake sleep advances; records the sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_reported_finds_the_incident_after_the_offset_only(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    old = _line(NAN_46, handled_in_process=True)
    path.write_bytes(old)
    clock = _Clock()
    log = EventsLog(path, clock=clock, sleep=clock.sleep)
    other_metric = Event(type="non_finite", reason="", metric="grad_norm", onset_step=46, step=46)
    assert log.reported(other_metric, 0, wait_s=0)
    assert not log.reported(other_metric, len(old), wait_s=0)  # consumed by an earlier segment
    assert clock.sleeps == []


def test_reported_waits_for_a_report_that_is_not_there_yet_then_gives_up(tmp_path: Path):
    path = tmp_path / "events.jsonl"
    clock = _Clock()
    log = EventsLog(path, clock=clock, sleep=clock.sleep)
    assert not log.reported(NAN_46, 0, wait_s=1.0)
    assert clock.sleeps == [0.25] * 4 and clock.now == 1.0

    arrivals = iter([b"", _line(NAN_46)])

    def sleep_then_the_report_lands(seconds: float) -> None:
        clock.sleep(seconds)
        with path.open("ab") as f:
            f.write(next(arrivals))

    clock.sleeps.clear()
    log = EventsLog(path, clock=clock, sleep=sleep_then_the_report_lands)
    assert log.reported(NAN_46, 0, wait_s=5.0)
    assert clock.sleeps == [0.25, 0.25]


def test_since_a_missing_file_is_nothing_at_the_same_offset(tmp_path: Path):
    assert EventsLog(tmp_path / "none.jsonl").since(17) == ([], 17)


@pytest.mark.parametrize(
    ("content", "lines", "expected"),
    [
        (b"a\nbb\nccc\n", 2, 5),
        (b"a\nbb\nccc\n", 3, 9),
        (b"a\nbb\ncc", 5, 5),  # a torn last line is not counted
        (b"", 3, 0),
    ],
)
def test_line_offset_of_records_that_counted_lines(tmp_path: Path, content: bytes, lines: int, expected: int):
    path = tmp_path / "events.jsonl"
    path.write_bytes(content)
    assert line_offset(path, lines) == expected
