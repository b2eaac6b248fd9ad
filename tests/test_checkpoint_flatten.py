"""Nested state <-> JSON skeleton + tensors: exact round trips, clear refusals, key-path selection."""

from __future__ import annotations

import json
import math
from collections import OrderedDict

import numpy as np
import pytest
import torch

from supervisor.errors import UnsupportedStateError
from supervisor.flatten import (
    MISSING,
    flatten,
    leaf_paths,
    matches,
    overlay,
    tensor_paths,
    unflatten,
)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


ROUND_TRIPS = [
    ("scalars", {"i": 3, "f": 0.1, "neg0": -0.0, "s": "x", "b": True, "n": None, "big": 2**80}),
    ("non-finite floats", {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}),
    (
        "int keys (optimizer state)",
        {"state": {0: {"step": torch.tensor(3.0)}, 1: {}}, "param_groups": [{"params": [0, 1]}]},
    ),
    ("tuple and nested tuple keys", {(1, "a"): (1, 2.5, ("x",)), "t": ()}),
    ("reserved-looking keys", {"__tensor__": 1, "__dict__": [1]}),
    (
        "tensors of many dtypes",
        {
            str(d): torch.arange(6).to(d).reshape(2, 3)
            for d in (torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.float64)
        },
    ),
    ("0-dim and empty tensors", {"z": torch.tensor(1.5), "e": torch.empty(0, 4)}),
    (
        "numpy array and scalars",
        {"a": np.arange(5, dtype=np.int32), "f": np.float32(1.25), "i": np.int64(-7)},
    ),
    (
        "bytes, dtype, device, size",
        {"b": b"\x00\xff", "d": torch.float16, "dev": torch.device("cpu"), "s": torch.Size([2, 3])},
    ),
    ("python random state", {"rng": (3, tuple(range(625)), None)}),
]


@pytest.mark.parametrize("name,nested", ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_round_trip_is_exact_through_json(name, nested):
    skeleton, tensors = flatten(nested)
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))
    assert _same(nested, unflatten(skeleton, {k: v.clone() for k, v in tensors.items()}))


def test_ordered_dict_and_parameters_flatten_as_dict_and_tensor():
    model = torch.nn.Linear(2, 3)
    sd = model.state_dict()
    assert isinstance(sd, OrderedDict)
    skeleton, tensors = flatten({"model": sd, "p": model.weight})
    assert sorted(tensors) == ["model.bias", "model.weight", "p"]
    back = unflatten(skeleton, tensors)
    assert type(back["model"]) is dict and torch.equal(back["p"], model.weight.detach())


UNSUPPORTED = [
    ("object", {"a": {"b": [1, object()]}}, "a.b.1"),
    ("function", {"fn": lambda: 1}, "fn"),
    ("set", {"opt": {"s": {1, 2}}}, "opt.s"),
    ("sparse tensor", {"w": torch.eye(2).to_sparse()}, "w"),
    ("object key", {"k": {object(): 1}}, "k."),
    ("numpy object array", {"arr": np.array([object()])}, "arr"),
    ("dtype safetensors cannot hold", {"z": torch.zeros(2, dtype=torch.complex128)}, "z"),
]


@pytest.mark.parametrize("name,nested,path", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_leaf_names_its_key_path(name, nested, path):
    with pytest.raises(UnsupportedStateError) as err:
        flatten(nested)
    assert err.value.key_path.startswith(path)
    assert path in str(err.value)


def test_tensor_names_are_key_paths_and_collisions_get_a_suffix():
    skeleton, tensors = flatten({"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}})
    assert sorted(tensors) == ["a.b", "a.b#2"]
    assert dict(tensor_paths(skeleton)) == {"a.b": "a.b", "a.b#2": "a.b"}


def test_missing_tensor_unflattens_as_marker():
    skeleton, _ = flatten({"w": torch.zeros(2), "x": 1})
    assert unflatten(skeleton, {}) == {"w": MISSING, "x": 1}


MATCHES = [
    ("model.encoder.weight", ["model.encoder."], True),
    ("model.encoder.weight", ["model.encoder"], True),
    ("model.encoder", ["model.encoder."], True),
    ("model.encoderx.weight", ["model.encoder"], False),
    ("model.enc", ["model.encoder"], False),
    ("optimizer.state.0.exp_avg", ["optimizer"], True),
    ("rng.torch", ["model", "rng.torch"], True),
    ("anything", None, True),
]


@pytest.mark.parametrize("path,prefixes,expected", MATCHES)
def test_prefix_matching(path, prefixes, expected):
    assert matches(path, prefixes) is expected


def test_overlay_replaces_only_selected_leaves():
    current = {"encoder.w": 1, "decoder.w": 2, "groups": [{"lr": 0.1}, {"lr": 0.2}]}
    saved = {"encoder.w": 10, "decoder.w": 20, "groups": [{"lr": 1.0}, {"lr": 2.0}]}
    assert overlay(current, saved, "model", ["model.encoder"]) == {**current, "encoder.w": 10}
    assert overlay(current, saved, "model", ["model.groups.1.lr"])["groups"] == [{"lr": 0.1}, {"lr": 2.0}]
    assert list(leaf_paths(saved, "model")) == [
        "model.encoder.w",
        "model.decoder.w",
        "model.groups.0.lr",
        "model.groups.1.lr",
    ]
