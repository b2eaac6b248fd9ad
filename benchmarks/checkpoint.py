"""`bench checkpoint` measurements: our store against torch.save/torch.load, in one process, medians."""

from __future__ import annotations

import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.state import TrainingState

TARGETS = {
    "blocking_save_s/torch_save_s": 0.10,
    "blocking_save_overlap_s/torch_save_s": 0.05,
    "restore_memory_s/memcpy_s": 2.0,
    "restore_disk_s/torch_load_s": 0.5,
    "restore_disk_s/torch_load_mmap_s": 1.5,
    "dedup_bytes_ratio": 0.15,
}


def build(
    params: int, frozen: float = 0.0, device: str = "cpu"
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of square Linear layers with about `params` parameters and populated AdamW state."""
    width = 2048 if params >= 50_000_000 else 1024 if params >= 5_000_000 else 256
    layers = max(1, round(params / (width * width + width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers))).to(device)
    n_frozen = int(layers * frozen)
    for layer in list(model)[:n_frozen]:
        layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


def perturb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Change every trainable tensor, as a training step would, so each save has new bytes."""
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1e-3)
                for t in opt.state[p].values():
                    t.add_(1)


def run(params: int, reps: int, workdir: Path, device: str = "cpu") -> dict[str, Any]:
    """Every measurement of the issue's table, medians of `reps` rounds, with the target ratios."""
    load_before = os.getloadavg()[0]
    out = measure(params, reps, workdir, device)
    out["dedup_bytes_ratio"] = dedup_ratio(params, workdir / "dedup", optimizer_state_for_frozen=True)
    out["dedup_bytes_ratio_frozen_without_optimizer_state"] = dedup_ratio(
        params, workdir / "dedup2", optimizer_state_for_frozen=False
    )
    ratios = {
        "blocking_save_s/torch_save_s": out["blocking_save_s"] / out["torch_save_s"],
        "blocking_save_overlap_s/torch_save_s": out["blocking_save_overlap_s"] / out["torch_save_s"],
        "restore_memory_s/memcpy_s": out["restore_memory_s"] / out["memcpy_s"],
        "restore_disk_s/torch_load_s": out["restore_disk_s"] / out["torch_load_s"],
        "restore_disk_s/torch_load_mmap_s": out["restore_disk_s"] / out["torch_load_mmap_s"],
        "dedup_bytes_ratio": out["dedup_bytes_ratio"],
    }
    out["targets"] = {
        k: {"value": v, "target": TARGETS[k], "met": v <= TARGETS[k]} for k, v in ratios.items()
    }
    out.update(reps=reps, torch=torch.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count())
    out["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    if device == "cuda":
        out["memcpy_is"] = "one device-to-host copy of state_bytes into pinned host memory"
    out["load_average_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    return out


def measure(params: int, reps: int, workdir: Path, device: str = "cpu") -> dict[str, Any]:
    """Timings of the store and its baselines on one model; each round measures every key once, so load
    from other work on the host, which comes and goes, weighs on the baselines and the store alike.

    On cuda every timing ends with a device synchronize, and the memcpy floor is a device-to-pinned-host copy
    (what a snapshot must move at least); torch.load puts the tensors back on the device.
    """
    cuda = device == "cuda"
    model, opt = build(params, device=device)
    state = TrainingState()
    state.register("model", model)
    state.register("optimizer", opt)
    state_bytes = sum(t.numel() * t.element_size() for t in state.live_tensors().values())
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters()), "state_bytes": state_bytes}
    times: dict[str, list[float]] = defaultdict(list)
    pt = workdir / "state.pt"
    src = torch.ones(state_bytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(state_bytes, dtype=torch.uint8, pin_memory=cuda)

    def timed(key: str, fn: Callable[[], Any]) -> None:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times[key].append(time.perf_counter() - t0)

    def torch_save() -> None:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)

    def torch_load(mmap: bool) -> None:
        sd = torch.load(pt, weights_only=True, mmap=mmap)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        if mmap:  # the optimizer state is still an unread view of the file: read it
            for s in opt.state.values():
                for t in s.values():
                    t.sum()

    options = CheckpointOptions(workdir / "store", keep_last=2, memory_slots=1, max_in_flight=1, dedup=False)
    overlapped = CheckpointOptions(
        workdir / "store-overlap", keep_last=2, memory_slots=1, max_in_flight=1, dedup=False, overlap=True
    )
    width = model[0].in_features
    batch = torch.randn(32, width, device=device, generator=torch.Generator(device).manual_seed(0))

    def forward_backward() -> None:
        model(batch).square().mean().backward()

    def overlap_save(step: int) -> None:
        """checkpoint.overlap: the save returns once the buffers are copied; the parameters and optimizer
        state are copied beside the next forward and backward, and the optimizer's step would wait for the
        rest. Charged: the return, plus that wait."""
        sync()
        t0 = time.perf_counter()
        over.save(step)
        returned = time.perf_counter() - t0
        t1 = time.perf_counter()
        forward_backward()
        sync()
        times["overlapped_fwd_bwd_s"].append(time.perf_counter() - t1)
        times["blocking_save_overlap_s"].append(returned + over.wait_capture())
        opt.zero_grad(set_to_none=True)
        over.wait()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with CheckpointManager(options, state) as mgr, CheckpointManager(overlapped, state) as over:
        mgr.save(0)  # allocates the reused snapshot buffers, as the first save of a run does
        mgr.wait()
        over.save(0)
        over.wait()
        for step in range(1, reps + 1):
            perturb(model, opt)
            pt.unlink(missing_ok=True)
            timed("torch_save_s", torch_save)
            timed("torch_load_s", lambda: torch_load(False))
            timed("memcpy_s", lambda: dst.copy_(src))
            timed("blocking_save_s", lambda: mgr.save(step))  # noqa: B023 - called at once
            timed("write_s", mgr.wait)
            timed("fwd_bwd_s", forward_backward)
            opt.zero_grad(set_to_none=True)
            overlap_save(step)
            timed("restore_memory_s", mgr.restore_memory)
            timed("restore_disk_s", lambda: mgr.restore(tier="local"))
            timed("torch_load_mmap_s", lambda: torch_load(True))
            torch_load(False)  # untimed: the live optimizer state leaves the mapped file before it goes
    pt.unlink()
    out.update({key: statistics.median(values) for key, values in times.items()})
    return out


def dedup_ratio(params: int, directory: Path, *, optimizer_state_for_frozen: bool) -> float:
    """Bytes the second save writes when 90% of parameters are frozen, over the first (full) save's bytes.

    With `optimizer_state_for_frozen`, the frozen layers were trained before being frozen, so AdamW holds
    (unchanging) state for them too, as in progressive freezing or fine-tuning a trained model.
    """
    model, opt = build(params, frozen=0.0 if optimizer_state_for_frozen else 0.9)
    if optimizer_state_for_frozen:
        layers = list(model)
        for layer in layers[: int(len(layers) * 0.9)]:
            layer.requires_grad_(False)
    state = TrainingState()
    state.register("model", model)
    state.register("optimizer", opt)
    with CheckpointManager(CheckpointOptions(directory, memory_slots=0, async_save=False), state) as mgr:
        first = mgr.save(1)
        perturb(model, opt)
        second = mgr.save(2)
        full, again = mgr.get(first.id).written_bytes, mgr.get(second.id).written_bytes
    return again / full
