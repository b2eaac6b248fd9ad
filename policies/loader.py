"""Load a policy file: YAML in, a validated `Policy` out, or one `file:line:col: key: expected, got` per problem."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from policies.base import PROBLEM, show
from policies.describe import describe, model_keys, union_members
from policies.monitor_schema import DETECTOR_TYPES
from policies.schema import Policy
from policies.targets import BUILTIN_SELECTORS, TARGET_SELECT_ERROR
from supervisor.errors import PolicyError

_SELECT_EXPECTED = "one of " + ", ".join(BUILTIN_SELECTORS) + ' or "module:function"'
_TYPE_EXPECTED = "one of " + ", ".join(DETECTOR_TYPES)
_MISSING = "nothing (required key missing)"


def load_policy(path: str | os.PathLike[str]) -> Policy:
    """Read and validate a policy file; raise PolicyError listing every problem."""
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise PolicyError([f"{name}: expected a readable policy file, got {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise PolicyError(
            [f"{name}: expected UTF-8 text, got undecodable bytes at offset {exc.start}"]
        ) from None
    return parse_policy(text, name)


def parse_policy(text: str, filename: str = "<string>") -> Policy:
    """Validate policy YAML text; `filename` only labels the messages."""
    root, data = _compose(text, filename)
    problems = _duplicate_keys(root, filename)
    if root is None:
        problems.append((0, 0, f"{filename}:1:1: (document): expected a policy mapping, got an empty file"))
    else:
        try:
            policy = Policy.model_validate(data)
        except ValidationError as exc:
            problems += [_locate(err, root, filename, text) for err in exc.errors()]
    if problems:
        raise PolicyError([line for _, _, line in sorted(set(problems), key=lambda p: (p[0], p[1]))])
    return policy


def _compose(text: str, filename: str) -> tuple[yaml.Node | None, Any]:
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{filename}:{mark.line + 1}:{mark.column + 1}" if mark else f"{filename}:1:1"
        context = ""
        if exc.context:
            context = f" ({exc.context}"
            if exc.context_mark and exc.context_mark is not mark:
                context += f" at line {exc.context_mark.line + 1}, column {exc.context_mark.column + 1}"
            context += ")"
        raise PolicyError([f"{where}: (syntax): expected valid YAML, got {exc.problem}{context}"]) from None
    except yaml.YAMLError as exc:
        raise PolicyError([f"{filename}:1:1: (syntax): expected valid YAML, got {exc}"]) from None
    finally:
        loader.dispose()
    return node, data


def _at(filename: str, node: yaml.Node, path: str, message: str) -> tuple[int, int, str]:
    line, col = node.start_mark.line + 1, node.start_mark.column + 1
    return line, col, f"{filename}:{line}:{col}: {path or '(document)'}: {message}"


def _duplicate_keys(root: yaml.Node | None, filename: str) -> list[tuple[int, int, str]]:
    problems: list[tuple[int, int, str]] = []
    seen_nodes: set[int] = set()

    def visit(node: yaml.Node, path: str) -> None:
        if id(node) in seen_nodes:  # aliases share nodes; anchors may even be recursive
            return
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, yaml.Node] = {}
            for key, value in node.value:
                name = str(key.value)
                child = f"{path}.{name}" if path else name
                if isinstance(key, yaml.ScalarNode) and name in first:
                    line = first[name].start_mark.line + 1
                    problems.append(
                        _at(
                            filename,
                            key,
                            child,
                            f'expected each key once, got "{name}" again (first on line {line})',
                        )
                    )
                first.setdefault(name, key)
                visit(value, child)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                visit(item, f"{path}[{i}]")

    if root is not None:
        visit(root, "")
    return problems


@dataclass
class _Spot:
    """Where a pydantic error location lands: the shown path, YAML node and schema type."""

    path: str
    node: yaml.Node
    key_node: yaml.Node | None
    tp: Any
    metadata: list[Any]
    examples: list[Any] | None
    parent: type[BaseModel] | None
    found: bool


def _walk(loc: list[Any], root: yaml.Node) -> _Spot:
    spot = _Spot("", root, None, Policy, [], None, None, True)
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
        spot.path = f"{spot.path}.{part}" if spot.path else str(part)
        info = model_keys(tp).get(str(part)) if isinstance(tp, type) and issubclass(tp, BaseModel) else None
        spot.parent = tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None
        spot.tp, spot.metadata, spot.examples = (
            (info.annotation, list(info.metadata), info.examples) if info else (None, [], None)
        )
        pair = None
        if spot.found and isinstance(spot.node, yaml.MappingNode):
            pair = next(((k, v) for k, v in spot.node.value if str(k.value) == str(part)), None)
        if pair is None:
            spot.found = False
        else:
            spot.key_node, spot.node = pair
    return spot


def _suggest(word: Any, options: list[str]) -> str:
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    return f' (did you mean "{close[0]}"?)' if close else ""


def _expected(spot: _Spot) -> str:
    if spot.tp is None:
        return "a valid value"
    if spot.path == "":
        return "a policy mapping (version, name, checkpoint, monitor, rules, limits)"
    return describe(spot.tp, spot.metadata, spot.examples)


def _got(spot: _Spot, value: Any) -> str:
    return _MISSING if not spot.found else show(value)


def _as_written(node: yaml.Node, text: str, value: Any) -> str:
    """The found value as the user typed it: `10` stays `10`, not `10.0`; strings are quoted."""
    if isinstance(node, yaml.ScalarNode):
        return show(node.value) if node.tag.endswith(":str") else str(node.value)
    if isinstance(node, yaml.CollectionNode) and node.flow_style:
        source = " ".join(text[node.start_mark.index : node.end_mark.index].split())
        return source if len(source) <= 60 else source[:57] + "..."
    return show(value)


def _locate(err: Any, root: yaml.Node, filename: str, text: str) -> tuple[int, int, str]:
    loc, kind, ctx, value = list(err["loc"]), err["type"], err.get("ctx") or {}, err.get("input")
    if kind == PROBLEM:
        at = [int(p) if p.isdigit() else p for p in ctx["at"].split(".") if p]
        spot = _walk(loc + at, root)
        got = _as_written(spot.node, text, None) if ctx["as_written"] and spot.found else ctx["got"]
        return _at(filename, spot.node, spot.path, f"expected {ctx['expected']}, got {got}")
    if kind in (TARGET_SELECT_ERROR, "union_tag_invalid", "union_tag_not_found"):
        key, expected, options = (
            ("select", _SELECT_EXPECTED, list(BUILTIN_SELECTORS))
            if kind == TARGET_SELECT_ERROR
            else ("type", _TYPE_EXPECTED, list(DETECTOR_TYPES))
        )
        if not isinstance(value, dict):
            spot = _walk(loc, root)
            return _at(
                filename,
                spot.node,
                spot.path,
                f"expected a mapping like {{{key}: {options[0]}}}, got {show(value)}",
            )
        spot = _walk(loc + [key], root)
        got = _got(spot, value.get(key))
        return _at(
            filename,
            spot.node,
            spot.path,
            f"expected {expected}, got {got}{_suggest(value.get(key), options)}",
        )
    if kind == "extra_forbidden":
        spot = _walk(loc, root)
        known = list(model_keys(spot.parent)) if spot.parent else []
        hint = _suggest(loc[-1], known) or (f" (known keys: {', '.join(known)})" if known else "")
        node = spot.key_node or spot.node
        return _at(filename, node, spot.path, f'expected a known key, got unknown key "{loc[-1]}"{hint}')
    spot = _walk(loc, root)
    if kind == "missing":
        return _at(filename, spot.node, spot.path, f"expected {_expected(spot)}, got {_MISSING}")
    hint = ""
    if kind == "literal_error" and spot.tp is not None:
        members, _ = union_members(spot.tp)
        if get_origin(members[0]) is Literal:
            hint = _suggest(value, [str(v) for v in get_args(members[0])])
    got = _as_written(spot.node, text, value) if spot.found else show(value)
    if spot.tp is None:
        return _at(filename, spot.node, spot.path, f"expected {err['msg'].lower()}, got {got}")
    return _at(filename, spot.node, spot.path, f"expected {_expected(spot)}, got {got}{hint}")
