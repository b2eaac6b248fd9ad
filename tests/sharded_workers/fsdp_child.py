"""A torchrun child for the sharded-checkpoint tests: FSDP2 (fully_shard) on CPU over gloo.

Usage: fsdp_child.py MODE OUT [STORE ...]
- save STORE: train 2 steps at this world size, write the gathered reference (OUT/ref.*), save the sharded
  checkpoint, then restore it into a freshly built model (other seed) at once and write what it gathers.
  Then the same for a DDP model through the same path (into STORE-ddp), reporting whether it came back.
- load STORE [RESAVE]: restore the latest checkpoint of STORE into a fresh model and write what it gathers;
  with RESAVE, also save the restored state there (at this world size).
Gathered states (model and optimizer, full, on rank 0) go to OUT/<tag>.safetensors + OUT/<tag>.json, never a
pickle. Each rank writes OUT/<tag>.rank<r>.json: whether its RNG stream came back at the saving world size.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from supervisor.checkpoint.sharded import ShardedCheckpoints
from supervisor.sharded_state import ShardedTrainingState, flatten_sharded


def build(seed: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Uneven shards (11 rows) and, at 2 ranks and more, empty ones (a 1-row weight)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1)
    )
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[1], model[3]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> None:
    for s in range(steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        model(torch.randint(0, 11, (4,), generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def gather(model: torch.nn.Module, opt: torch.optim.Optimizer, out: str, tag: str, rank: int) -> None:
    """The full model and optimizer state on rank 0 (test-only: the checkpoint path never gathers)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    if rank == 0:
        skeleton, tensors = flatten_sharded({"model": model_sd, "optimizer": optim_sd})
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, f"{tag}.safetensors"))
        with open(os.path.join(out, f"{tag}.json"), "w") as f:
            json.dump(skeleton, f, sort_keys=True)


def ddp_round_trip(store: str, group: object) -> bool:
    """DDP through the sharded path: DCP spreads the replicated tensors over the ranks; True when a restore
    into a perturbed model gives every tensor back bit for bit."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_ddp = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 64, generator=train_ddp)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    state = ShardedTrainingState(model, opt)
    with ShardedCheckpoints(store, process_group=group) as ckpts:
        ckpts.save(2, state)
        saved = {k: v.clone() for k, v in state.snapshot()[1].items()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpts.restore(state)
    got = state.snapshot()[1]
    return got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)


def main() -> None:
    mode, out, store = sys.argv[1], sys.argv[2], sys.argv[3]
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    # A gloo group of its own for checkpoint collectives, with a bounded timeout (design, section 1).
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60)) if distributed else None
    report: dict[str, object] = {"rank": rank, "world": world}
    if mode == "save":
        model, opt = build(0, world)
        train(model, opt, rank, 2)
        gather(model, opt, out, "ref", rank)
        with ShardedCheckpoints(store, process_group=group) as ckpts:
            rng = torch.get_rng_state()
            cid = ckpts.save(2, ShardedTrainingState(model, opt))
            fresh, fresh_opt = build(1, world)
            torch.manual_seed(99 + rank)  # a different stream, which the restore must put back
            assert ckpts.restore(ShardedTrainingState(fresh, fresh_opt)) == cid
            report["rng_back"] = torch.equal(torch.get_rng_state(), rng)
        gather(fresh, fresh_opt, out, f"got{world}", rank)
        if distributed:
            report["ddp_equal"] = ddp_round_trip(store + "-ddp", group)
    elif mode == "load":
        fresh, fresh_opt = build(1, world)
        with ShardedCheckpoints(store, process_group=group) as ckpts:
            ckpts.restore(ShardedTrainingState(fresh, fresh_opt))
        gather(fresh, fresh_opt, out, f"got{world}", rank)
        if len(sys.argv) > 4:
            with ShardedCheckpoints(sys.argv[4], process_group=group) as again:
                again.save(2, ShardedTrainingState(fresh, fresh_opt))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    with open(os.path.join(out, f"{mode}{world}.rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
