"""The heartbeat file: atomic writes, reads that never see half a file, phase validation."""

from __future__ import annotations

import json
import os
import threading

import pytest

from supervisor.monitor import Heartbeat, HeartbeatReader, HeartbeatWriter
from supervisor.monitor.heartbeat import HeartbeatError


def test_beat_round_trips_and_changed_reports_only_news(tmp_path):
    path = tmp_path / "run" / "heartbeat.json"
    clock = iter([100.0, 101.0]).__next__
    writer, reader = HeartbeatWriter(path, clock=clock), HeartbeatReader(path)
    assert reader.read() is None and reader.changed() is None
    beat = writer.beat(12, "eval")
    assert beat == Heartbeat(step=12, wall_time=100.0, phase="eval", pid=os.getpid())
    assert json.loads(path.read_text()) == {
        "step": 12,
        "wall_time": 100.0,
        "phase": "eval",
        "pid": os.getpid(),
    }
    assert reader.changed() == beat and reader.changed() is None
    assert reader.changed() is None
    writer.beat(13)
    assert reader.changed().step == 13 and reader.read().phase == "train"


@pytest.mark.parametrize(
    ("step", "phase", "message"),
    [(1, "sleep", "phase: expected one of train"), (-1, "train", "step: expected an integer >= 0")],
)
def test_bad_beats_are_rejected(tmp_path, step, phase, message):
    with pytest.raises(HeartbeatError, match=message):
        HeartbeatWriter(tmp_path / "hb.json").beat(step, phase)


def test_an_unreadable_heartbeat_reads_as_absent(tmp_path):
    path = tmp_path / "hb.json"
    path.write_text("{not json")
    assert HeartbeatReader(path).read() is None
    path.write_text(json.dumps({"step": 1}))
    assert HeartbeatReader(path).read() is None


def test_a_reader_racing_a_writer_never_sees_half_a_file(tmp_path):
    path = tmp_path / "hb.json"
    writer, reader = HeartbeatWriter(path), HeartbeatReader(path)
    writer.beat(0)
    done = threading.Event()
    steps: list[int] = []

    def read_all():
        while not done.is_set():
            beat = reader.read()
            steps.append(beat.step if beat is not None else -1)  # -1: a torn or missing file

    thread = threading.Thread(target=read_all)
    thread.start()
    for step in range(1, 500):
        writer.beat(step, "checkpoint" if step % 7 == 0 else "train")
    done.set()
    thread.join(10)
    assert steps and -1 not in steps and steps == sorted(steps) and reader.read().step == 499
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hb.json"]
