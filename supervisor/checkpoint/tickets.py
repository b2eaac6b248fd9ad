"""One ticket per save, and the book of saves not yet finished writing: an explicit state machine.

    pending --gate--> gated --commit--> committed
       |                 \\
       +--refuse--> refused  +--fail--> failed
       +--fail----> failed

A ticket is opened when save() hands a snapshot to the writer and closed when the write is over, whatever
its end. A rollback refuses a pending ticket (its commit gate then raises); a gated one is committing already
and is waited for instead. The book is thread-safe: the training thread opens and refuses, the writer thread
gates, commits, fails and closes.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from supervisor.checkpoint.options import CheckpointInfo
from supervisor.errors import CheckpointError


class TicketState(enum.Enum):
    PENDING = "pending"
    GATED = "gated"
    COMMITTED = "committed"
    REFUSED = "refused"
    FAILED = "failed"


#: The legal transitions; anything else is a bug in the caller, raised as IllegalTransition.
TRANSITIONS: dict[TicketState, frozenset[TicketState]] = {
    TicketState.PENDING: frozenset({TicketState.GATED, TicketState.REFUSED, TicketState.FAILED}),
    TicketState.GATED: frozenset({TicketState.COMMITTED, TicketState.FAILED}),
    TicketState.COMMITTED: frozenset(),
    TicketState.REFUSED: frozenset(),
    TicketState.FAILED: frozenset(),
}


class IllegalTransition(CheckpointError):
    """A save ticket was moved along an edge the state machine does not have (a bug, not a user error)."""


class Refused(Exception):
    """Raised at a checkpoint's commit gate when a rollback went past it: it is not committed."""


@dataclass
class SaveTicket:
    """One save on its way to the store: its info (health mark included once read), state and write future."""

    info: CheckpointInfo
    state: TicketState = TicketState.PENDING
    write: Future[Any] | None = None
    ever_gated: bool = False

    @property
    def id(self) -> str:
        return self.info.id

    def move(self, to: TicketState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(
                f"save ticket {self.id}: no transition from {self.state.value} to {to.value} "
                "(report this: the checkpoint manager moved a save out of order)"
            )
        self.state = to
        self.ever_gated = self.ever_gated or to is TicketState.GATED


class TicketBook:
    """The tickets of saves whose write is not over, oldest first."""

    def __init__(self) -> None:
        self._tickets: dict[str, SaveTicket] = {}
        self._commits = 0
        self._lock = threading.Lock()

    def open(self, info: CheckpointInfo) -> SaveTicket:
        ticket = SaveTicket(info)
        with self._lock:
            if info.id in self._tickets:
                raise IllegalTransition(f"save ticket {info.id} is already open")
            self._tickets[info.id] = ticket
        return ticket

    def attach(self, checkpoint_id: str, write: Future[Any]) -> None:
        """Record the write future of an open ticket (a no-op once the write is over)."""
        with self._lock:
            ticket = self._tickets.get(checkpoint_id)
            if ticket is not None:
                ticket.write = write

    def get(self, checkpoint_id: str) -> SaveTicket | None:
        with self._lock:
            return self._tickets.get(checkpoint_id)

    def refused(self, checkpoint_id: str) -> bool:
        with self._lock:
            ticket = self._tickets.get(checkpoint_id)
            return ticket is not None and ticket.state is TicketState.REFUSED

    def refused_ids(self) -> set[str]:
        with self._lock:
            return {t.id for t in self._tickets.values() if t.state is TicketState.REFUSED}

    def mark(self, checkpoint_id: str, update: Callable[[CheckpointInfo], CheckpointInfo]) -> None:
        """Replace an open ticket's info by `update(info)` (e.g. its health mark, read by the writer)."""
        with self._lock:
            ticket = self._tickets.get(checkpoint_id)
            if ticket is not None:
                ticket.info = update(ticket.info)

    def gate(self, checkpoint_id: str) -> None:
        """Pass the commit gate: Refused if a rollback went past this save, else pending -> gated."""
        with self._lock:
            ticket = self._tickets[checkpoint_id]
            if ticket.state is TicketState.REFUSED:
                raise Refused(checkpoint_id)
            ticket.move(TicketState.GATED)

    def committed(self, checkpoint_id: str) -> None:
        with self._lock:
            self._tickets[checkpoint_id].move(TicketState.COMMITTED)
            self._commits += 1

    def commits(self) -> int:
        """How many saves committed so far: a reader that sees it change knows its listing may be stale."""
        with self._lock:
            return self._commits

    def failed(self, checkpoint_id: str) -> None:
        """The write raised: a pending or gated save failed.

        A refused one stays refused (its gate raised on purpose) and a committed one stays committed (what
        failed came after its commit: retention or handing it to the uploader).
        """
        with self._lock:
            ticket = self._tickets[checkpoint_id]
            if ticket.state in (TicketState.PENDING, TicketState.GATED):
                ticket.move(TicketState.FAILED)

    def close(self, checkpoint_id: str) -> None:
        """The write is over: forget the ticket."""
        with self._lock:
            self._tickets.pop(checkpoint_id, None)

    def pending_infos(self) -> list[CheckpointInfo]:
        """Infos of open saves not refused, in save order."""
        with self._lock:
            return [t.info for t in self._tickets.values() if t.state is not TicketState.REFUSED]

    def refuse_after(self, seq: int) -> tuple[list[Future[Any]], list[CheckpointInfo]]:
        """A rollback to the save numbered `seq`: refuse every later pending save.

        Returns the writes of later saves already past their gate (to be waited for, then marked abandoned)
        and the infos of the later saves that will never commit (refused now or before).
        """
        landing: list[Future[Any]] = []
        never: list[CheckpointInfo] = []
        with self._lock:
            for ticket in self._tickets.values():
                if ticket.info.seq <= seq:
                    continue
                if ticket.ever_gated:
                    if ticket.write is not None:
                        landing.append(ticket.write)
                    continue
                if ticket.state is TicketState.PENDING:
                    ticket.move(TicketState.REFUSED)
                never.append(replace(ticket.info))
        return landing, never


__all__ = ["IllegalTransition", "Refused", "SaveTicket", "TicketBook", "TicketState", "TRANSITIONS"]
