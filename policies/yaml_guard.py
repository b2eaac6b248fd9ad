"""Read untrusted policy YAML within bounds: regular files only, a size cap, bounded nesting and alias expansion.

A policy is a small hand-written file, so every bound here is far above what a real one needs and far below
what exhausts the validator: a billion-laughs alias bomb, a file nested 20k deep, `/dev/zero` or a FIFO.
The limits are checked on the parser's event stream, before any node or Python object is built.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from supervisor.errors import PolicyError
from supervisor.smallfile import FileTooLarge, NotRegularFile, read_small_file

#: Largest policy file read; the shipped presets are 1-3 KB.
MAX_BYTES = 1 << 20
#: Deepest nesting of mappings and sequences, aliases expanded; a policy needs about 6.
MAX_DEPTH = 64
#: Nodes that all aliases together may bring in; a policy's anchors expand to tens.
MAX_ALIAS_NODES = 10_000
#: Nodes in the whole document, aliases expanded; a policy has a few hundred. This bounds the work of every
#: later stage (composing, validation, the error walk) whatever the text looks like.
MAX_NODES = 50_000

# libyaml parses ~20x faster than the pure-Python parser; both build the same nodes with the same marks.
_FastLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # type: ignore[assignment]


def read_policy_text(name: str) -> str:
    """The text of a policy file; PolicyError for anything but a readable regular UTF-8 file of at most MAX_BYTES."""
    try:
        data = read_small_file(name, MAX_BYTES)
    except NotRegularFile as exc:
        raise PolicyError([f"{name}: expected a policy file, got {exc.kind}: not a regular file"]) from None
    except FileTooLarge as exc:
        raise PolicyError([_too_big(name, exc.size)]) from None
    except OSError as exc:
        raise PolicyError([f"{name}: expected a readable policy file, got {exc.strerror or exc}"]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PolicyError(
            [f"{name}: expected UTF-8 text, got undecodable bytes at offset {exc.start}"]
        ) from None


def check_size(text: str, filename: str) -> None:
    """Refuse policy text over the cap (for text handed to the loader directly)."""
    if len(text) > MAX_BYTES:
        raise PolicyError([_too_big(filename, len(text.encode("utf-8", "surrogatepass")))])


def _too_big(name: str, size: int) -> str:
    return (
        f"{name}: expected a policy file of at most {MAX_BYTES} bytes (1 MiB), got {size} bytes; "
        "a policy is a small YAML file"
    )


class _Frame:
    """An open mapping or sequence: its anchor, the nodes it holds (aliases expanded) and its height."""

    __slots__ = ("anchor", "nodes", "height")

    def __init__(self, anchor: str | None):
        self.anchor, self.nodes, self.height = anchor, 1, 1


def check_bounds(text: str, filename: str, loader_class: type = _FastLoader) -> bool:
    """Walk the YAML events once; PolicyError at `file:line:col` for nesting or alias expansion over the limits.

    Returns False when the text is not valid YAML: the caller's composer then reports the syntax error.
    """
    loader = loader_class(text)
    stack: list[_Frame] = []
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, height) with aliases expanded
    brought = total = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            if total > MAX_NODES:
                _refuse(
                    filename, event, f"at most {MAX_NODES} YAML nodes (a policy has a few hundred), got more"
                )
            if isinstance(event, yaml.CollectionStartEvent):
                if len(stack) >= MAX_DEPTH:
                    _refuse(filename, event, f"nesting at most {MAX_DEPTH} levels deep, got deeper here")
                stack.append(_Frame(event.anchor))
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                frame = stack.pop()
                nodes, height = frame.nodes, frame.height
                if frame.anchor is not None:
                    anchors[frame.anchor] = (nodes, height)
            elif isinstance(event, yaml.AliasEvent):
                if any(f.anchor == event.anchor for f in stack):
                    _refuse(
                        filename,
                        event,
                        f"an alias to a finished node, got *{_cut(event.anchor)} inside its anchor",
                    )
                nodes, height = anchors.get(event.anchor, (1, 1))  # undefined: the composer reports it
                brought += nodes
                if brought > MAX_ALIAS_NODES:
                    _refuse(
                        filename,
                        event,
                        f"aliases that bring in at most {MAX_ALIAS_NODES} nodes in all, got more with "
                        f"*{_cut(event.anchor)} ({nodes} nodes)",
                    )
                if len(stack) + height > MAX_DEPTH:
                    _refuse(
                        filename,
                        event,
                        f"nesting at most {MAX_DEPTH} levels deep, got {len(stack) + height} with *{_cut(event.anchor)}",
                    )
            elif isinstance(event, yaml.ScalarEvent):
                nodes, height = 1, 1
                if event.anchor is not None:
                    anchors[event.anchor] = (1, 1)
            else:
                continue
            total += nodes if isinstance(event, yaml.AliasEvent) else 1
            if stack:
                stack[-1].nodes += nodes
                stack[-1].height = max(stack[-1].height, height + 1)
    except yaml.YAMLError:
        return False
    finally:
        loader.dispose()
    return True


def _refuse(filename: str, event: yaml.Event, expected: str) -> None:
    mark = event.start_mark
    raise PolicyError([f"{filename}:{mark.line + 1}:{mark.column + 1}: (syntax): expected {expected}"])


def _cut(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def brief(value: Any, limit: int = 60) -> str:
    """`value` as JSON (strings quoted, null/true/false), cut to `limit` characters without encoding the rest."""
    encoder = json.JSONEncoder(ensure_ascii=False, default=str)
    out: list[str] = []
    size = 0
    try:
        for chunk in encoder.iterencode(value):  # lazy: a huge value is never encoded in full
            out.append(chunk)
            size += len(chunk)
            if size > limit:
                break
    except ValueError:  # a circular value (never from checked YAML; possible from Python callers)
        out, size = [repr(type(value))], 0
    text = "".join(out)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SafeLoader(yaml.SafeLoader):
    """The pure-Python safe loader: its syntax error messages are the ones users see."""


class FastSafeLoader(_FastLoader):  # type: ignore[misc, valid-type]
    """libyaml's safe loader: the same nodes and marks, for valid files."""


def _marked(construct: Any) -> Any:
    """A constructor whose ValueError (a 5000-digit int, month 13 in a date) becomes a ConstructorError here."""

    def construct_marked(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        try:
            return construct(loader, node)
        except (ValueError, OverflowError) as exc:
            raise yaml.constructor.ConstructorError(
                None, None, _construct_problem(node, exc), node.start_mark
            ) from None

    return construct_marked


for _loader in (SafeLoader, FastSafeLoader):
    for _tag in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:timestamp"):
        _loader.add_constructor(_tag, _marked(yaml.SafeLoader.yaml_constructors[_tag]))


def _construct_problem(node: yaml.Node, exc: Exception) -> str:
    if node.tag == "tag:yaml.org,2002:int" and isinstance(node.value, str):
        digits = sum(c.isdigit() for c in node.value)
        return f"an integer of {digits} digits (Python reads at most {_int_digits()})"
    return f"{node.tag.rsplit(':', 1)[-1]} {brief(node.value if isinstance(node.value, str) else '...')} ({_cut(str(exc), 80)})"


def _int_digits() -> int:
    import sys

    get = getattr(sys, "get_int_max_str_digits", None)
    return get() if get else 4300
