"""`OverlappedCopy`: a snapshot copied beside the next step is bit-identical to one copied before it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from supervisor.checkpoint.overlap import OverlappedCopy
from supervisor.errors import CheckpointError


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, *, then_step: bool = True) -> None:
    loss = model(torch.randn(32, 64)).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if then_step:
        opt.step()


def _pairs(model, opt):
    late = [(torch.empty_like(p), p.detach()) for p in model.parameters()]
    late += [(torch.empty_like(t), t) for s in opt.state.values() for t in s.values()]
    now = [(torch.empty_like(b), b) for b in model.buffers()]
    return late, now


def _slow(seconds: float):
    return lambda chunk: time.sleep(seconds)


def test_an_overlapped_snapshot_equals_a_synchronous_one_across_a_training_step():
    model, opt = _setup()
    late, now = _pairs(model, opt)
    expected = [src.clone() for _, src in late + now]
    release = threading.Event()
    copier = OverlappedCopy(on_chunk=lambda chunk: release.wait(10))  # held until the step has begun
    copier.guard([opt])
    copier.start(late, now)
    _step(
        model, opt, then_step=False
    )  # forward (BatchNorm updates its buffers) and backward, beside the copy
    assert copier.pending
    threading.Timer(0.2, release.set).start()
    opt.step()  # waits for the copy, then changes parameters and optimizer state
    assert copier.waited_s > 0.1
    got = [dst for dst, _ in late + now]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    assert not all(
        torch.equal(src, e) for (_, src), e in zip(late + now, expected, strict=True)
    )  # it moved on
    copier.close()


def test_without_the_guard_the_step_changes_tensors_the_copy_has_not_read_yet():
    """What the step pre-hook prevents: the same slow copy, unguarded, snapshots a mix of two steps."""
    model, opt = _setup()
    late, now = _pairs(model, opt)
    expected = [src.clone() for _, src in late]
    stepped = threading.Event()
    copier = OverlappedCopy(on_chunk=lambda chunk: stepped.wait(10))  # the copy starts after the step
    copier.start(late, now)
    _step(model, opt)
    stepped.set()
    copier.wait()
    assert not all(torch.equal(dst, e) for (dst, _), e in zip(late, expected, strict=True))


def test_buffers_the_forward_pass_updates_are_copied_before_start_returns():
    model, opt = _setup()
    late, now = _pairs(model, opt)
    running_mean = model[1].running_mean.clone()
    copier = OverlappedCopy(on_chunk=_slow(0.2))
    copier.guard([opt])
    copier.start(late, now)
    _step(model, opt, then_step=False)  # the forward changes the running statistics
    assert not torch.equal(model[1].running_mean, running_mean)
    copier.wait()
    assert torch.equal(now[0][0], running_mean)
    copier.close()


def test_a_failed_copy_never_raises_in_the_training_step_and_its_snapshot_reports_it_every_time():
    """The optimizer's step only waits; the save's writer (and anyone else) gets the failure from the handle."""
    model, opt = _setup()
    late, now = _pairs(model, opt)

    def fail(chunk: int) -> None:
        raise OSError("no memory for the snapshot")

    copier = OverlappedCopy(on_chunk=fail)
    copier.guard([opt])
    handle = copier.start(late, now)
    _step(model, opt)  # waits for the failed copy, raises nothing
    for _ in range(2):  # not handed to the first caller alone
        with pytest.raises(CheckpointError, match="overlapped snapshot copy failed: OSError: no memory"):
            handle.result()
    assert copier.start(late, now) is not handle  # the next copy starts fresh
    copier.close()


def test_the_store_with_overlap_commits_and_restores_the_state_of_the_save_not_the_step_after(tmp_path):
    """CheckpointManager(overlap=True): the copy runs beside the next step, whose optimizer waits for it."""
    from supervisor.checkpoint import CheckpointManager, CheckpointOptions
    from supervisor.state import TrainingState

    model, opt = _setup()
    state = TrainingState()
    state.register("model", model)
    state.register("optimizer", opt)
    options = CheckpointOptions(tmp_path / "store", async_save=True, overlap=True)
    with CheckpointManager(options, state) as mgr:
        saved = {k: v.clone() for k, v in state.live_tensors().items()}
        info = mgr.save(1)
        _step(model, opt)  # the optimizer's step waits for the copy
        moved = {k: v.clone() for k, v in state.live_tensors().items()}
        assert any(not torch.equal(saved[k], moved[k]) for k in saved)
        mgr.wait()
        for restore in (mgr.restore_memory, mgr.restore):
            _step(model, opt)
            restore(info.id)
            assert all(torch.equal(v, saved[k]) for k, v in state.live_tensors().items())
