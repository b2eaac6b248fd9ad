"""Load a policy file: YAML in, a validated `Policy` out, or one `file:line:col: key: expected, got` per problem."""

from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, TypeAdapter, ValidationError

from policies.base import PROBLEM
from policies.monitor_schema import DETECTOR_TYPES
from policies.schema import Policy
from policies.targets import BUILTIN_SELECTORS, TARGET_SELECT_ERROR
from policies.type_words import describe, model_keys, union_members
from policies.yaml_guard import (
    FastSafeLoader,
    SafeLoader,
    brief,
    check_bounds,
    check_size,
    read_policy_text,
)
from supervisor.errors import PolicyError

_SELECT_EXPECTED = "one of " + ", ".join(BUILTIN_SELECTORS) + ' or "module:function"'
_TYPE_EXPECTED = "one of " + ", ".join(DETECTOR_TYPES)
_MISSING = "nothing (required key missing)"
_MERGE = "tag:yaml.org,2002:merge"
#: Problems listed per file; the rest are counted. Past the first few, more lines only bury the cause.
MAX_PROBLEMS = 20

Problem = tuple[int, int, str]
#: Per mapping node (by id): its scalar keys -> (key node, value node), the last one winning as in construction.
_Index = dict[int, dict[str, tuple[yaml.Node, yaml.Node]]]


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy file; raise PolicyError listing every problem."""
    name = os.fspath(path)
    return parse_policy(read_policy_text(name), name)


def parse_policy(text: str, filename: str = "<string>") -> Policy:
    """Validate policy YAML text; `filename` only labels the messages."""
    check_size(text, filename)
    root, data, duplicates, total = _read_yaml(text, filename)
    problems = list(duplicates)
    if root is None:
        problems.append((0, 0, f"{filename}:1:1: (document): expected a policy mapping, got an empty file"))
        total += 1
    else:
        try:
            policy = Policy.model_validate(data)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
            total += len(errors)
            index: _Index = {}
            problems += [_locate(err, root, filename, text, index) for err in errors[:MAX_PROBLEMS]]
    if problems:
        raise PolicyError(_listing(problems, total, filename))
    return policy


def check_section(tp: Any, data: Any, where: str) -> Any:
    """Validate data built in code (not read from a file) against a schema type such as `list[DetectorSpec]`.

    Problems are worded as a policy file's are, located by `where` and the key path instead of a line:
    `detectors[0].window: expected an integer >= 2, got 0`.
    """
    try:
        return _adapter(tp).validate_python(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    lines = [_section_problem(err, tp, where) for err in errors[:MAX_PROBLEMS]]
    if len(errors) > MAX_PROBLEMS:
        lines.append(
            f"{where}: {len(errors) - MAX_PROBLEMS} more problem(s) not shown; fix the ones above first"
        )
    raise PolicyError(lines)


@functools.cache
def _adapter(tp: Any) -> TypeAdapter[Any]:
    return TypeAdapter(tp)


def _listing(problems: list[Problem], total: int, filename: str) -> list[str]:
    """The first MAX_PROBLEMS problems in file order, and how many more there were."""
    unique = sorted(set(problems), key=lambda p: (p[0], p[1]))
    lines = [line for _, _, line in unique[:MAX_PROBLEMS]]
    hidden = total - len(problems) + max(0, len(unique) - MAX_PROBLEMS)
    if hidden > 0:
        lines.append(f"{filename}: {hidden} more problem(s) not shown; fix the ones above first")
    return lines


def _read_yaml(text: str, filename: str) -> tuple[yaml.Node | None, Any, list[Problem], int]:
    """(root node, data, duplicate-key problems (the first MAX_PROBLEMS), how many there were)."""
    if check_bounds(text, filename):
        try:
            return _compose(FastSafeLoader, text, filename)
        except yaml.constructor.ConstructorError as exc:  # the same Python constructor runs in both loaders
            raise _yaml_problem(exc, filename) from None
        except yaml.YAMLError:
            pass  # libyaml words syntax errors its own way: let the pure-Python parser say it
    # The parsers may disagree on an edge case: bound what the pure-Python composer will recurse into too.
    check_bounds(text, filename, yaml.SafeLoader)
    try:
        return _compose(SafeLoader, text, filename)
    except yaml.YAMLError as exc:
        raise _yaml_problem(exc, filename) from None


def _compose(
    loader_class: type[yaml.SafeLoader], text: str, filename: str
) -> tuple[yaml.Node | None, Any, list[Problem], int]:
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        # Before construction: a merge (`<<: *base`) rewrites its mapping node to hold the merged keys.
        duplicates, count = _duplicate_keys(node, filename)
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    return node, data, duplicates, count


def _yaml_problem(exc: yaml.YAMLError, filename: str) -> PolicyError:
    if not isinstance(exc, yaml.MarkedYAMLError):
        return PolicyError([f"{filename}:1:1: (syntax): expected valid YAML, got {_cut(exc, 200)}"])
    mark = exc.problem_mark or exc.context_mark
    where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else f"{filename}:1:1"
    context = ""
    if exc.context:
        context = f" ({exc.context}"
        if exc.context_mark and exc.context_mark is not mark:
            context += f" at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
        context += ")"
    return PolicyError([f"{where}: (syntax): expected valid YAML, got {exc.problem}{context}"])


def _at(filename: str, node: yaml.Node, path: str, message: str) -> Problem:
    line, col = node.start_mark.line + 1, node.start_mark.column + 1
    return line, col, f"{filename}:{line}:{col}: {path or '(document)'}: {message}"


def _duplicate_keys(root: yaml.Node | None, filename: str) -> tuple[list[Problem], int]:
    """Keys written twice in one mapping (the first MAX_PROBLEMS), and how many; keys a merge brings may repeat."""
    problems: list[Problem] = []
    count = 0
    seen_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack:  # iterative: nesting is bounded, but a long file has many siblings
        node, path = stack.pop()
        if id(node) in seen_nodes:  # aliases share nodes
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, yaml.Node] = {}
            children: list[tuple[yaml.Node, str]] = []
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode):  # a complex key: construction refuses it
                    children.append((value, f"{path}.?" if path else "?"))
                    continue
                if key.tag == _MERGE:  # YAML lets the mapping's own keys override what a merge brings
                    children.append((value, path))
                    continue
                name = key.value
                child = f"{path}.{_cut(name)}" if path else _cut(name)
                if name in first:
                    count += 1
                    if len(problems) < MAX_PROBLEMS:
                        line = first[name].start_mark.line + 1
                        problems.append(
                            _at(
                                filename,
                                key,
                                child,
                                f"expected each key once, got {brief(name)} again (first on line {line})",
                            )
                        )
                first.setdefault(name, key)
                children.append((value, child))
            stack.extend(reversed(children))  # visited in file order
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(reversed([(item, f"{path}[{i}]") for i, item in enumerate(node.value)]))
    return problems, count


def _cut(name: Any, limit: int = 40) -> str:
    text = str(name)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _pairs(node: yaml.MappingNode, index: _Index) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    """A mapping's scalar keys, built once per node: the error walk looks keys up once per problem."""
    pairs = index.get(id(node))
    if pairs is None:
        pairs = {str(k.value): (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}
        index[id(node)] = pairs
    return pairs


@dataclass
class _Spot:
    """Where a pydantic error location lands: the shown path, YAML node and schema type."""

    path: str
    node: yaml.Node | None
    key_node: yaml.Node | None
    tp: Any
    metadata: list[Any]
    examples: list[Any] | None
    parent: type[BaseModel] | None
    found: bool


def _walk(loc: list[Any], root: yaml.Node | None, index: _Index, start: Any = Policy) -> _Spot:
    """Follow a pydantic error location through the schema from `start`, and through the YAML from `root`."""
    spot = _Spot("", root, None, start, [], None, None, root is not None)
    for part in loc:
        members, _ = union_members(spot.tp)
        if len(members) > 1:
            tagged = {getattr(m, "TAG", None): m for m in members}
            if part in tagged:  # pydantic puts the union member's tag into the location; users never see it
                spot.tp = tagged[part]
                continue
        tp = members[0] if members else None
        if isinstance(part, int):
            spot.path += f"[{part}]"
            spot.tp = get_args(tp)[0] if get_origin(tp) is list else None
            spot.metadata, spot.examples, spot.key_node = [], None, None
            if spot.found and isinstance(spot.node, yaml.SequenceNode) and 0 <= part < len(spot.node.value):
                spot.node = spot.node.value[part]
            else:
                spot.found = False
            continue
        spot.path = f"{spot.path}.{_cut(part)}" if spot.path else _cut(part)
        info = model_keys(tp).get(str(part)) if isinstance(tp, type) and issubclass(tp, BaseModel) else None
        spot.parent = tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None
        spot.tp, spot.metadata, spot.examples = (
            (info.annotation, list(info.metadata), info.examples) if info else (None, [], None)
        )
        pair = None
        if spot.found and isinstance(spot.node, yaml.MappingNode):
            pair = _pairs(spot.node, index).get(str(part))
        if pair is None:
            spot.found = False
        else:
            spot.key_node, spot.node = pair
    return spot


def _suggest(word: Any, options: list[str], cutoff: float = 0.6) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, options, n=1, cutoff=cutoff)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _expected(spot: _Spot) -> str:
    if spot.tp is None:
        return "a valid value"
    if spot.path == "" and spot.tp is Policy:
        return "a policy mapping (version, name, checkpoint, monitor, rules, limits)"
    return describe(spot.tp, spot.metadata, spot.examples)


