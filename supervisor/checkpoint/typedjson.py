"""Frozen dataclasses from parsed JSON, every field checked against its annotation (one-line ValueErrors).

A store file may have been rewritten by someone else, so a field that parses as JSON may still have the wrong
type ("shape": "abc" would become ('a', 'b', 'c')). Each dataclass's annotations are compiled once into
checks; a field whose annotation is not understood here is passed through as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import MISSING, fields
from typing import Any

from supervisor.checkpoint.boundedjson import preview

#: Where a value sits: field names (str), list indexes (int) and dict keys (1-tuples), outermost first.
#: Kept as a tuple and written out only for a message, since a large manifest holds 100k values.
Path = tuple[Any, ...]
#: check(value, path) -> the value as the field's type; ValueError naming the path if it is not.
Check = Callable[[Any, Path], Any]


def _where(path: Path) -> str:
    out = ""
    for key in path:
        if type(key) is int:
            out += f"[{key}]"
        elif type(key) is tuple:
            out += f"[{preview(key[0])}]"
        else:
            out += f".{key}" if out else str(key)
    return out or "top level"


class Schema:
    """How one file's JSON maps onto dataclasses: its name for messages, the nested dataclasses by name, and
    the fields whose integers count something (never negative; for a list, each item)."""

    def __init__(self, what: str, classes: Iterable[type], counts: Iterable[str] = ()):
        self.what = what
        self.classes = {c.__name__: c for c in classes}
        self.counts = frozenset(counts)
        self._specs: dict[type, tuple[dict[str, Check], tuple[str, ...]]] = {}

    def build(self, cls: Any, data: Any, path: Path = ()) -> Any:
        """A `cls` from JSON object `data`; ValueError with the first field that is missing, unknown or mistyped."""
        if type(data) is not dict:
            self._fail("an object", data, path)
        checks, required = self._spec(cls)
        for name in required:
            if name not in data:
                raise ValueError(f"{self.what}: {_where((*path, name))}: missing")
        out = {}
        for name, value in data.items():
            check = checks.get(name)
            if check is None:
                raise ValueError(f"{self.what}: {_where((*path, name))}: unknown field")
            out[name] = check(value, (*path, name))
        return cls(**out)

    def _spec(self, cls: type) -> tuple[dict[str, Check], tuple[str, ...]]:
        spec = self._specs.get(cls)
        if spec is None:
            found = fields(cls)  # type: ignore[arg-type]
            checks = {f.name: self._compile(str(f.type), f.name in self.counts) for f in found}
            required = tuple(f.name for f in found if f.default is MISSING and f.default_factory is MISSING)
            spec = self._specs[cls] = (checks, required)
        return spec

    def _fail(self, expected: str, value: Any, path: Path) -> Any:
        raise ValueError(f"{self.what}: {_where(path)}: expected {expected}, found {preview(value)}")

    def _compile(self, annotation: str, count: bool = False) -> Check:
        """The check for a field annotated `annotation` (the subset of typing our files use)."""
        fail = self._fail
        if annotation.endswith(" | None"):
            inner = self._compile(annotation.removesuffix(" | None"), count)
            return lambda v, p: None if v is None else inner(v, p)
        if annotation.startswith("dict[str, ") and annotation.endswith("]"):
            item = self._compile(annotation[len("dict[str, ") : -1])

            def check_dict(v: Any, p: Path) -> Any:
                if type(v) is not dict:
                    return fail(annotation, v, p)
                return {name: item(x, (*p, (name,))) for name, x in v.items()}

            return check_dict
        for prefix, suffix, kind in (("list[", "]", list), ("tuple[", ", ...]", tuple)):
            if annotation.startswith(prefix) and annotation.endswith(suffix):
                item = self._compile(annotation[len(prefix) : -len(suffix)], count)

                def check_seq(v: Any, p: Path, item: Check = item, kind: type = kind) -> Any:
                    if v is None and kind is list:
                        return []  # an absent list may be written as null
                    if type(v) is not list:
                        return fail(annotation, v, p)
                    return kind([item(x, (*p, i)) for i, x in enumerate(v)])

                return check_seq
        if annotation in self.classes:
            cls = self.classes[annotation]
            return lambda v, p: self.build(cls, v, p)
        if annotation == "int":
            if count:
                return lambda v, p: v if type(v) is int and v >= 0 else fail("an integer >= 0", v, p)
            return lambda v, p: v if type(v) is int else fail("an integer", v, p)
        if annotation == "float":

            def check_float(v: Any, p: Path) -> Any:
                if type(v) in (int, float):
                    try:
                        return float(v)
                    except OverflowError:  # a 400-digit integer
                        pass
                return fail("a number", v, p)

            return check_float
        if annotation in ("str", "bool"):
            kind = str if annotation == "str" else bool
            return lambda v, p: v if type(v) is kind else fail(f"a {annotation}", v, p)
        return lambda v, p: v
