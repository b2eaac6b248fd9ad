"""Does a snapshot copy that overlaps the next step pay on this host? (issue 20, item 3)

One process, the example's model at `--size`, with AdamW. Each round measures, back to back:
- `step_s`: one training step (forward, backward, clip, optimizer step) with no snapshot;
- `sync`: a snapshot copied before training goes on (what the store does today: `copy_tensors` into reused
  host buffers), then the next step. Its cost to training is the copy;
- `overlap`: the same copy started on a thread (`OverlappedCopy`), the next step run beside it, and the step's
  optimizer waiting for the copy. Its cost is the start plus how much longer that next step took.

Both costs are divided by `torch.save` of the same state, measured in the same run, which is the figure the
issue's `blocking_save_s / torch_save_s` uses. Medians over `--reps` rounds; every round is in the JSON.

    python -m benchmarks.overlap --size 100M --reps 5 --json benchmarks/results/overlap-100M.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import load_charlm, machine, write_json
from supervisor.checkpoint.fastcopy import copy_tensors
from supervisor.checkpoint.overlap import OverlappedCopy


def _pairs(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[list[Any], list[Any]]:
    """(late, now): parameters and optimizer state (only the step changes them), and buffers (the forward
    may), each with a reused host buffer."""
    late = [(torch.empty_like(p.detach(), device="cpu"), p.detach()) for p in model.parameters()]
    for state in opt.state.values():
        late += [
            (torch.empty_like(t, device="cpu"), t) for t in state.values() if isinstance(t, torch.Tensor)
        ]
    now = [(torch.empty_like(b, device="cpu"), b) for b in model.buffers()]
    return late, now


def run(size: str, reps: int, threads: int) -> dict[str, Any]:
    charlm = load_charlm()
    args = charlm.parse_args(["--size", size])
    charlm.deterministic()
    model, opt, _, loader, _ = charlm.build(args)
    batches = iter(loader)

    def step() -> float:
        x, y = next(batches)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - t0

    for _ in range(2):  # optimizer state exists, kernels are warm
        step()
    late, now = _pairs(model, opt)
    state_bytes = sum(s.numel() * s.element_size() for _, s in late + now)
    copier = OverlappedCopy(threads=threads)
    copier.guard([opt])
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        pt = Path(tmp) / "state.pt"
        for _ in range(reps):
            r: dict[str, float] = {"step_s": step()}
            t0 = time.perf_counter()
            copy_tensors(now + late)
            r["sync_copy_s"] = time.perf_counter() - t0
            r["sync_next_step_s"] = step()
            waited = copier.waited_s
            t0 = time.perf_counter()
            copier.start(late, now)
            r["overlap_start_s"] = time.perf_counter() - t0
            r["overlap_next_step_s"] = step()
            r["overlap_waited_s"] = copier.waited_s - waited
            r["step_after_s"] = step()
            t0 = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, pt)
            r["torch_save_s"] = time.perf_counter() - t0
            # the cost to training: what the step took beyond the mean of the plain steps around it
            plain = (r["step_s"] + r["step_after_s"]) / 2
            r["sync_cost_s"] = r["sync_copy_s"] + max(0.0, r["sync_next_step_s"] - plain)
            r["overlap_cost_s"] = r["overlap_start_s"] + max(0.0, r["overlap_next_step_s"] - plain)
            rounds.append(r)
    copier.close()
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    return {
        "size": size,
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": state_bytes,
        "reps": reps,
        "copy_threads": threads,
        "torch_threads": torch.get_num_threads(),
        "median": med,
        "sync_cost/torch_save": med["sync_cost_s"] / med["torch_save_s"],
        "overlap_cost/torch_save": med["overlap_cost_s"] / med["torch_save_s"],
        "overlap_cost/sync_cost": med["overlap_cost_s"] / med["sync_cost_s"],
        "rounds": rounds,
        "machine": machine(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="100M")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="memcpy threads of the overlapped copy")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    print(write_json(run(a.size, a.reps, a.threads), a.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
