"""Rollback policies: the YAML schema, its loader, presets, checkpoint selectors and the pure decision engine.

The names are imported on first use (PEP 562): a training process reads `policies.history` and the plain
policy view (`policies.plain`) without building the pydantic schema, which only validating or deciding needs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from supervisor.errors import PolicyError
from supervisor.lazy import exports

if TYPE_CHECKING:
    from policies.decision import Decision
    from policies.engine import decide
    from policies.history import History, HistoryEntry, HistoryError
    from policies.loader import load_policy, parse_policy
    from policies.records import CheckpointRecord
    from policies.reference_doc import reference_markdown
    from policies.schema import Policy
    from policies.selectors import before, best, best_before, custom, latest

_WHERE = {
    "Decision": "policies.decision",
    "decide": "policies.engine",
    "History": "policies.history",
    "HistoryEntry": "policies.history",
    "HistoryError": "policies.history",
    "load_policy": "policies.loader",
    "parse_policy": "policies.loader",
    "CheckpointRecord": "policies.records",
    "reference_markdown": "policies.reference_doc",
    "Policy": "policies.schema",
    "before": "policies.selectors",
    "best": "policies.selectors",
    "best_before": "policies.selectors",
    "custom": "policies.selectors",
    "latest": "policies.selectors",
}


__getattr__ = exports(__name__, _WHERE)


#: Where the shipped presets live (`<name>.yaml`).
PRESETS_DIR = Path(__file__).resolve().parent / "presets"
#: The JSON Schema file the presets name in their `# yaml-language-server: $schema=` line.
SCHEMA_FILE = Path(__file__).resolve().parent / "policy.schema.json"


def preset_names() -> list[str]:
    """Names of the shipped presets, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def load_preset(name: str) -> Policy:
    """Load a shipped preset by name, e.g. "palm-spike"."""
    path = PRESETS_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        names = ", ".join(preset_names())
        raise PolicyError([f"preset {name!r}: expected one of {names}, got no such preset"])
    from policies.loader import load_policy

    return load_policy(path)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy file, for editors and `jsonschema`."""
    from policies.schema import Policy

    schema = Policy.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "rollback-supervisor policy, version 1"
    return schema


def json_schema_text() -> str:
    """The JSON Schema as the text written to policy.schema.json and printed by `policy schema`."""
    return json.dumps(json_schema(), indent=2, sort_keys=False) + "\n"


__all__ = [
    "PRESETS_DIR",
    "SCHEMA_FILE",
    "CheckpointRecord",
    "Decision",
    "History",
    "HistoryEntry",
    "HistoryError",
    "Policy",
    "PolicyError",
    "before",
    "best",
    "best_before",
    "custom",
    "decide",
    "json_schema",
    "json_schema_text",
    "latest",
    "load_policy",
    "load_preset",
    "parse_policy",
    "preset_names",
    "reference_markdown",
]
