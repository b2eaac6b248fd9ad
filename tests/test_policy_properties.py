"""Property tests of the decision engine: rollback targets stay before onset - lookback (or fall back to the newest
before the onset), budgets hold, same in = same out."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from policies import CheckpointRecord, Decision, History, Policy, decide
from policies.selectors import last_clean_step, onset_of
from supervisor.events import EVENT_TYPES, METRIC_EVENTS, Event

SETTINGS = settings(max_examples=200, deadline=None)
ROLLBACK_EVENTS = sorted(METRIC_EVENTS - {"plateau"})


@st.composite
def catalogues(draw) -> list[CheckpointRecord]:
    rows = draw(
        st.lists(
            st.tuples(
                st.integers(0, 3000),
                st.one_of(
                    st.floats(0, 10), st.none(), st.floats(allow_nan=True, allow_infinity=True, width=32)
                ),
                st.sampled_from([True, True, True, False]),
            ),
            max_size=20,
        )
    )
    return [
        CheckpointRecord(f"c{i}", step, {} if loss is None else {"val_loss": loss}, valid=valid)
        for i, (step, loss, valid) in enumerate(rows)
    ]


@st.composite
def events(draw) -> Event:
    onset = draw(st.one_of(st.none(), st.integers(0, 3500)))
    step = draw(st.one_of(st.none(), st.integers(0, 200).map(lambda d: (onset or 0) + d)))
    # half the events are anomalies a rollback rule handles, so rollbacks are common, not a corner case
    kind = draw(st.one_of(st.sampled_from(ROLLBACK_EVENTS), st.sampled_from(EVENT_TYPES)))
    return Event(type=kind, reason="p", metric="loss", onset_step=onset, step=step)


@st.composite
def policy_docs(draw) -> dict:
    lookback = draw(st.integers(0, 600))
    target = draw(
        st.sampled_from(
            [
                {"select": "latest"},
                {"select": "best", "metric": "val_loss", "mode": "min"},
                {"select": "before", "lookback_steps": lookback},
                {"select": "best_before", "metric": "val_loss", "mode": "max", "lookback_steps": lookback},
                {"select": "best_before", "metric": "val_loss", "mode": "min", "lookback_steps": lookback},
            ]
        )
    )
    target = {**target, "strict": draw(st.booleans())}
    max_restarts = draw(st.integers(1, 8))
    escalation = draw(
        st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {
                    "same_step_window": st.integers(0, 100),
                    "lookback_multiplier": st.floats(1, 4),
                    "max_escalations": st.integers(0, 3),
                }
            ),
        )
    )
    return {
        "version": 1,
        "name": "prop",
        "rules": [
            {
                "when": ROLLBACK_EVENTS,
                "action": "rollback",
                "target": target,
                "skip_batches": draw(st.integers(0, 500)),
                "lr_scale": draw(st.floats(0.01, 1)),
                "allow_scratch": draw(st.booleans()),
            },
            {
                "when": ["preemption", "hardware_fault", "unknown_exit", "hang"],
                "action": "resume",
                "allow_scratch": draw(st.booleans()),
            },
            {"when": ["plateau"], "action": "stop"},
            {"when": ["software_error"], "action": "fail"},
        ],
        "limits": {
            "max_restarts": max_restarts,
            "max_rollbacks": draw(st.integers(1, max_restarts)),
            "backoff": {
                "initial_seconds": 1,
                "max_seconds": 30,
                "multiplier": 3,
                "jitter": draw(st.booleans()),
            },
            "escalation": escalation,
        },
    }


@SETTINGS
@given(doc=policy_docs(), event=events(), catalogue=catalogues(), earlier=st.lists(events(), max_size=6))
def test_rollback_target_is_valid_and_at_or_before_onset_minus_lookback(doc, event, catalogue, earlier):
    policy = Policy.model_validate(doc)
    history = History()
    for i, e in enumerate(earlier):
        history.record(e, decide(policy, e, history, catalogue, now=float(i)), now=float(i))
    decision = decide(policy, event, history, catalogue, now=100.0, rng_seed=0)
    by_id = {c.id: c for c in catalogue}
    if decision.target_id is not None:
        assert by_id[decision.target_id].valid
        assert decision.target_step == by_id[decision.target_id].step
    if decision.action != "rollback" or decision.target_id is None:
        return
    chosen = by_id[decision.target_id]
    onset = onset_of(event)
    if onset is not None:
        assert chosen.step <= last_clean_step(onset)
    target = doc["rules"][0]["target"]
    if decision.fallback:  # the target matched nothing: the newest valid checkpoint before the onset instead
        assert not target["strict"]
        usable = [c for c in catalogue if c.valid and (onset is None or c.step <= last_clean_step(onset))]
        assert chosen.step == max(c.step for c in usable)
        return
    lookback = target.get("lookback_steps")
    if lookback is not None:
        anchor = onset if onset is not None else max(c.step for c in catalogue if c.valid)
        assert chosen.step <= anchor - lookback


@SETTINGS
@given(doc=policy_docs(), sequence=st.lists(events(), min_size=1, max_size=30), catalogue=catalogues())
def test_budgets_are_never_exceeded(doc, sequence, catalogue):
    policy = Policy.model_validate(doc)
    history = History()
    for i, event in enumerate(sequence):
        decision = decide(policy, event, history, catalogue, now=10.0 * i)
        history.record(event, decision, now=10.0 * i)
        assert history.rollbacks <= policy.limits.max_rollbacks
        assert history.restarts <= policy.limits.max_restarts
        assert 0.0 <= decision.delay_seconds <= policy.limits.backoff.max_seconds
        if decision.relaunches:
            assert decision.lr_scale == policy.rules[decision.rule_index].lr_scale


@SETTINGS
@given(
    doc=policy_docs(),
    event=events(),
    catalogue=catalogues(),
    earlier=st.lists(events(), max_size=6),
    seed=st.one_of(st.none(), st.integers(0, 2**32)),
)
def test_same_inputs_give_the_same_decision(doc, event, catalogue, earlier, seed):
    policy = Policy.model_validate(doc)
    history = History()
    for i, e in enumerate(earlier):
        history.record(e, decide(policy, e, history, catalogue, now=float(i)), now=float(i))
    first = decide(policy, event, history, catalogue, now=50.0, rng_seed=seed)
    restored = History.from_dict(json.loads(json.dumps(history.to_dict())))
    again = decide(
        Policy.model_validate(doc), event, restored, list(reversed(catalogue)), now=50.0, rng_seed=seed
    )
    assert again == first
    assert Decision.from_dict(json.loads(json.dumps(first.to_dict()))) == first
