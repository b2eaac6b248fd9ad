"""LineageRecord / SegmentRecord: lineage.json as typed data, written back exactly as it was read."""

from __future__ import annotations

import copy
import json

import pytest

from supervisor.lineage import LineageRecord, MlflowRef, SegmentRecord, as_json, running_seconds

#: A lineage.json as the supervisor writes it today (two segments: an in-process rollback, then a resume).
TODAY = {
    "version": 1,
    "lineage": "charlm",
    "created": 1700000000.5,
    "updated": 1700000100.25,
    "status": "finished",
    "final_reason": "training finished",
    "final_checkpoint": "0000000060-abcd",
    "command": ["/usr/bin/python3", "examples/charlm.py", "--steps", "60"],
    "policy": {"path": "policies/presets/palm-spike.yaml", "name": "palm-spike"},
    "mlflow": {"tracking_uri": "sqlite:////w/mlflow.db", "experiment": "rollback-supervisor", "run_id": "r1"},
    "storage": {"checkpoints": "/w/checkpoints/charlm", "remote": None, "durable": "/w/lineages/charlm"},
    "history": {"entries": [{"time": 5.0, "event": {"type": "spike"}, "decision": {"action": "rollback"}}]},
    "events_consumed": 2,
    "events_offset": 512,
    "next_restore": {
        "checkpoint_id": "0000000040-ef01",
        "skip_batches": 0,
        "lr_scale": 1.0,
        "from_scratch": False,
        "rollback": False,
    },
    "segments": [
        {
            "host": "h",
            "index": 0,
            "started": 10.0,
            "ended": 70.0,
            "pid": 4242,
            "pid_started": 9.5,
            "returncode": -9,
            "signal_sent": None,
            "restore": {
                "checkpoint_id": None,
                "skip_batches": 0,
                "lr_scale": 1.0,
                "from_scratch": False,
                "rollback": False,
            },
            "start_step": 0,
            "last_step": 47,
            "outcome": "resume",
            "event": {"type": "unknown_exit", "reason": "killed"},
            "decision": {"action": "resume", "reason": "resume from latest"},
            "in_process": [{"seq": 1, "handled_in_process": True, "event": {}, "decision": {}}],
            "save_failures": [{"kind": "save_failed", "event": {"type": "storage_error"}}],
        },
        {
            "host": "h",
            "index": 1,
            "started": 71.0,
            "ended": 100.0,
            "pid": 4343,
            "pid_started": 70.9,
            "returncode": 0,
            "signal_sent": None,
            "restore": {},
            "start_step": 40,
            "last_step": 60,
            "outcome": "finished",
            "event": None,
            "decision": None,
            "in_process": [],
        },
    ],
    "lease_token": 3,
    "mlflow_previous": [{"tracking_uri": "sqlite:////old/mlflow.db", "run_id": "r0", "left_at": 1.0}],
}


def _without(data: dict, *keys: str) -> dict:
    out = copy.deepcopy(data)
    for key in keys:
        out.pop(key)
    return out


@pytest.mark.parametrize(
    "data",
    [
        TODAY,
        _without(TODAY, "lease_token", "mlflow_previous"),  # a record never written fenced, never moved
        _without(TODAY, "events_offset", "storage"),  # from before byte offsets and the storage key
        {**TODAY, "future_key": {"nested": [1, 2]}},  # written by a newer supervisor
        {
            "lineage": "x",
            "status": "running",
            "segments": [],
            "mlflow": {},
            "history": {},
        },  # the bare minimum
        {
            **TODAY,
            "mlflow": {**TODAY["mlflow"], "server_side": True},
            "segments": [{**TODAY["segments"][1], "job_id": "slurm-17"}, {"index": 2, "started": 1.0}],
        },
    ],
    ids=["today", "unfenced", "old", "unknown-top", "minimal", "unknown-nested"],
)
def test_from_dict_to_dict_is_exact(data: dict):
    record = LineageRecord.from_dict(data)
    assert record.to_dict() == data
    assert json.dumps(record.to_dict(), sort_keys=True) == json.dumps(data, sort_keys=True)


def test_fields_are_typed_and_nested_json_is_left_as_json():
    record = LineageRecord.from_dict(TODAY)
    assert isinstance(record.mlflow, MlflowRef) and record.mlflow.run_id == "r1"
    assert [type(s) for s in record.segments] == [SegmentRecord, SegmentRecord]
    seg = record.segments[0]
    assert (seg.pid, seg.returncode, seg.outcome, seg.last_step) == (4242, -9, "resume", 47)
    assert seg.decision == {"action": "resume", "reason": "resume from latest"}
    assert record.segments[1].save_failures is None  # written only once a save failed


def test_from_dict_does_not_share_state_with_its_source():
    data = copy.deepcopy(TODAY)
    record = LineageRecord.from_dict(data)
    record.segments[0].in_process.append({"seq": 2})
    record.policy["name"] = "other"
    assert data == TODAY


def test_a_key_the_source_lacked_is_written_once_it_is_set():
    record = LineageRecord.from_dict(_without(TODAY, "events_offset"))
    assert "events_offset" not in record.to_dict()
    record.put(events_offset=0)  # the default value, set on purpose: written from now on
    assert record.to_dict()["events_offset"] == 0
    record.final_checkpoint = "c"  # a value other than the default is always written
    assert record.to_dict()["final_checkpoint"] == "c"


def test_a_new_record_writes_every_key_but_the_optional_ones():
    record = LineageRecord(
        lineage="n", status="running", mlflow=MlflowRef(tracking_uri="u", experiment="e", run_id="r")
    )
    record.segments.append(SegmentRecord(index=0, started=1.0))
    data = record.to_dict()
    assert set(data) == set(TODAY) - {"lease_token", "mlflow_previous"}
    assert set(data["segments"][0]) == set(TODAY["segments"][1])  # no save_failures before one happened
    record.put(lease_token=1)
    assert record.to_dict()["lease_token"] == 1


def test_note_launch_keeps_known_details_as_fields_and_others_as_extra():
    seg = SegmentRecord(index=0, started=1.0)
    seg.note_launch({"pid": 7, "pid_started": 2.5, "job_id": "slurm-17"})
    assert (seg.pid, seg.pid_started) == (7, 2.5)
    assert seg.to_dict()["job_id"] == "slurm-17"


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        ([], 0.0),
        ([{"started": 10.0, "ended": 70.0}, {"started": 71.0, "ended": None}], 60.0),
        ([{"started": 10.0, "ended": 5.0}], 0.0),  # a clock that went back counts nothing
    ],
)
def test_running_seconds_counts_finished_segments(segments, expected):
    assert running_seconds(segments) == expected
    typed = [SegmentRecord(index=i, **s) for i, s in enumerate(segments)]
    assert running_seconds(typed) == expected


def test_as_json_accepts_either_form():
    record = LineageRecord.from_dict(TODAY)
    assert as_json(record) == TODAY
    assert as_json(TODAY) is TODAY
