"""Classify a finished training process (exit status, stderr tail, context) into an event type."""

from __future__ import annotations

import functools
import re
import signal
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from supervisor.cgroup import memory_cgroup_dir
from supervisor.errors import UserError
from supervisor.events import PROCESS_EVENTS, Event
from supervisor.exitcodes import EXIT_ANOMALY, EXIT_OK, EXIT_PREEMPTED, EXIT_STOPPED
from supervisor.monitor import patterns as table

_FLAGS = re.IGNORECASE | re.MULTILINE
#: Exit types a log pattern may name: everything the process side can report except `hang`.
_PATTERN_TYPES = frozenset(PROCESS_EVENTS - {"hang"})
_EXCEPTION_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))\b(?::\s*(.*))?$", re.MULTILINE
)
#: Python's faulthandler on a fatal signal (PYTHONFAULTHANDLER, which the runner sets): the error, then the
#: crashing thread's stack, innermost frame first. A launcher may prefix each line (torchrun's `[rank]:`).
_FATAL_ERROR = re.compile(r"Fatal Python error: ([^\n]+)")
_CRASHING_THREAD = re.compile(r"Current thread 0x[0-9a-fA-F]+ [^\n]*\(most recent call first\):")
_FRAME = re.compile(r'^\S*?\s*File "([^"]+)", line (\d+) in (\S+)\s*$')
#: torchrun's report lists, under "Failures:", the ranks it tore down itself (SIGTERM) after the root cause;
#: those are consequences, so only the "Root Cause (first observed failure)" block says why the job ended.
_TORCHRUN_TORN_DOWN = re.compile(
    r"^[ \t]*Failures:[ \t]*\n.*?(?=^[ \t]*Root Cause \(first observed failure\):)", re.MULTILINE | re.DOTALL
)
#: Signals a supervisor uses to stop its own child (it may escalate SIGTERM to SIGKILL).
_STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGKILL})


class PatternError(UserError):
    """A classifier pattern (built in or from a policy) is malformed."""


@functools.lru_cache(maxsize=256)
def _compile(pattern: str, where: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, _FLAGS)
    except re.error as exc:
        raise PatternError(
            f"{where}.pattern: expected a valid regular expression, got {pattern!r} ({exc})"
        ) from exc


