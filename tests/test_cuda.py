"""CUDA paths: CUDA RNG streams, snapshots of device tensors into pinned host memory, GradScaler under fp16
autocast, and a bit-exact resume on the GPU from the memory tier and from disk.

Skipped where there is no GPU (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.state import TrainingState, capture_rng, restore_rng

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def deterministic_cuda():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


class Run:
    """A dropout MLP on the GPU under fp16 autocast with AdamW, a scheduler and a GradScaler."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        torch.cuda.manual_seed_all(0)
        self.model = nn.Sequential(
            nn.Linear(64, 256), nn.GELU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
        ).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**14, growth_interval=2)
        self.state = TrainingState()
        self.state.register("model", self.model)
        self.state.register("optimizer", self.opt)
        self.state.register("scheduler", self.sched)
        self.state.register("scaler", self.scaler)

    def step(self) -> float:
        x = torch.randn(32, 64, device="cuda")  # drawn from the CUDA generator, as dropout is
        y = torch.randint(0, 8, (32,), device="cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.state.step += 1
        return loss.item()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def test_cuda_rng_streams_round_trip():
    rng = capture_rng()
    assert "cuda" in rng and len(rng["cuda"]) == torch.cuda.device_count()
    first = torch.rand(1000, device="cuda")
    restore_rng(rng)
    assert torch.equal(torch.rand(1000, device="cuda"), first)


@pytest.mark.parametrize("tier", ["memory", "local"])
def test_resume_on_the_gpu_is_bit_identical(tmp_path, tier):
    reference = Run()
    losses = [reference.step() for _ in range(12)]
    final = reference.params()
    scale = reference.scaler.get_scale()

    run = Run()
    with CheckpointManager(CheckpointOptions(tmp_path / "store", memory_slots=1), run.state) as mgr:
        assert [run.step() for _ in range(6)] == losses[:6]
        info = mgr.save(6)
        (snap,) = mgr._ring.snapshots()
        on_gpu = [
            k for k in snap.tensors if k.startswith("model.") or k.endswith((".exp_avg", ".exp_avg_sq"))
        ]
        assert on_gpu and all(snap.tensors[k].is_pinned() for k in on_gpu)  # device -> pinned host copies
        assert all(not t.is_cuda for t in snap.tensors.values())
        assert any(k.startswith("rng.cuda") for k in snap.tensors)
        for _ in range(3):  # the branch that gets rolled back: moves weights, RNG and the scaler on
            run.step()
        torch.rand(10, device="cuda")
        mgr.wait()
        if tier == "memory":
            mgr.restore_memory(info)
        else:
            mgr.restore(info, tier="local")
    assert run.state.step == 6
    assert [run.step() for _ in range(6)] == losses[6:]
    assert all(torch.equal(a, b) for a, b in zip(run.params(), final, strict=True))
    assert run.scaler.get_scale() == scale
    assert all(p.is_cuda for p in run.model.parameters())
