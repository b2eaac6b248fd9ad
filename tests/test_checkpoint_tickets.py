"""The per-save ticket state machine: legal transitions only, and what a rollback does to saves in flight."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from supervisor.checkpoint.options import CheckpointInfo
from supervisor.checkpoint.tickets import (
    TRANSITIONS,
    IllegalTransition,
    Refused,
    SaveTicket,
    TicketBook,
    TicketState,
)

P, G, C, R, F = (
    TicketState.PENDING,
    TicketState.GATED,
    TicketState.COMMITTED,
    TicketState.REFUSED,
    TicketState.FAILED,
)
LEGAL = {(P, G), (P, R), (P, F), (G, C), (G, F)}


def info(seq: int) -> CheckpointInfo:
    return CheckpointInfo(f"{seq:010d}-{seq:06d}", seq, 0.0, seq=seq)


@pytest.mark.parametrize("src", list(TicketState))
@pytest.mark.parametrize("dst", list(TicketState))
def test_only_the_listed_transitions_are_legal(src, dst):
    ticket = SaveTicket(info(1), state=src)
    if (src, dst) in LEGAL:
        ticket.move(dst)
        assert ticket.state is dst
    else:
        with pytest.raises(IllegalTransition, match=f"from {src.value} to {dst.value}"):
            ticket.move(dst)
        assert ticket.state is src
    assert {(s, d) for s, ds in TRANSITIONS.items() for d in ds} == LEGAL


def test_a_save_is_gated_then_committed_and_counted():
    book = TicketBook()
    book.open(info(1))
    assert book.commits() == 0
    book.gate(info(1).id)
    book.committed(info(1).id)
    ticket = book.get(info(1).id)
    assert ticket is not None and ticket.state is C and ticket.ever_gated
    assert book.commits() == 1
    book.close(info(1).id)
    assert book.get(info(1).id) is None and book.pending_infos() == []


def test_a_rollback_refuses_pending_saves_and_waits_for_gated_ones():
    book = TicketBook()
    for seq in (1, 2, 3, 4):
        book.open(info(seq))
    landing_write: Future[None] = Future()
    book.attach(info(3).id, landing_write)
    book.gate(info(3).id)  # committing right now
    book.failed(info(4).id)  # failed before its gate: never commits either
    landing, never = book.refuse_after(1)
    assert landing == [landing_write]
    assert [i.id for i in never] == [info(2).id, info(4).id]
    assert book.refused_ids() == {info(2).id}
    assert [i.id for i in book.pending_infos()] == [info(1).id, info(3).id, info(4).id]
    with pytest.raises(Refused):
        book.gate(info(2).id)
    assert book.refuse_after(1) == ([landing_write], never)  # asking again changes nothing


def test_a_failure_after_the_commit_leaves_the_save_committed_and_a_refused_one_refused():
    book = TicketBook()
    book.open(info(1))
    book.open(info(2))
    book.gate(info(1).id)
    book.committed(info(1).id)
    book.failed(info(1).id)  # e.g. retention raised after the commit
    book.refuse_after(0)
    book.failed(info(2).id)
    assert book.get(info(1).id).state is C
    assert book.get(info(2).id).state is R


def test_a_ticket_is_opened_once_and_marks_update_its_info():
    book = TicketBook()
    book.open(info(1))
    with pytest.raises(IllegalTransition, match="already open"):
        book.open(info(1))
    book.mark(info(1).id, lambda i: CheckpointInfo(i.id, i.step, i.wall_time, seq=i.seq, nonfinite=("w",)))
    assert book.pending_infos()[0].nonfinite == ("w",)
    book.close(info(1).id)
    book.mark(info(1).id, lambda i: i)  # a closed ticket: nothing to do, no error
    book.attach(info(1).id, Future())
    assert book.get(info(1).id) is None
