"""Selectors, table-driven: which checkpoint each one picks, and that none ever picks an invalid one."""

from __future__ import annotations

import math

import pytest

from policies import CheckpointRecord, before, best, best_before, custom, latest
from supervisor.events import Event

CATALOGUE = (
    CheckpointRecord("a", 100, {"val_loss": 3.0, "acc": 0.10}),
    CheckpointRecord("b", 200, {"val_loss": 2.0, "acc": 0.40}),
    CheckpointRecord("c", 300, {"val_loss": 2.0, "acc": 0.30}),  # ties b on val_loss: newer wins
    CheckpointRecord("d", 400, {"val_loss": 1.0, "acc": 0.90}, valid=False),
    CheckpointRecord("e", 500, {"val_loss": math.nan, "acc": 0.50}),
    CheckpointRecord("f", 600, {"acc": 0.20}),
    CheckpointRecord("g", 700, {"val_loss": 2.5}, valid=False),
)


def at(onset: int | None, step: int | None = None) -> Event:
    return Event(type="spike", reason="t", onset_step=onset, step=step)


@pytest.mark.parametrize(
    ("selector", "event", "expected"),
    [
        (latest(), at(None), "f"),
        (latest(), at(10), "f"),  # latest ignores the onset; the engine filters for rollbacks
        (best("val_loss"), at(None), "c"),
        (best("val_loss", "min"), at(150), "c"),
        (best("acc", "max"), at(None), "e"),
        (before(0), at(300), "c"),
        (before(1), at(300), "b"),
        (before(100), at(450), "c"),
        (before(100), at(None, step=450), "c"),  # no onset: the step it was noticed at
        (before(100), at(None), "e"),  # no step at all: measured from the newest valid checkpoint (600)
        (before(1000), at(450), None),
        (best_before("val_loss", "min", 100), at(450), "c"),
        (best_before("val_loss", "min", 200), at(450), "b"),
        (best_before("val_loss", "min", 400), at(450), None),
        (best_before("acc", "max", 0), at(600), "e"),
        (best_before("acc", "max", 150), at(600), "b"),
        (custom("m:f", lambda cat, ev, k: cat[k], {"k": 1}), at(0), "b"),
    ],
    ids=lambda v: f"onset={v.onset_step},step={v.step}" if isinstance(v, Event) else str(v),
)
def test_selector_table(selector, event, expected):
    chosen = selector(CATALOGUE, event)
    assert (chosen.id if chosen else None) == expected


@pytest.mark.parametrize(
    "selector", [latest(), best("val_loss"), before(0), best_before("val_loss", "min", 0)], ids=str
)
def test_no_selector_returns_an_invalid_checkpoint(selector):
    all_bad = [CheckpointRecord(c.id, c.step, c.metrics, valid=False) for c in CATALOGUE]
    assert selector(all_bad, at(10_000)) is None
    assert selector([], at(10_000)) is None


def test_choice_does_not_depend_on_catalogue_order():
    for selector in (latest(), best("val_loss"), before(50), best_before("acc", "max", 100)):
        assert selector(CATALOGUE, at(650)) == selector(tuple(reversed(CATALOGUE)), at(650))


def test_selectors_read_like_english():
    assert str(best_before("val_loss", "min", 100)) == "best_before(val_loss, min, lookback_steps=100)"
    assert str(before(lookback_steps=5)) == "before(lookback_steps=5)"
    assert str(latest()) == "latest()"
    assert str(best("acc", "max")) == "best(acc, max)"
    assert str(custom("pkg.mod:pick", print, {"metric": "loss_scale"})) == "pkg.mod:pick(metric='loss_scale')"
