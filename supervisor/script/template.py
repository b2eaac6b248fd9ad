"""The relaunch argument template of script mode: `--learning_rate={lr * lr_scale}`, with no code evaluated.

A field is a product of names and number literals, `{name}`, `{lr * lr_scale}` or `{0.5 * lr}`, optionally with
a format spec, `{lr * lr_scale:.3e}`. Nothing else is accepted: no attribute or index access, no conversion
(`!r`), no other operator. Names are the built-in fields (`checkpoint`, `step`, `lr_scale`, `skip_batches`)
and the policy's `script.relaunch.values`. `{{` and `}}` are literal braces.

A float is written so that Python reads it back as a float (`0.5`, `2.0`, `3e-05`), because scripts such as
nanoGPT's refuse an override whose type differs from the default's (`--learning_rate=2` would be an int).
Pure: no I/O. Imports only the standard library, so the policy schema can check templates at load time.
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The fields every relaunch fills in, and their types.
BUILTIN_FIELDS: dict[str, type] = {"checkpoint": str, "step": int, "lr_scale": float, "skip_batches": int}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT = re.compile(r"^[0-9]+$")
_FLOAT = re.compile(r"^(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][-+]?[0-9]+)?$")
_FIELD = re.compile(r"\{\{|\}\}|\{[^{}]*\}")


class TemplateError(ValueError):
    """A template item is malformed; `item` is its index in the list (None for a single string)."""

    def __init__(self, item: int | None, expected: str, found: str):
        self.item, self.expected, self.found = item, expected, found
        super().__init__(f"expected {expected}, got {found}")


@dataclass(frozen=True)
class Field:
    """One `{...}`: the factors of its product (names and numbers) and its format spec."""

    factors: tuple[str | int | float, ...]
    spec: str
    kind: type

    def value(self, values: Mapping[str, object]) -> object:
        if self.kind is str:
            return values[str(self.factors[0])]
        product: int | float = 1
        for factor in self.factors:
            product = product * (values[factor] if isinstance(factor, str) else factor)  # type: ignore[operator]
        return product

    def render(self, values: Mapping[str, object]) -> str:
        value = self.value(values)
        if self.spec:
            return format(value, self.spec)
        if isinstance(value, float):
            return repr(float(format(value, ".12g")))  # 0.1 * 3 is 0.30000000000000004: print 0.3
        return str(value)


Part = str | Field


@dataclass(frozen=True)
class ArgTemplate:
    """Arguments appended to the command on a relaunch, each a sequence of literal text and fields."""

    items: tuple[tuple[Part, ...], ...]

    @classmethod
    def parse(cls, args: str | Sequence[str], values: Mapping[str, float] | None = None) -> ArgTemplate:
        """Parse a list of arguments, or one string split like a shell does; TemplateError says what is wrong."""
        names = {**BUILTIN_FIELDS, **dict.fromkeys(values or {}, float)}
        if isinstance(args, str):
            return cls(tuple(_parse_item(item, names, None) for item in _split(args)))
        return cls(tuple(_parse_item(item, names, i) for i, item in enumerate(args)))

    @property
    def fields(self) -> frozenset[str]:
        """Every name some field uses."""
        return frozenset(
            f for item in self.items for part in item if isinstance(part, Field) for f in part.factors
            if isinstance(f, str)
        )  # fmt: skip

    def render(self, values: Mapping[str, object]) -> list[str]:
        """The arguments with every field filled in from `values` (which must hold every name used)."""
        return ["".join(p if isinstance(p, str) else p.render(values) for p in item) for item in self.items]

    def preview(self, values: Mapping[str, float]) -> list[str]:
        """The arguments as a relaunch at `lr_scale` 1 with no skip renders them; fields naming `checkpoint` or
        `step` (known only at the relaunch) stay as written."""
        fixed = {**values, "lr_scale": 1.0, "skip_batches": 0}
        return ["".join(_preview(p, fixed) for p in item) for item in self.items]

    def options(self, values: Mapping[str, float]) -> list[tuple[str, str]]:
        """(`--key`, value) of each `--key=...` item whose value has fields, none naming `checkpoint` or
        `step`, rendered at `lr_scale` 1 with no skip: what the first launch's command should already say."""
        fixed = {**values, "lr_scale": 1.0, "skip_batches": 0}
        out = []
        for item in self.items:
            head = item[0] if item and isinstance(item[0], str) else ""
            fields = [p for p in item if isinstance(p, Field)]
            names = {f for p in fields for f in p.factors if isinstance(f, str)}
            if not head.startswith("-") or "=" not in head or not fields or names & {"checkpoint", "step"}:
                continue
            key, _, rest = head.partition("=")
            out.append((key, rest + "".join(p if isinstance(p, str) else p.render(fixed) for p in item[1:])))
        return out


