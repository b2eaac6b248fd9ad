"""WritePipeline on a real local store: each save's ticket ends committed, refused or failed, as the store says."""

from __future__ import annotations

import pytest
import torch

from supervisor.checkpoint.branch import Branch
from supervisor.checkpoint.holds import Holds
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.memory import SnapshotRing
from supervisor.checkpoint.options import CheckpointInfo, CheckpointOptions
from supervisor.checkpoint.pipeline import WritePipeline
from supervisor.checkpoint.tickets import TicketBook, TicketState
from supervisor.flatten import flatten


@pytest.fixture
def parts(tmp_path):
    options = CheckpointOptions(tmp_path / "store", keep_last=1, memory_slots=1)
    store = LocalStore(options.directory)
    ring = SnapshotRing(1)
    tickets = TicketBook()
    pipeline = WritePipeline(options, store, ring, tickets, Holds(), None)
    pipeline.reindex()
    yield pipeline, store, ring, tickets, Branch(lambda: 1.0, ({}, None, None))
    store.close()


def capture(ring, tickets, branch, step, value=1.0):
    skeleton, live = flatten({"w": torch.full((4,), value), "counters": {"step": step}})
    meta = branch.next_meta(step, {})
    info = CheckpointInfo(meta.id, step, meta.wall_time, seq=meta.seq)
    snap = ring.capture(meta.id, skeleton, live, {"info": info})
    tickets.open(info)
    branch.moved_to(info)
    return meta, snap


def test_a_write_commits_ends_its_ticket_and_keeps_the_snapshot_in_the_ring(parts):
    pipeline, store, ring, tickets, branch = parts
    seen = []
    meta, snap = capture(ring, tickets, branch, 1)
    pipeline.write(meta, snap, lambda: seen.append(tickets.get(meta.id).state))
    assert seen == [TicketState.PENDING]  # the caller's hook runs before the gate
    assert tickets.get(meta.id) is None and tickets.commits() == 1
    assert [i.id for i in store.catalog.list()] == [meta.id]
    assert ring.get(meta.id) is snap


def test_a_refused_save_is_neither_committed_nor_kept_in_the_ring(parts):
    pipeline, store, ring, tickets, branch = parts
    meta, snap = capture(ring, tickets, branch, 1)
    tickets.refuse_after(0)
    pipeline.write(meta, snap)
    assert store.catalog.list() == [] and ring.get(meta.id) is None
    assert tickets.commits() == 0 and tickets.get(meta.id) is None


def test_a_failing_hook_fails_the_save_and_commits_nothing(parts):
    pipeline, store, ring, tickets, branch = parts
    meta, snap = capture(ring, tickets, branch, 1)
    states = []

    def hook():
        raise OSError("metrics not sent")

    original_failed = tickets.failed

    def failed(cid):
        original_failed(cid)
        states.append(tickets.get(cid).state)

    tickets.failed = failed
    with pytest.raises(OSError, match="metrics not sent"):
        pipeline.write(meta, snap, hook)
    assert states == [TicketState.FAILED]
    assert store.catalog.list() == [] and tickets.get(meta.id) is None


def test_retention_after_each_commit_deletes_with_a_reason_unless_held(parts, caplog):
    pipeline, store, ring, tickets, branch = parts
    caplog.set_level("INFO", "rollback_supervisor.checkpoint")
    first, snap = capture(ring, tickets, branch, 1)
    pipeline.write(first, snap)
    pipeline.holds.protect([first.id])
    second, snap = capture(ring, tickets, branch, 2, 2.0)
    pipeline.write(second, snap)
    assert [i.id for i in store.catalog.list()] == [first.id, second.id]
    pipeline.holds.unprotect([first.id])
    third, snap = capture(ring, tickets, branch, 3, 3.0)
    pipeline.write(third, snap)
    assert [i.id for i in store.catalog.list()] == [third.id]
    assert f"Deleting checkpoint {first.id} (not among the last 1)" in caplog.text


def test_an_unhealthy_snapshot_is_written_and_its_ticket_marked(parts):
    pipeline, store, ring, tickets, branch = parts
    meta, snap = capture(ring, tickets, branch, 1, float("nan"))
    marks = []
    original_mark = tickets.mark

    def mark(cid, update):
        original_mark(cid, update)
        marks.append(tickets.get(cid).info.nonfinite)

    tickets.mark = mark
    pipeline.write(meta, snap)
    assert marks == [("w",)]
    assert store.catalog.list()[0].nonfinite == ("w",)
