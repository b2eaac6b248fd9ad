"""A torchrun child for the sharded Session tests: an FSDP2 (fully_shard) model trained under `Session`.

Usage: session_child.py STEPS OUT
Each rank reads its own shard of the data and draws its own dropout stream. When the segment finishes (exit 0),
the full model and optimizer state is gathered on rank 0 (test-only: the checkpoints never gather) into
OUT/final.safetensors + OUT/final.json, and each rank writes its next batch and RNG draw to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from supervisor.data import ResumableLoader
from supervisor.runtime import Session
from supervisor.sharded_state import flatten_sharded
from supervisor.state import rank_seed


def build(rank: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, object, ResumableLoader]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 6),
        torch.nn.Linear(6, 7),
        torch.nn.Dropout(0.2),
        torch.nn.ReLU(),
        torch.nn.Linear(7, 1),
    )
    for layer in (model[1], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    data = torch.randint(0, 11, (96, 4), generator=torch.Generator().manual_seed(5))
    loader = ResumableLoader(
        data, batch_size=4, shuffle=True, drop_last=True, seed=7, rank=rank, world_size=world
    )
    torch.manual_seed(rank_seed(7, rank, world))  # each rank its own dropout stream
    return model, opt, sched, loader


def main() -> int:
    steps, out = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, sched, loader = build(rank, world)
    sess = Session.attach(config={"steps": steps}, run_name="fsdp")
    sess.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    with sess:
        for step, batch in sess.loop(loader, max_steps=steps):
            train_step(sess, model, opt, sched, step, batch)
    return finish(sess, model, opt, sched, loader, out)


def train_step(
    sess: Session, model: torch.nn.Module, opt: torch.optim.Optimizer, sched, step: int, batch
) -> None:
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    sess.log(loss=float(loss), lr=sched.get_last_lr()[0])
    if step % 10 == 0:  # what the policy's rollback target is chosen by
        sess.log(val_loss=float(loss))


def finish(sess: Session, model: torch.nn.Module, opt: torch.optim.Optimizer, sched, loader, out: str) -> int:
    """After a finished segment: the full state gathered on rank 0 into OUT/final.*, each rank's report; then
    every rank leaves together. Returns the session's exit code."""
    rank = dist.get_rank()
    code = sess.exit_code
    if code == 0:
        model_sd, optim_sd = get_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            skeleton, tensors = flatten_sharded({"model": model_sd, "optimizer": optim_sd})
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "final.safetensors"))
            with open(os.path.join(out, "final.json"), "w") as f:
                json.dump(skeleton, f, sort_keys=True)
        report = {
            "step": sess.step,
            "next_batch": next(iter(loader)).tolist(),
            "draw": torch.rand(3).tolist(),
            "lr": sched.get_last_lr()[0],
            "pid": os.getpid(),
            "rollbacks_in_process": sess.rollbacks_in_process,
            "batches_skipped": loader.batches_skipped,
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
    if code == 0:
        # Leave together: a rank that tears gloo down while its peer still completes the gather's last send
        # can make that peer abort (SIGABRT), as `Distributed.finish` explains.
        dist.barrier()
    dist.destroy_process_group()
    return code


def leave(code: int) -> None:
    """Exit without the interpreter's teardown. Under load, 4 gloo ranks on 2 cores now and then aborted in it
    after a finished run ("terminate called without an active exception", with no Python frame on the stack),
    which the supervisor rightly treats as a crash and relaunches; these tests are about the runs."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main())
