"""abandon_after(wait=False) while the writer thread's retention deletes a later checkpoint (review of issue 15)."""

import threading

import torch

from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manager import CheckpointManager
from supervisor.checkpoint.options import CheckpointOptions
from supervisor.checkpoint.tiers import Tiers
from supervisor.state import TrainingState


def test_abandon_after_no_wait_while_retention_deletes(tmp_path, monkeypatch):
    state = TrainingState()
    state.register("model", torch.nn.Linear(4, 4))
    opts = CheckpointOptions(tmp_path / "ck", async_save=True, keep_last=1, memory_slots=3)
    mgr = CheckpointManager(opts, state)
    c1 = mgr.save(1)
    mgr.wait()
    mgr.protect([c1.id])
    c2 = mgr.save(2)
    assert c2.step == 2
    mgr.wait()

    listed, deleting = threading.Event(), threading.Event()
    real_delete = LocalStore.delete

    def slow_delete(self, cid):
        if threading.current_thread().name.startswith("ckpt-writer"):
            deleting.set()
            assert listed.wait(10)
        return real_delete(self, cid)

    name = "listing" if hasattr(Tiers, "listing") else "list"
    real_list = getattr(Tiers, name)

    def spy(self, *a, **k):
        out = real_list(self, *a, **k)
        listed.set()
        return out

    monkeypatch.setattr(LocalStore, "delete", slow_delete)
    c3 = mgr.save(3)
    assert deleting.wait(10)  # c3 is committed; its retention is about to delete c2
    monkeypatch.setattr(Tiers, name, spy)
    mgr.restore_memory(c1.id, wait=False)
    gone = mgr.abandon_after(c1.id, wait=False)  # new tree: FileNotFoundError (marks deleted c2)
    assert [g.id for g in gone] == [c3.id]  # c2 was deleted by retention meanwhile, not marked
    mgr.close()
