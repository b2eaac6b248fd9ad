"""Nested state <-> (JSON skeleton, named tensors), with key paths and prefix selection; never pickle."""

from __future__ import annotations

import base64
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from supervisor.dtypes import DTYPE_NAMES
from supervisor.errors import UnsupportedStateError

__all__ = [
    "MISSING",
    "UnsupportedStateError",
    "child_path",
    "could_match",
    "flatten",
    "matches",
    "overlay",
    "tensor_paths",
    "unflatten",
]

#: Stands for a tensor that was not loaded (outside the requested prefixes).
MISSING: Any = type("_Missing", (), {"__repr__": lambda self: "MISSING"})()

_TAGS = ("__tensor__", "__ndarray__", "__tuple__", "__dict__", "__float__", "__npscalar__", "__bytes__")
_TAGS += ("__dtype__", "__device__", "__size__")
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def child_path(path: str, key: Any) -> str:
    """Key path of `key` under `path` ("model" + "encoder.weight" -> "model.encoder.weight")."""
    return f"{path}.{key}" if path else str(key)


def matches(path: str, prefixes: Iterable[str] | None) -> bool:
    """True when `path` is selected by one of `prefixes` ("model.encoder" selects "model.encoder.w")."""
    if prefixes is None:
        return True
    for prefix in prefixes:
        p = prefix.rstrip(".")
        if path == p or path.startswith(p + "."):
            return True
    return False


def could_match(path: str, prefixes: Iterable[str] | None) -> bool:
    """True when `path` or something under it is selected by `prefixes`."""
    if prefixes is None:
        return True
    return matches(path, prefixes) or any(p.rstrip(".").startswith(path + ".") for p in prefixes)


def flatten(nested: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Split `nested` into a JSON-able skeleton and a dict of tensors named by key path."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(nested, path, tensors), tensors


def _name(path: str, tensors: Mapping[str, Any]) -> str:
    name, n = path or "<root>", 1
    while name in tensors:
        n += 1
        name = f"{path}#{n}"
    return name


def _check_tensor(value: torch.Tensor, path: str) -> None:
    if type(value) not in (torch.Tensor, torch.nn.Parameter) or value.layout != torch.strided:
        raise UnsupportedStateError(path, value)
    if value.is_quantized or value.is_meta or value.dtype not in DTYPE_NAMES:
        raise UnsupportedStateError(path, value)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, torch.Tensor):
        _check_tensor(value, path)
        name = _name(path, tensors)
        tensors[name] = value
        return {"__tensor__": name}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biufc" or value.dtype.byteorder == ">":
            raise UnsupportedStateError(path, value)
        name = _name(path, tensors)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value))
        return {"__ndarray__": name}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {"__npscalar__": [value.dtype.str, _encode(value.item(), path, tensors)]}
    if isinstance(value, dict):
        items = [(k, _encode(v, child_path(path, k), tensors)) for k, v in value.items()]
        if all(type(k) is str and not k.startswith("__") for k, _ in items):
            return dict(items)
        return {"__dict__": [[_encode_key(k, path), v] for k, v in items]}
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if kind is list:
        return [_encode(v, child_path(path, i), tensors) for i, v in enumerate(value)]
    if kind is tuple:
        return {"__tuple__": [_encode(v, child_path(path, i), tensors) for i, v in enumerate(value)]}
    if kind is bytes:
        return {"__bytes__": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    raise UnsupportedStateError(path, value)


def _encode_key(key: Any, path: str) -> Any:
    if key is None or type(key) in (bool, int, str) or (type(key) is float and math.isfinite(key)):
        return key
    if type(key) is tuple:
        return {"__tuple__": [_encode_key(k, path) for k in key]}
    raise UnsupportedStateError(child_path(path, repr(key)), key)


def unflatten(skeleton: Any, tensors: Mapping[str, Any]) -> Any:
    """Rebuild the nested state; a tensor absent from `tensors` becomes MISSING."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if len(skeleton) == 1:
        ((tag, arg),) = skeleton.items()
        if tag in _TAGS:
            return _decode_tag(tag, arg, tensors)
    return {k: unflatten(v, tensors) for k, v in skeleton.items()}


def _decode_tag(tag: str, arg: Any, tensors: Mapping[str, Any]) -> Any:
    if tag == "__tensor__":
        return tensors.get(arg, MISSING)
    if tag == "__ndarray__":
        found = tensors.get(arg, MISSING)
        return found if found is MISSING else found.numpy().copy()
    if tag == "__tuple__":
        return tuple(unflatten(v, tensors) for v in arg)
    if tag == "__dict__":
        return {_decode_key(k): unflatten(v, tensors) for k, v in arg}
    if tag == "__float__":
        return float(arg)
    if tag == "__npscalar__":
        return np.dtype(arg[0]).type(unflatten(arg[1], tensors))
    if tag == "__bytes__":
        return base64.b64decode(arg)
    if tag == "__dtype__":
        return _DTYPES[arg]
    if tag == "__device__":
        return torch.device(arg)
    return torch.Size(arg)


def _decode_key(key: Any) -> Any:
    if isinstance(key, dict):
        return tuple(_decode_key(k) for k in key["__tuple__"])
    return key


def tensor_paths(skeleton: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Yield (tensor name, key path) for every tensor in `skeleton`."""
    if isinstance(skeleton, list):
        for i, v in enumerate(skeleton):
            yield from tensor_paths(v, child_path(path, i))
    elif isinstance(skeleton, dict):
        if len(skeleton) == 1:
            ((tag, arg),) = skeleton.items()
            if tag in ("__tensor__", "__ndarray__"):
                yield arg, path
                return
            if tag == "__tuple__":
                yield from tensor_paths(arg, path)
                return
            if tag == "__dict__":
                for k, v in arg:
                    yield from tensor_paths(v, child_path(path, _decode_key(k)))
                return
            if tag in _TAGS:
                return
        for k, v in skeleton.items():
            yield from tensor_paths(v, child_path(path, k))


def leaf_paths(nested: Any, path: str = "") -> Iterator[str]:
    """Yield the key path of every leaf of a nested state."""
    if isinstance(nested, dict):
        for k, v in nested.items():
            yield from leaf_paths(v, child_path(path, k))
    elif type(nested) in (list, tuple):
        for i, v in enumerate(nested):
            yield from leaf_paths(v, child_path(path, i))
    else:
        yield path


def overlay(current: Any, saved: Any, path: str, prefixes: Iterable[str]) -> Any:
    """`current` with every leaf selected by `prefixes` replaced by its value in `saved`."""
    if matches(path, prefixes):
        return saved
    if isinstance(saved, dict) and isinstance(current, dict):
        out = dict(current)
        for key, value in saved.items():
            sub = child_path(path, key)
            if not could_match(sub, prefixes):
                continue
            if key in current:
                out[key] = overlay(current[key], value, sub, prefixes)
            else:
                out[key] = _only_selected(value, sub, prefixes)
        return out
    if type(saved) in (list, tuple) and type(current) is type(saved) and len(saved) == len(current):
        merged = [
            overlay(c, s, child_path(path, i), prefixes)
            for i, (c, s) in enumerate(zip(current, saved, strict=True))
        ]
        return merged if type(saved) is list else tuple(merged)
    return current


def _only_selected(saved: Any, path: str, prefixes: Iterable[str]) -> Any:
    if matches(path, prefixes) or not isinstance(saved, dict):
        return saved
    return {
        k: _only_selected(v, child_path(path, k), prefixes)
        for k, v in saved.items()
        if could_match(child_path(path, k), prefixes)
    }
