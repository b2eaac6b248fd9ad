"""A torchrun child for the multi-node test: session_child's FSDP2 model under `Session`, on 2 "nodes".

Usage: multinode_child.py STEPS OUT PAUSE_STEP
Like session_child (the same model, data and final report), except that the first rank of node 1
(ROLLBACK_SUPERVISOR_NODE=1, LOCAL_RANK=0) stops at PAUSE_STEP once per lineage: it writes OUT/paused.json
(its node's pids are then known to the test, which kills the whole node) and sleeps. A later segment finds the
file and goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from supervisor.runtime import Session
from supervisor.sharded_state import flatten_sharded
from tests.sharded_workers.session_child import build


def main() -> int:
    steps, out, pause_step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pauses = os.environ.get("ROLLBACK_SUPERVISOR_NODE") == "1" and os.environ.get("LOCAL_RANK") == "0"
    marker = os.path.join(out, "paused.json")
    model, opt, sched, loader = build(rank, world)
    sess = Session.attach(config={"steps": steps}, run_name="multinode")
    sess.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    with sess:
        for step, batch in sess.loop(loader, max_steps=steps):
            if pauses and step == pause_step and not os.path.exists(marker):
                with open(marker + ".tmp", "w") as f:
                    json.dump({"rank": rank, "pid": os.getpid(), "step": step}, f)
                os.replace(marker + ".tmp", marker)
                time.sleep(3600)  # the test kills this node here
            loss = model(batch).pow(2).mean()
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            sess.log(loss=float(loss), lr=sched.get_last_lr()[0])
            if step % 10 == 0:
                sess.log(val_loss=float(loss))
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
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(report, f)
        dist.barrier()  # leave together (see session_child)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # Leave without the interpreter's teardown. Under load, 4 gloo ranks on 2 cores now and then aborted in
    # it after a finished run ("terminate called without an active exception", with no Python frame on the
    # stack), which the supervisor rightly treats as a crash and relaunches; these tests are about the runs.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
