"""The sharded store's two small gaps (issue 17), one process and no torchrun: a download from the remote
tier brings each rank's `ranks.<r>.json` along, and a non-finite module buffer does not mark a sharded
checkpoint unhealthy (parameters and optimizer state still do), as in the v1 path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.sharded import ShardedCheckpoints
from supervisor.sharded_state import SessionShardedState, ShardedTrainingState
from supervisor.state import TrainingState


class Masked(torch.nn.Module):
    """A linear layer with an additive mask buffer holding -inf on purpose (as an attention mask does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.mask.clamp(min=-1e4)


def trained(seed: int = 0) -> tuple[Masked, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Masked()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.ones(4, 3)).sum().backward()
    opt.step()
    return model, opt


@pytest.mark.parametrize("kind", ["training-state", "session-state"])
def test_a_nonfinite_buffer_leaves_the_checkpoint_healthy_but_a_nonfinite_parameter_does_not(
    tmp_path: Path, kind: str
):
    model, opt = trained()
    if kind == "training-state":
        state = ShardedTrainingState(model, opt)
    else:
        ts = TrainingState()
        ts.register("model", model)
        ts.register("optimizer", opt)
        state = SessionShardedState(ts, "model", [])
    with ShardedCheckpoints(tmp_path / "store") as ckpts:
        first = ckpts.save(1, state)
        assert first is not None and ckpts.catalog.get(first).healthy
        with torch.no_grad():
            model.lin.weight[0, 0] = float("nan")
        second = ckpts.save(2, state)
        assert second is not None and not ckpts.catalog.get(second).healthy
        assert ckpts.catalog.manifest(second).nonfinite == ["model.lin.weight"]


def test_a_download_brings_every_ranks_file_and_restores_the_rank_state(tmp_path: Path):
    ts = TrainingState()
    model, opt = trained()
    ts.register("model", model)
    ts.register("optimizer", opt)
    state = SessionShardedState(ts, "model", [])
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    with ShardedCheckpoints(tmp_path / "store") as ckpts:
        cid = ckpts.save(1, state)
        assert cid is not None
        store = ckpts.store
        assert store is not None
        remote = RemoteTier(f"file://{tmp_path / 'remote'}", sleep=lambda s: None)
        remote.upload(store, ckpts.catalog.manifest(cid))
    local = LocalStore(str(tmp_path / "fresh"))
    try:
        remote.download(local, cid)
    finally:
        local.close()
    assert (tmp_path / "fresh" / f"ckpt-{cid}" / "ranks.0.json").is_file()
    torch.manual_seed(99)
    with ShardedCheckpoints(tmp_path / "fresh") as again:
        assert again.catalog.verify(cid, "full") is None
        assert again.restore(state) == cid
    assert torch.equal(torch.get_rng_state(), rng)  # rank 0's stream came back from the downloaded file


def test_the_session_store_saves_restores_abandons_and_reports_a_failed_save_as_a_write_error(tmp_path: Path):
    from supervisor.checkpoint import CheckpointOptions
    from supervisor.runtime.segment_store import SaveFailedError, ShardedStore

    ts = TrainingState()
    model, opt = trained()
    ts.register("model", model)
    ts.register("optimizer", opt)
    options = CheckpointOptions(directory=tmp_path / "store", keep_last=2, async_save=False)
    store = ShardedStore(str(tmp_path / "store"), SessionShardedState(ts, "model", []), options, "full")
    try:
        first = store.save(10, metrics={"loss": 1.0})
        assert first is not None and store.save(10) == first  # a step just saved is not saved again
        weight = model.lin.weight.detach().clone()

        def boom() -> None:
            raise RuntimeError("metrics store down")

        with pytest.raises(SaveFailedError, match="step 20 not saved"):  # the saver reports an OSError
            store.save(20, before_commit=boom)
        assert [i.step for i in store.list()] == [10]
        second = store.save(20)
        assert second is not None and store.latest() == second
        with torch.no_grad():
            model.lin.weight.add_(1.0)
        assert store.restore(first.id).id == first.id and ts.step == 10
        assert torch.equal(model.lin.weight, weight)
        assert [i.id for i in store.abandon_after(first)] == [second.id]
        assert store.latest() == first
    finally:
        store.close()
