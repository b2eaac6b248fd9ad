"""The run's record of past events and decisions, persisted between segments; budgets are counted from it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from policies.decision import Decision
from supervisor.errors import SupervisorError
from supervisor.events import Event

HISTORY_VERSION = 1


class HistoryError(SupervisorError):
    """A persisted history could not be read back."""


@dataclass(frozen=True)
class HistoryEntry:
    """One event, what was decided about it, and when (the injected clock's `now`)."""

    time: float
    event: Event
    decision: Decision


class History:
    """An append-only list of (time, event, decision), JSON-serialisable with `to_dict`/`from_dict`.

    Not thread-safe: one supervisor owns one history.
    """

    def __init__(self, entries: Iterable[HistoryEntry] = ()):
        self._entries = list(entries)

    def record(self, event: Event, decision: Decision, now: float) -> History:
        """Append one entry and return self, so `history = history.record(...)` also works."""
        self._entries.append(HistoryEntry(time=float(now), event=event, decision=decision))
        return self

    @property
    def entries(self) -> tuple[HistoryEntry, ...]:
        return tuple(self._entries)

    @property
    def rollbacks(self) -> int:
        """Rollbacks decided so far."""
        return sum(1 for e in self._entries if e.decision.action == "rollback")

    @property
    def restarts(self) -> int:
        """Relaunches of any kind (resume and rollback) decided so far."""
        return sum(1 for e in self._entries if e.decision.relaunches)

    def relaunches_since(self, since: float) -> int:
        """Relaunches decided at or after time `since`."""
        return sum(1 for e in self._entries if e.decision.relaunches and e.time >= since)

    def __iter__(self) -> Iterator[HistoryEntry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and self._entries == other._entries

    def __repr__(self) -> str:
        return f"History({len(self)} entries, {self.rollbacks} rollbacks, {self.restarts} restarts)"

    def to_dict(self) -> dict[str, Any]:
        entries = []
        for e in self._entries:
            decision = e.decision.to_dict()
            if e.decision.event == e.event:  # stored once; from_dict puts it back
                del decision["event"]
            entries.append({"time": e.time, "event": e.event.to_dict(), "decision": decision})
        return {"version": HISTORY_VERSION, "entries": entries}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> History:
        if data.get("version", HISTORY_VERSION) != HISTORY_VERSION:
            raise HistoryError(f"history.version: expected {HISTORY_VERSION}, got {data.get('version')!r}")
        entries = []
        for i, item in enumerate(data.get("entries", [])):
            try:
                event = Event.from_dict(item["event"])
                decision = Decision.from_dict({"event": item["event"], **item["decision"]})
                entries.append(HistoryEntry(time=float(item["time"]), event=event, decision=decision))
            except (KeyError, TypeError, ValueError) as exc:
                raise HistoryError(
                    f"history.entries[{i}]: expected {{time, event, decision}}, got {type(exc).__name__}: {exc}"
                ) from None
        return cls(entries)