def _as_written(node: yaml.Node, text: str, value: Any) -> str:
    """The found value as the user typed it: `10` stays `10`, not `10.0`; strings are quoted."""
    if isinstance(node, yaml.ScalarNode):
        return brief(node.value) if node.tag.endswith(":str") else _cut(node.value, 60)
    if isinstance(node, yaml.CollectionNode) and node.flow_style:
        start = node.start_mark.index
        return _cut(" ".join(text[start : min(node.end_mark.index, start + 200)].split()), 60)
    return brief(value)


def _locate(err: Any, root: yaml.Node, filename: str, text: str, index: _Index) -> Problem:
    spot, node, message = _explain(err, root, index, text, Policy)
    return _at(filename, node, spot.path, message)


def _section_problem(err: Any, tp: Any, where: str) -> str:
    spot, _, message = _explain(err, None, {}, "", tp)
    path = spot.path if not spot.path or spot.path.startswith("[") else f".{spot.path}"
    return f"{where}{path}: {message}"


def _explain(
    err: Any, root: yaml.Node | None, index: _Index, text: str, start: Any
) -> tuple[_Spot, Any, str]:
    """(where the error is, the node to point at, `expected ..., got ...`); without `root`, values are shown as data."""
    loc, kind, ctx, value = list(err["loc"]), err["type"], err.get("ctx") or {}, err.get("input")
    if kind == PROBLEM:
        at = [int(p) if p.isdigit() else p for p in ctx["at"].split(".") if p]
        spot = _walk(loc + at, root, index, start)
        got = _as_written(spot.node, text, None) if ctx["as_written"] and spot.found else ctx["got"]
        return spot, spot.node, f"expected {ctx['expected']}, got {got}"
    if kind in (TARGET_SELECT_ERROR, "union_tag_invalid", "union_tag_not_found"):
        key, expected, options = (
            ("select", _SELECT_EXPECTED, list(BUILTIN_SELECTORS))
            if kind == TARGET_SELECT_ERROR
            else ("type", _TYPE_EXPECTED, list(DETECTOR_TYPES))
        )
        if not isinstance(value, dict):
            spot = _walk(loc, root, index, start)
            return spot, spot.node, f"expected a mapping like {{{key}: {options[0]}}}, got {brief(value)}"
        spot = _walk(loc + [key], root, index, start)
        present = spot.found if root is not None else key in value
        got = brief(value.get(key)) if present else _MISSING
        return spot, spot.node, f"expected {expected}, got {got}{_suggest(value.get(key), options)}"
    if kind == "extra_forbidden":
        spot = _walk(loc, root, index, start)
        known = list(model_keys(spot.parent)) if spot.parent else []
        # Only a near miss is a typo ("sigma" for sigmas); "metric" is not "strict": list the keys instead.
        hint = _suggest(loc[-1], known, cutoff=0.75) or (
            f" (known keys: {', '.join(known)})" if known else ""
        )
        node = spot.key_node or spot.node
        return spot, node, f"expected a known key, got unknown key {brief(str(loc[-1]))}{hint}"
    spot = _walk(loc, root, index, start)
    if kind == "missing":
        return spot, spot.node, f"expected {_expected(spot)}, got {_MISSING}"
    hint = ""
    if kind == "literal_error" and spot.tp is not None:
        members, _ = union_members(spot.tp)
        if get_origin(members[0]) is Literal:
            hint = _suggest(value, [str(v) for v in get_args(members[0])])
    got = _as_written(spot.node, text, value) if spot.found else brief(value)
    if spot.tp is None:
        return spot, spot.node, f"expected {err['msg'].lower()}, got {got}"
    return spot, spot.node, f"expected {_expected(spot)}, got {got}{hint}"
