"""CheckpointOptions checks every value at construction, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.checkpoint import CheckpointOptions, CheckpointOptionsError, KeepBestSpec
from supervisor.errors import UserError


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"keep_last": 0}, "checkpoint.keep_last: expected an integer >= 1, got 0"),
        ({"keep_every_steps": -5}, "checkpoint.keep_every_steps"),
        ({"keep_best": ("loss", "lowest", 1)}, "keep_best.mode: expected 'min' or 'max'"),
        ({"keep_best": ("loss", "min")}, "checkpoint.keep_best: expected (metric, mode, count)"),
        ({"keep_best": ("", "min", 1)}, "keep_best.metric"),
        ({"max_in_flight": 0}, "checkpoint.max_in_flight"),
        ({"memory_slots": -1}, "checkpoint.memory_slots: expected an integer >= 0"),
        ({"verify": "paranoid"}, "checkpoint.verify: expected one of full, fast, none, got 'paranoid'"),
        ({"async_save": "yes"}, "checkpoint.async_save"),
        ({"remote": ""}, "checkpoint.remote"),
    ],
)
def test_bad_values_fail_at_construction(tmp_path, kwargs, message):
    with pytest.raises(CheckpointOptionsError) as err:
        CheckpointOptions(tmp_path, **kwargs)
    assert message in str(err.value)
    assert isinstance(err.value, UserError)


def test_good_values_are_normalised(tmp_path):
    options = CheckpointOptions(str(tmp_path), keep_best=("val_loss", "max", 2))
    assert options.directory == Path(tmp_path)
    assert options.keep_best == KeepBestSpec("val_loss", "max", 2)
