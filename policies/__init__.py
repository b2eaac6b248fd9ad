"""Rollback policies: the YAML schema, its loader, presets, checkpoint selectors and the pure decision engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from policies.decision import Decision
from policies.engine import decide
from policies.history import History, HistoryEntry, HistoryError
from policies.loader import load_policy, parse_policy
from policies.records import CheckpointRecord
from policies.reference_doc import reference_markdown
from policies.schema import Policy
from policies.selectors import before, best, best_before, custom, latest
from supervisor.errors import PolicyError

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
    return load_policy(path)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a policy file, for editors and `jsonschema`."""
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
