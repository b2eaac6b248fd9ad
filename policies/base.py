"""The base model every policy section derives from, and the helper its validators use to report problems."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError

#: The error type of a cross-field problem; the loader reads its `at` context to locate the key.
PROBLEM = "policy_problem"


class Spec(BaseModel):
    """A policy section: unknown keys are errors, types are strict, values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


def show(value: Any, limit: int = 60) -> str:
    """Render a found value the way the user wrote it in YAML (strings quoted, null/true/false)."""
    try:
        text = json.dumps(value, default=str, ensure_ascii=False)
    except ValueError:  # circular YAML anchors
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def problem(at: str, expected: str, got: Any = None, *, raw: str | None = None) -> PydanticCustomError:
    """A cross-field problem at the dotted sub-key `at` ("" for the section itself).

    The loader shows the found value as written in the file unless `raw` gives the words to use.
    """
    context = {
        "expected": expected,
        "got": show(got) if raw is None else raw,
        "at": at,
        "as_written": raw is None,
    }
    return PydanticCustomError(PROBLEM, "expected {expected}, got {got}", context)
