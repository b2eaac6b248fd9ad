"""History: counting, JSON round trips and the errors of a damaged record."""

from __future__ import annotations

import json

import pytest

from policies import Decision, History, HistoryError
from supervisor.events import Event


def _entry(action: str, lr: float = 1.0, step: int = 10) -> tuple[Event, Decision]:
    event = Event(
        type="spike", reason="r", metric="loss", onset_step=step - 5, step=step, evidence={"z": 7.5}
    )
    return event, Decision(
        action=action,
        target_id="c1" if action != "fail" else None,
        lr_scale=lr,
        reason="because",
        rule_index=0,
        event=event,
    )


def test_counts_rollbacks_and_restarts():
    history = History()
    for action, lr in [("rollback", 0.5), ("resume", 1.0), ("rollback", 0.5), ("stop", 1.0), ("fail", 1.0)]:
        event, decision = _entry(action, lr)
        assert history.record(event, decision, now=100.0 + len(history)) is history
    assert (len(history), history.rollbacks, history.restarts) == (5, 2, 3)
    assert history.relaunches_since(101.0) == 2
    assert [e.time for e in history] == [100.0, 101.0, 102.0, 103.0, 104.0]


def test_round_trips_through_json_and_stores_each_event_once():
    history = History()
    for i, action in enumerate(["rollback", "resume", "fail"]):
        history.record(*_entry(action, step=100 * (i + 1)), now=float(i))
    data = json.loads(json.dumps(history.to_dict()))
    assert data["version"] == 1
    assert all("event" not in e["decision"] for e in data["entries"])
    again = History.from_dict(data)
    assert again == history
    assert again.entries[0].decision.event == again.entries[0].event


def test_a_decision_about_another_event_keeps_its_own():
    event, decision = _entry("resume")
    other = Event(type="preemption", reason="notice", source="notice")
    history = History().record(other, decision, now=1.0)
    again = History.from_dict(json.loads(json.dumps(history.to_dict())))
    assert again.entries[0].event == other
    assert again.entries[0].decision.event == event


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"version": 9, "entries": []}, "history.version: expected 1, got 9"),
        (
            {"version": 1, "entries": [{"time": 1.0}]},
            "history.entries[0]: expected {time, event, decision}, got KeyError",
        ),
        (
            {
                "version": 1,
                "entries": [{"time": "soon", "event": {"type": "oom", "reason": ""}, "decision": {}}],
            },
            "history.entries[0]: expected {time, event, decision}, got TypeError",
        ),
    ],
)
def test_damaged_history_names_the_entry(data, message):
    with pytest.raises(HistoryError) as info:
        History.from_dict(data)
    assert str(info.value).startswith(message)