def _preview(part: Part, values: Mapping[str, object]) -> str:
    if isinstance(part, str):
        return part
    if any(f in ("checkpoint", "step") for f in part.factors):
        return "{" + " * ".join(str(f) for f in part.factors) + (":" + part.spec if part.spec else "") + "}"
    return part.render(values)


def _split(text: str) -> list[str]:
    """Split like a shell, keeping each `{...}` whole even when it holds spaces (`{lr * lr_scale}`)."""
    fields: list[str] = []

    def hide(match: re.Match[str]) -> str:
        fields.append(match.group(0))
        return f"\x00{len(fields) - 1}\x00"

    try:
        words = shlex.split(_FIELD.sub(hide, text))
    except ValueError as exc:
        raise TemplateError(None, "arguments quoted as a shell would", f"{text!r} ({exc})") from None
    return [re.sub(r"\x00(\d+)\x00", lambda m: fields[int(m.group(1))], w) for w in words]


def _parse_item(item: str, names: Mapping[str, type], index: int | None) -> tuple[Part, ...]:
    parts: list[Part] = []
    try:
        parsed = list(string.Formatter().parse(item))
    except ValueError as exc:
        raise TemplateError(
            index, "text with balanced braces ({{ and }} for literal ones)", f"{item!r} ({exc})"
        ) from None
    for literal, name, spec, conversion in parsed:
        if literal:
            parts.append(literal)
        if name is None:
            continue
        if conversion is not None:
            raise TemplateError(index, "a field without a conversion", f"{{{name}!{conversion}}}")
        parts.append(_field(name, spec or "", names, index))
    return tuple(parts)


def _field(text: str, spec: str, names: Mapping[str, type], index: int | None) -> Field:
    shown = "{" + text + (":" + spec if spec else "") + "}"
    factors: list[str | int | float] = []
    for word in (w.strip() for w in text.split("*")):
        if _NAME.match(word):
            if word not in names:
                known = ", ".join(sorted(names))
                raise TemplateError(
                    index, f"a field naming one of {known}", f"{shown} (unknown name {word!r})"
                )
            factors.append(word)
        elif _INT.match(word):
            factors.append(int(word))
        elif _FLOAT.match(word):
            factors.append(float(word))
        else:
            raise TemplateError(
                index, "a field that is a name or a product like {lr * lr_scale}", f"{shown} ({word!r})"
            )
    kinds = [names[f] if isinstance(f, str) else type(f) for f in factors]
    if str in kinds and len(factors) > 1:
        raise TemplateError(index, "{checkpoint} on its own (a path cannot be multiplied)", shown)
    kind = str if str in kinds else float if float in kinds else int
    if "{" in spec or "}" in spec:
        raise TemplateError(index, "a format spec without fields in it", shown)
    if spec:
        try:
            format({str: "x", int: 1, float: 1.0}[kind], spec)
        except ValueError as exc:
            raise TemplateError(index, f"a format spec for a {kind.__name__}", f"{shown} ({exc})") from None
    return Field(tuple(factors), spec, kind)
