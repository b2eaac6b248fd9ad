"""Metrics from a script's output lines: named regular expressions, `iter (?P<step>\\d+): loss (?P<loss>\\S+)`.

Each pattern is searched in every stdout and stderr line; the first that matches gives the line's step (the
integer in its `step` group) and one metric per other named group whose text reads as a number (`nan` and
`inf` included: a diverging loss is exactly what the detectors must see). Pure: no I/O, standard library only,
so the policy schema checks patterns at load time with `pattern_problem`, and a sidecar against the
checkpoint glob with `glob_regex` (the matcher the scans use).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

STEP_GROUP = "step"


@dataclass(frozen=True)
class Parsed:
    """What one output line said: its step and the metrics it printed."""

    step: int
    metrics: dict[str, float]

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.metrics.values())


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot read metrics from a line (bad syntax, no `step` group), or None when it can."""
    try:
        compiled = re.compile(pattern)
    except re.error as exc:
        return f"is not a valid regular expression ({exc})"
    if STEP_GROUP not in compiled.groupindex:
        return "has no named group `step`, e.g. (?P<step>\\d+)"
    return None


class OutputParser:
    """Reads metrics from output lines. Thread-safe: it holds no state once built."""

    def __init__(self, patterns: Sequence[str]):
        for pattern in patterns:
            if (why := pattern_problem(pattern)) is not None:
                raise ValueError(f"{pattern!r}: {why}")
        self.patterns = [re.compile(p) for p in patterns]

    @property
    def metrics(self) -> frozenset[str]:
        """Every metric name some pattern can capture."""
        return frozenset(g for p in self.patterns for g in p.groupindex if g != STEP_GROUP)

    def parse(self, line: str) -> Parsed | None:
        """The step and metrics of the first pattern that matches `line` with an integer step, or None."""
        for pattern in self.patterns:
            match = pattern.search(line)
            if match is None:
                continue
            try:
                step = int(match.group(STEP_GROUP))
            except (TypeError, ValueError):
                continue
            metrics = {}
            for name, text in match.groupdict().items():
                if name == STEP_GROUP or text is None:
                    continue
                try:
                    metrics[name] = float(text)
                except ValueError:
                    continue  # "12ms" under a group meant for a number: that metric is left out of this line
            return Parsed(step, metrics)
        return None


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regex matching the relative paths `Path.glob(pattern)` matches (`**` any depth, `*` within a name)."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1 : end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")
