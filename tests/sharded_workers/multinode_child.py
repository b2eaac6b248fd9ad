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

from supervisor.runtime import Session
from tests.sharded_workers.session_child import build, finish, leave, train_step


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
            train_step(sess, model, opt, sched, step, batch)
    return finish(sess, model, opt, sched, loader, out)


if __name__ == "__main__":
    leave(main())
