"""TrainingState: registration rules, every RNG stream, counters, extras, partial restore."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from supervisor.errors import CheckpointError, UserError
from supervisor.state import TrainingState, capture_rng, restore_rng


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), float(np.random.standard_normal()), torch.rand(3))


def test_rng_capture_restores_every_stream_exactly():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state
    np.random.standard_normal()
    saved = copy.deepcopy(capture_rng())
    first = _draws()
    restore_rng(saved)
    again = _draws()
    assert first[:3] == again[:3]
    assert torch.equal(first[3], again[3])


def test_rng_capture_is_json_and_tensors_only():
    rng = capture_rng()
    assert set(rng) >= {"python", "numpy", "torch"}
    assert isinstance(rng["torch"], torch.Tensor)
    assert all(type(k) is int for k in rng["numpy"]["keys"])
    assert ("cuda" in rng) == torch.cuda.is_available()


@pytest.mark.parametrize(
    "name,obj,message",
    [
        ("", torch.nn.Linear(1, 1), "non-empty"),
        ("a.b", torch.nn.Linear(1, 1), "without '.'"),
        ("rng", torch.nn.Linear(1, 1), "reserved"),
        ("counters", torch.nn.Linear(1, 1), "reserved"),
        ("model", object(), "state_dict()"),
    ],
)
def test_register_rejects_bad_names_and_objects(name, obj, message):
    state = TrainingState()
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        state.register(name, obj)


def test_register_twice_is_an_error():
    state = TrainingState()
    state.register("model", torch.nn.Linear(1, 1))
    with pytest.raises(UserError, match="already registered"):
        state.register("model", torch.nn.Linear(1, 1))


def _setup(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    state = TrainingState()
    state.register("model", model)
    state.register("optimizer", opt)
    return state, model, opt


def test_full_round_trip_restores_parts_counters_and_extras():
    state, model, opt = _setup(0)
    state.step, state.epoch, state.samples_seen = 7, 2, 700
    state.extras = {"best": 0.5, "hist": torch.arange(3)}
    nested = copy.deepcopy(state.state_dict())
    other, model2, opt2 = _setup(1)
    other.load_state_dict(nested)
    assert (other.step, other.epoch, other.samples_seen) == (7, 2, 700)
    assert other.extras["best"] == 0.5 and torch.equal(other.extras["hist"], torch.arange(3))
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])


def test_partial_restore_touches_only_the_selected_prefix():
    state, model, _ = _setup(0)
    nested = copy.deepcopy(state.state_dict())
    other, model2, opt2 = _setup(1)
    before_second = copy.deepcopy(model2[1].state_dict())
    before_opt = copy.deepcopy(opt2.state_dict())
    before_rng = torch.get_rng_state()
    other.step = 99
    other.load_state_dict(nested, prefixes=["model.0."])
    assert torch.equal(model2[0].weight, model[0].weight)
    assert torch.equal(model2[1].weight, before_second["weight"])
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], before_opt["state"][0]["exp_avg"])
    assert other.step == 99
    assert torch.equal(torch.get_rng_state(), before_rng)


def test_prefix_that_selects_nothing_is_an_error():
    state, _, _ = _setup(0)
    with pytest.raises(CheckpointError, match="selects nothing"):
        state.load_state_dict(state.state_dict(), prefixes=["model.encoder"])


def test_missing_registered_part_is_an_error_naming_it():
    state, _, _ = _setup(0)
    nested = state.state_dict()
    del nested["optimizer"]
    with pytest.raises(CheckpointError, match="'optimizer'"):
        state.load_state_dict(nested)


def test_live_tensors_alias_model_and_optimizer_memory():
    state, model, opt = _setup(0)
    live = state.live_tensors()
    assert live["model.0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert live["optimizer.state.0.exp_avg"].data_ptr() == opt.state[model[0].weight]["exp_avg"].data_ptr()


def test_a_plain_stateful_dataloader_is_kept_in_its_exact_form():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from supervisor.data import StatefulLoaderState

    loader = StatefulDataLoader(torch.arange(8), batch_size=2, shuffle=True, generator=torch.Generator())
    state = TrainingState()
    assert state.register("data", loader) is loader  # the caller keeps its own object
    assert isinstance(state["data"], StatefulLoaderState) and state["data"].loader is loader
    assert set(state.state_dict()["data"]) == {"loader", "generator", "batches_skipped"}


def test_a_plain_dataloader_is_refused_with_the_fix():
    with pytest.raises(UserError, match="ResumableLoader"):
        TrainingState().register("data", torch.utils.data.DataLoader(torch.arange(8), shuffle=True))


def test_worker_rng_capture_leaves_cuda_out():
    assert "cuda" not in capture_rng(cuda=False)
