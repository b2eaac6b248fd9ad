"""CUDA paths: CUDA RNG streams, snapshots of device tensors into pinned host memory, GradScaler under fp16
autocast, a bit-exact resume on the GPU from the memory tier and from disk, and the example on the GPU through
the training-side API: a SIGKILL and relaunch that ends bit-identical, and an in-process rollback.

Skipped where there is no GPU (CI has none); run on a GPU machine with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.spool import SpoolReader
from supervisor.state import TrainingState, capture_rng, restore_rng
from tests.segmentkit import segment_env

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


# -- the example on the GPU through the training-side API (no MLflow needed: the plan names a spool) --------

REPO = Path(__file__).resolve().parents[1]


def _charlm(workdir: Path, steps: int, faults: str = "") -> subprocess.CompletedProcess:
    """One segment of the example on cuda; a relaunch on the same workdir restores the latest checkpoint."""
    env = segment_env(workdir, "cuda-run", f"sqlite:///{workdir / 'unused.db'}", faults)
    cmd = [sys.executable, str(REPO / "examples" / "charlm.py"), "--device", "cuda", "--size", "small",
           "--batch-size", "8", "--steps", str(steps), "--eval-every", "1000"]  # fmt: skip
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def _final_digests(workdir: Path) -> tuple[int, dict[str, str]]:
    from supervisor.checkpoint import open_store

    catalog = open_store(workdir / "checkpoints")
    info = catalog.latest()
    assert info is not None
    return info.step, {name: ref.digest for name, ref in catalog.manifest(info.id).tensors.items()}


def _losses(workdir: Path) -> dict[int, float]:
    """The last loss logged for each step, over every segment's spool."""
    out = {}
    for path in sorted((workdir / "metrics").glob("*.jsonl")):
        points, _ = SpoolReader(path).pending(limit=1_000_000)
        out.update({step: value for key, value, _, step in points if key == "loss"})
    return out


def test_the_example_resumes_bit_identically_on_the_gpu_after_a_sigkill(tmp_path):
    clean = _charlm(tmp_path / "clean", 40)
    assert clean.returncode == 0, clean.stderr[-3000:]
    killed = _charlm(tmp_path / "killed", 40, faults="kill@25")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = _charlm(tmp_path / "killed", 40)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    points, _ = SpoolReader(tmp_path / "killed" / "metrics" / "1.jsonl").pending(limit=1_000_000)
    assert ("rollback.restored_step", 20.0) in {(k, v) for k, v, _, _ in points}
    step, digests = _final_digests(tmp_path / "clean")
    assert step == 40 and any(name.startswith("rng.cuda") for name in digests)
    assert _final_digests(tmp_path / "killed") == (step, digests)  # every tensor, bit for bit
    assert _losses(tmp_path / "killed") == _losses(tmp_path / "clean")


def test_the_example_rolls_back_in_process_on_the_gpu(tmp_path):
    proc = _charlm(tmp_path, 30, faults="nan@15")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines() if line]
    assert report["tier"] == "memory" and report["decision"]["target_step"] == 10
    points, _ = SpoolReader(tmp_path / "metrics" / "0.jsonl").pending(limit=1_000_000)
    loss = [(step, value) for key, value, _, step in points if key == "loss"]
    nan_steps = [step for step, value in loss if math.isnan(value)]
    assert nan_steps == [16]  # the poisoned step 15 made the weights NaN; step 16's loss showed it
    assert [step for step, _ in loss] == list(range(1, 17)) + list(range(11, 31))  # 11-16 trained again
    final = _losses(tmp_path)
    assert all(math.isfinite(v) for v in final.values()) and final[30] < final[1]
    assert ("rollback.restored_step", 10.0) in {(k, v) for k, v, _, _ in points}
