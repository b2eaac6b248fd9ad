"""TrainingState through the CheckpointableState protocol: what a snapshot holds, and its step becoming the state's counter."""

from __future__ import annotations

import torch

from supervisor.flatten import unflatten
from supervisor.state import TrainingState
from supervisor.stateful import CheckpointableState


class WithMask(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(2))
        self.register_buffer("mask", torch.full((2,), float("-inf")))


def make() -> TrainingState:
    state = TrainingState()
    state.register("model", WithMask())
    state.extras = {"note": "x"}
    return state


def test_training_state_provides_the_protocol():
    assert isinstance(make(), CheckpointableState)


def test_a_snapshot_records_its_step_in_the_counters_and_sets_the_state_counter():
    state = make()
    state.step = 4
    skeleton, tensors = state.snapshot(9, {"best": 0.5}, None)
    nested = unflatten(skeleton, tensors)
    assert nested["counters"]["step"] == 9 and state.step == 9
    assert nested["extras"] == {"note": "x", "best": 0.5}
    assert state.extras == {"note": "x"}
    assert "ranks" not in nested
    assert tensors["model.w"] is not None and tensors["model.w"].data_ptr() == state["model"].w.data_ptr()


def test_rank_states_are_stored_under_ranks_only_when_given():
    state = make()
    ranks = {"0": {"rng": {"python": [1]}}, "1": {"rng": {"python": [2]}}}
    nested = unflatten(*state.snapshot(1, None, ranks))
    assert nested["ranks"] == ranks
    assert not hasattr(state, "rank_states")


def test_health_covers_parameters_but_not_module_buffers():
    checked = make().checked()
    assert checked("model.w") and not checked("model.mask")
    assert checked("optimizer.state.0.exp_avg")


def test_load_brings_the_counters_back():
    state = make()
    nested = unflatten(*state.snapshot(7, None, None))
    fresh = make()
    fresh.load(nested, None)
    assert fresh.step == 7
    fresh.step = 0
    fresh.load(nested, ["model."])
    assert fresh.step == 0  # a partial load leaves the counters alone
