"""Schema types in plain words ("an integer >= 1 or null"), shared by load errors and the reference."""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

_NONE = type(None)


def strip_annotated(tp: Any) -> Any:
    """`Annotated[X, ...]` -> X."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def union_members(tp: Any) -> tuple[list[Any], bool]:
    """The non-None members of a (possibly Optional) union, and whether None is allowed."""
    tp = strip_annotated(tp)
    if get_origin(tp) in (Union, types.UnionType):
        args = [strip_annotated(a) for a in get_args(tp)]
        members: list[Any] = []
        for arg in args:
            if get_origin(arg) in (Union, types.UnionType):
                inner, _ = union_members(arg)
                members.extend(inner)
            elif arg is not _NONE:
                members.append(arg)
        return members, _NONE in args
    return [tp], False


def model_keys(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """A model's fields by the key a user writes (the alias where there is one)."""
    return {(info.alias or name): info for name, info in model.model_fields.items()}


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for item in metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            value = getattr(item, attr, None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                parts.append(f"{sign} {value:g}" if isinstance(value, float) else f"{sign} {value}")
    return " " + " and ".join(parts) if parts else ""


def _min_length(metadata: list[Any]) -> int:
    return max((getattr(m, "min_length", 0) or 0 for m in metadata), default=0)


def describe(tp: Any, metadata: list[Any] | None = None, examples: list[Any] | None = None) -> str:
    """What a value of type `tp` with pydantic `metadata` looks like, in words."""
    metadata = metadata or []
    members, nullable = union_members(tp)
    if len(members) > 1:
        if all(isinstance(m, type) and issubclass(m, BaseModel) and hasattr(m, "TAG") for m in members):
            key = "select" if "select" in model_keys(members[0]) else "type"
            text = f"a mapping with a {key} key"
        else:
            text = " or ".join(describe(m) for m in members)
    else:
        text = _describe_one(members[0], metadata, examples)
    return f"{text} or null" if nullable else text


def _describe_one(tp: Any, metadata: list[Any], examples: list[Any] | None) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        values = [str(v) for v in get_args(tp)]
        return values[0] if len(values) == 1 else "one of " + ", ".join(values)
    if origin is list:
        (item,) = get_args(tp)
        lead = "a non-empty list" if _min_length(metadata) else "a list"
        return f"{lead} {_plural(item)}"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer" + _bounds(metadata)
    if tp is float:
        return "a number" + _bounds(metadata)
    if tp is str:
        if examples:
            return f'a string like "{examples[0]}"'
        return "a non-empty string" if _min_length(metadata) else "a string"
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return "a mapping"
    return str(tp)


def _plural(item: Any) -> str:
    members, _ = union_members(item)
    if len(members) > 1:
        return "of mappings, each with a type key"
    item = members[0]
    if get_origin(item) is Literal:
        return "of values from: " + ", ".join(str(v) for v in get_args(item))
    if item is str:
        return "of strings"
    if isinstance(item, type) and issubclass(item, BaseModel):
        return "of mappings"
    return "of " + describe(item)


def describe_field(info: FieldInfo) -> str:
    """What a field accepts, in words."""
    return describe(info.annotation, list(info.metadata), info.examples)
