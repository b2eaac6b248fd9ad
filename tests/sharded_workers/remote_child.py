"""torchrun child of tests/test_sharded_remote.py: FSDP2 on 2 ranks, sharded checkpoints with a remote tier.

- save STORE REMOTE OUT: three async saves while training; rank 0 uploads each commit. Each rank writes its
  local shards and RNG state of the last save to OUT/ref.rank<r>.safetensors.
- restore STORE REMOTE OUT: a fresh, empty local store (a new machine): restore "latest", which rank 0 fetches
  from the remote tier; each rank compares what it got with the reference and writes OUT/restore.rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from supervisor.checkpoint.sharded import ShardedCheckpoints, checkpoint_group
from supervisor.sharded_state import ShardedTrainingState
from tests.sharded_workers.async_child import build, local, same, train_step


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mode, store, remote, out = sys.argv[1:5]
    rank = dist.get_rank()
    group = checkpoint_group(60.0)
    model, opt = build(0)
    state = ShardedTrainingState(model, opt)
    gen = torch.Generator().manual_seed(10 + rank)
    if mode == "save":
        with ShardedCheckpoints(store, process_group=group, remote=remote) as ckpts:
            for step in range(1, 4):
                train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))
                cid = ckpts.save(step, state, {"loss": 1.0}, blocking=False)
            ref = {**local(state), "__rng__": torch.get_rng_state()}
            ckpts.wait()
        save_file(ref, os.path.join(out, f"ref.rank{rank}.safetensors"), metadata={"id": cid})
    else:
        train_step(
            model, opt, torch.randint(0, 11, (4, 3), generator=gen)
        )  # other values than the saved ones
        torch.manual_seed(999)
        with ShardedCheckpoints(store, process_group=group, remote=remote) as ckpts:
            got = ckpts.restore(state)
        ref = load_file(os.path.join(out, f"ref.rank{rank}.safetensors"))
        rng = ref.pop("__rng__")
        report = {"id": got, "equal": same(local(state), ref) and torch.equal(torch.get_rng_state(), rng)}
        with open(os.path.join(out, f"restore.rank{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
