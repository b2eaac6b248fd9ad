"""The supervisor decides from the same merged view of the local and remote tiers that the training side
restores through (issue 14, section 7): after a machine move they never disagree on "latest"."""

from __future__ import annotations

import shutil

from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.view import MergedCatalog
from tests.ckpt_scripts.tiny import Tiny
from tests.test_checkpoint_corruption import flip_byte


def test_merged_view_matches_the_training_sides_tiers(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    t = Tiny()
    with CheckpointManager(CheckpointOptions(tmp_path / "local", remote=remote), t.state) as mgr:
        first = mgr.save(1)
        t.step()
        second = mgr.save(2)
    # The local tier lost the newer checkpoint (a moved lineage, a cleaned scratch disk); remote has both.
    shutil.rmtree(tmp_path / "local" / f"ckpt-{second.id}")
    local, far = open_store(tmp_path / "local"), RemoteTier(remote).catalog
    assert local.latest().id == first.id  # what the supervisor used to decide from
    view = MergedCatalog([local, far])
    with CheckpointManager(CheckpointOptions(tmp_path / "local", remote=remote), Tiny().state) as mgr:
        training_side = mgr.latest()
    assert view.latest().id == training_side.id == second.id
    assert [i.id for i in view.list()] == [first.id, second.id]
    assert view.list()[0].tiers == ("local", "remote") and view.list()[1].tiers == ("remote",)
    # A copy that fails verification in one tier is still valid if the other tier's copy is good.
    flip_byte(tmp_path / "remote", first.id)
    assert view.verify(first.id, "full") is None
    flip_byte(tmp_path / "local", first.id)
    reason = view.verify(first.id, "full")
    assert reason is not None and "local:" in reason and "remote:" in reason


def test_latest_and_best_skip_an_unhealthy_checkpoint(tmp_path):
    import torch

    t = Tiny()
    with CheckpointManager(CheckpointOptions(tmp_path / "s", async_save=False), t.state) as mgr:
        good = mgr.save(1, metrics={"val_loss": 2.0})
        with torch.no_grad():
            next(t.model.parameters()).fill_(float("nan"))
        bad = mgr.save(2, metrics={"val_loss": 1.0})
    view = MergedCatalog([open_store(tmp_path / "s")])
    assert not view.list()[-1].healthy and view.list()[-1].id == bad.id
    assert view.latest().id == good.id and view.best("val_loss").id == good.id
    permissive = MergedCatalog([open_store(tmp_path / "s")], allow_nonfinite=True)
    assert permissive.latest().id == bad.id and permissive.best("val_loss").id == bad.id
