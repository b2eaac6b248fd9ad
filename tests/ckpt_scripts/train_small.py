"""A small real training run for the bit-exact resume test: dropout, shuffled resumable loader, AdamW,
an LR schedule, GradScaler("cpu"), and draws from Python's and NumPy's RNGs every step.

python train_small.py STORE OUT --steps M --save-every K [--resume] [--sync]
Prints "step N" after every step; appends one JSON line per step to OUT/losses.jsonl; at the end writes
OUT/final.safetensors and OUT/final.json (the whole training state, for torch.equal comparisons).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

import numpy as np
import torch
from safetensors.torch import save_file

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.data import ResumableLoader
from supervisor.flatten import flatten
from supervisor.state import TrainingState


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--sync", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    torch.set_num_threads(1)

    data_gen = torch.Generator().manual_seed(99)
    xs = torch.randn(90, 16, generator=data_gen)
    ys = (xs @ torch.randn(16, 1, generator=data_gen)).squeeze(1)
    loader = ResumableLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8, shuffle=True, seed=5)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.05 * s))
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, growth_interval=3)

    state = TrainingState()
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched), ("scaler", scaler)):
        state.register(name, obj)
    state.register("data", loader)
    options = CheckpointOptions(args.store, keep_last=3, async_save=not args.sync, memory_slots=1)
    os.makedirs(args.out, exist_ok=True)
    losses = open(os.path.join(args.out, "losses.jsonl"), "a", buffering=1)
    with CheckpointManager(options, state) as mgr:
        if args.resume and mgr.latest() is not None:
            info = mgr.restore()
            print(f"resumed {info.step}", flush=True)
        step = state.step
        model.train()
        while step < args.steps:
            for x, y in loader:
                x = x + 0.01 * torch.from_numpy(np.random.standard_normal(x.shape)).float()
                weight = 1.0 + 0.1 * random.random()
                loss = weight * torch.nn.functional.mse_loss(model(x).squeeze(1), y)
                opt.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                sched.step()
                step += 1
                state.step, state.samples_seen = step, state.samples_seen + len(x)
                losses.write(json.dumps({"step": step, "loss": float(loss.item()).hex()}) + "\n")
                print(f"step {step}", flush=True)
                if step % args.save_every == 0:
                    mgr.save(step, metrics={"loss": float(loss.item())})
                if step >= args.steps:
                    break
            else:
                state.epoch += 1
    skeleton, tensors = flatten(state.state_dict())
    save_file(
        {k: v.detach().contiguous().clone() for k, v in tensors.items()},
        os.path.join(args.out, "final.safetensors"),
    )
    with open(os.path.join(args.out, "final.json"), "w") as f:
        json.dump(skeleton, f, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