def _rules(extra: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    rules = [dict(row) for row in table.PATTERNS]
    for i, row in enumerate(extra):
        where = f"monitor.classifier_patterns[{i}]"
        kind = row.get("type")
        if kind not in _PATTERN_TYPES:
            raise PatternError(
                f"{where}.type: expected one of {', '.join(sorted(_PATTERN_TYPES))}, got {kind!r}"
            )
        if not isinstance(row.get("pattern"), str) or not row["pattern"]:
            raise PatternError(
                f"{where}.pattern: expected a non-empty regular expression, got {row.get('pattern')!r}"
            )
        priority = row.get("priority", table.DEFAULT_EXTRA_PRIORITY)
        if isinstance(priority, bool) or not isinstance(priority, int | float):
            raise PatternError(f"{where}.priority: expected a number, got {priority!r}")
        rules.append(
            {
                "name": row.get("name", f"policy[{i}]"),
                "type": kind,
                "pattern": row["pattern"],
                "priority": priority,
            }
        )
    for rule in rules:
        rule["regex"] = _compile(rule["pattern"], f"pattern {rule['name']}")
    return rules


def exit_signal(returncode: int | None) -> signal.Signals | None:
    """The signal that ended the process: Popen's -N, or the shell/torchrun 128+N convention."""
    if returncode is None:
        return None
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode <= 128 + 64 else None
    if number is None:
        return None
    try:
        return signal.Signals(number)
    except ValueError:
        return None


def _line_at(text: str, index: int) -> str:
    start = text.rfind("\n", 0, index) + 1
    end = text.find("\n", index)
    return text[start : end if end >= 0 else len(text)].strip()[:400]


#: The signals faulthandler dumps a stack for (a SIGKILL's evidence may hold another rank's dump).
_FAULTHANDLER_SIGNALS = frozenset(
    {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGABRT, signal.SIGILL}
)
_LIBRARY_FRAME = re.compile(r"[\\/](?:site-packages|dist-packages|lib[\\/]python\d[\d.]*)[\\/]")


def _own_frame(stack: list[str]) -> str:
    """The innermost frame outside the standard library and installed packages (the user's code), else the
    innermost."""
    return next((frame for frame in stack if not _LIBRARY_FRAME.search(frame)), stack[0])


def _fatal(text: str) -> dict[str, Any]:
    """What faulthandler printed for the last fatal signal: the error and the crashing thread's frames,
    innermost first (at most 8)."""
    errors = _FATAL_ERROR.findall(text)
    if not errors:
        return {}
    found: dict[str, Any] = {"fatal_error": errors[-1].strip()[:200]}
    threads = list(_CRASHING_THREAD.finditer(text))
    if threads:
        frames = []
        for line in text[threads[-1].end() :].splitlines()[1:]:
            frame = _FRAME.match(line)
            if frame is None:
                break
            frames.append(f"{frame[1]}:{frame[2]} in {frame[3]}"[:400])
            if len(frames) == 8:
                break
        if frames:
            found["fatal_stack"] = frames
    return found


def _exception(text: str) -> str | None:
    found = _EXCEPTION_LINE.findall(text)
    if not found:
        return None
    name, message = found[-1]
    return f"{name}: {message}".strip().rstrip(":")[:400]


def classify_exit(
    returncode: int | None,
    stderr_tail: str,
    *,
    signal_sent_by_us: int | None = None,
    notice_seen: bool = False,
    extra_patterns: Iterable[Mapping[str, Any]] = (),
    cgroup_oom_kills: int | None = None,
) -> Event | None:
    """The fault event for a finished process, or None for a clean exit, our own stop, or an anomaly it reported.

    `cgroup_oom_kills` is the number of OOM kills the cgroup counted during the run (see `read_oom_kills`).
    """
    sig = exit_signal(returncode)
    base = {"returncode": returncode, "signal": sig.name if sig else None}
    if returncode in (EXIT_OK, EXIT_STOPPED, EXIT_ANOMALY):
        return None
    ours = signal_sent_by_us is not None
    if ours and (returncode == EXIT_PREEMPTED or sig in _STOP_SIGNALS or sig == signal_sent_by_us):
        return None
    if returncode == EXIT_PREEMPTED:
        return Event(
            type="preemption",
            reason=f"the training process saved an emergency checkpoint and exited {EXIT_PREEMPTED} (preempted)",
            source="exit",
            evidence={**base, "rule": "exit_preempted", "checkpoint_saved": True},
        )
    text = _TORCHRUN_TORN_DOWN.sub("", stderr_tail or "")
    candidates: list[tuple[float, int, dict[str, Any], str | None]] = []
    for order, rule in enumerate(_rules(extra_patterns)):
        match = rule["regex"].search(text)
        if match:
            candidates.append((rule["priority"], -order, rule, _line_at(text, match.start())))
    for order, rule in enumerate(table.SIGNAL_RULES):
        if sig is not None and sig.name == rule["signal"]:
            candidates.append((rule["priority"], -1000 - order, rule, None))
    if notice_seen:
        candidates.append((table.NOTICE_RULE["priority"], -2000, table.NOTICE_RULE, None))
    if cgroup_oom_kills:
        candidates.append((table.CGROUP_OOM_RULE["priority"], -3000, table.CGROUP_OOM_RULE, None))
    if ours:
        # We asked it to stop: a termination in the log is ours (e.g. torchrun's SignalException
        # traceback), not a preemption; only a stronger fault seen alongside it still counts.
        stop_seen = max((c[0] for c in candidates if c[2]["type"] == "preemption"), default=None)
        candidates = [c for c in candidates if c[2]["type"] != "preemption"]
        if stop_seen is not None and all(c[0] <= stop_seen for c in candidates):
            return None
    evidence = {**base, "exception": _exception(text), **_fatal(text)}
    if cgroup_oom_kills is not None:
        evidence["cgroup_oom_kills"] = cgroup_oom_kills
    status = f"signal {sig.name}" if sig else f"exit code {returncode}"
    if "fatal_stack" in evidence and sig in _FAULTHANDLER_SIGNALS:  # where it crashed, in every report
        status += f" at {_own_frame(evidence['fatal_stack'])}"
    if not candidates:
        return Event(
            type="unknown_exit",
            reason=f"the training process ended with {status} and no known fault pattern",
            source="exit",
            evidence={**evidence, "rule": None},
        )
    _, _, rule, line = max(candidates, key=lambda c: (c[0], c[1]))
    evidence.update(
        rule=rule["name"],
        match=line,
        matched_rules=[c[2]["name"] for c in sorted(candidates, reverse=True, key=lambda c: (c[0], c[1]))],
    )
    detail = f": {line}" if line else ""
    return Event(
        type=rule["type"],
        reason=f"{rule['type']} ({rule['name']}) after {status}{detail}"[:500],
        source="exit",
        evidence=evidence,
    )


def read_oom_kills(cgroup_dir: str | Path | None = None, pid: int | str = "self") -> int | None:
    """The cgroup's OOM-kill counter (v2 `memory.events` or v1 `memory.oom_control`), or None if unreadable.

    Read it before launch and after exit; a larger count means the kernel OOM-killed something in the cgroup.
    """
    try:
        if cgroup_dir is None:
            cgroup_dir = memory_cgroup_dir(pid)
        root = Path(cgroup_dir)
        for name in ("memory.events", "memory.oom_control"):
            path = root / name
            if path.exists():
                for line in path.read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
    except (OSError, ValueError):
        return None
    return None
