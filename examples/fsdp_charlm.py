"""The standard workload (examples/charlm.py) sharded with FSDP2, supervised by rollback-supervisor.

The same model, data, optimizer and schedule as charlm.py, each transformer block and then the whole model
wrapped with `fully_shard` (gloo on CPU, NCCL with --device cuda). `Session.register` sees the DTensor
parameters and checkpoints shard by shard: every rank writes its own shards through
torch.distributed.checkpoint into the store, and no rank ever gathers the full state. A NaN or a spike is
rolled back in process on every rank; a killed rank makes the supervisor relaunch all of them from the last
commit. Run it under torchrun, alone or under `rollback-supervisor run`:

    torchrun --standalone --nproc_per_node=2 examples/fsdp_charlm.py --steps 300
    rollback-supervisor run --policy policies/presets/palm-spike.yaml --lineage charlm-fsdp -- \\
        torchrun --standalone --nproc_per_node=2 examples/fsdp_charlm.py --steps 300
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings

import charlm  # examples/charlm.py, next to this file (the script's directory is on sys.path)
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from supervisor.runtime import Session


def shard(model: charlm.CharLM) -> charlm.CharLM:
    """FSDP2: each transformer block is its own unit (gathered just for its forward), the rest the root."""
    for block in model.blocks.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def build(args, rank: int, world_size: int, device: torch.device):
    """charlm's model, data and schedule; the optimizer is made after sharding, over the DTensor parameters."""
    model, opt, _, loader, val_batches = charlm.build(args, rank, world_size, device)
    shard(model)
    # fully_shard replaced the parameters: an optimizer over the old ones would step nothing. The new one
    # takes charlm's hyperparameters (those of its defaults the constructor accepts).
    accepted = inspect.signature(type(opt)).parameters
    opt = type(opt)(model.parameters(), **{k: v for k, v in opt.defaults.items() if k in accepted})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, charlm.warmup_cosine(args.warmup, args.steps))
    return model, opt, sched, loader, val_batches


def join(backend: str) -> tuple[int, int]:
    """Join torchrun's process group; FSDP2 needs one even at a world size of 1."""
    if "RANK" not in os.environ:  # a usage error: exit 2, no traceback
        print(
            "fsdp_charlm.py: RANK is not set; run it under torchrun, e.g. "
            "torchrun --standalone --nproc_per_node=2 examples/fsdp_charlm.py --steps 300",
            file=sys.stderr,
        )
        raise SystemExit(2)
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def train(args) -> tuple[int, nn.Module, torch.optim.Optimizer]:
    """Train under a supervisor session; returns the exit code, the (sharded) model and the optimizer."""
    if args.threads:
        torch.set_num_threads(args.threads)
    charlm.deterministic()
    rank, world_size = join("nccl" if args.device.startswith("cuda") else "gloo")
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    model, opt, sched, loader, val_batches = build(args, rank, world_size, device)
    # The logits are a view (a Linear over 3-D input); they are only read, never changed in place, which is
    # what this warning, printed at every forward, is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    val_batches = [(x.to(device), y.to(device)) for x, y in val_batches]

    sess = Session.attach(config=vars(args), workdir=args.workdir, policy=args.policy, run_name="fsdp-charlm")
    sess.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    with sess:
        for step, (x, y) in sess.loop(loader, max_steps=args.steps):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if isinstance(grad_norm, DTensor):  # the norm over every rank's shards
                grad_norm = grad_norm.full_tensor()
            opt.step()
            sched.step()
            sess.log(loss=loss.item(), grad_norm=grad_norm.item(), lr=sched.get_last_lr()[0])
            if step % args.eval_every == 0 or step == args.steps:
                sess.log(val_loss=charlm.evaluate(model, val_batches))  # every rank: FSDP2 gathers
    return sess.exit_code, model, opt


def main(argv: list[str] | None = None) -> int:
    code = train(charlm.parse_args(argv))[0]
    if code == 0:
        # Leave together: a rank that tears gloo down while its peer still completes a last send can make that
        # peer abort (see `supervisor.runtime.distributed`).
        dist.barrier()
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
