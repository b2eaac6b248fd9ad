"""A torchrun child for tests/test_resplit.py: an FSDP2 model under `Session`, over the 50 samples 0..49.

Usage: resplit_child.py PHASE WORK OUT STEPS [CHECKPOINT_ID]
PHASE "save": train STEPS steps from scratch (the Session's final save). PHASE "finish": restore CHECKPOINT_ID
(saved at any world size) and train STEPS more. Every rank writes OUT/rank<r>.json: the sample indices it read,
the epoch of each and of each step, its RNG draws right after the restore, its samples_seen and the checkpoint it
saved last.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from supervisor.data import ResumableLoader
from supervisor.runtime import Session
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec

LENGTH = 50


def main() -> int:
    phase, work, out, steps = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    checkpoint_id = sys.argv[5] if phase == "finish" else None  # "save" starts from scratch
    start, clock = time.monotonic(), {}
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = LaunchPlan(
        lineage="resplit",
        workdir=str(out / "segment"),
        checkpoint_dir=str(work / "checkpoints"),
        tracking_uri=f"sqlite:///{work / 'mlflow.db'}",
        supervised=True,  # as a supervisor writes it: every rank reads the plan, metrics go to its spool
        run_id="resplit",  # with metrics_spool: metric points go to a file, no MLflow database here
        metrics_spool=str(out / f"metrics{rank}.jsonl"),
        restore=RestoreSpec(checkpoint_id=checkpoint_id),
    )
    os.environ[PLAN_ENV] = str(plan.write(out / f"plan{rank}.json"))

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1, 8), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    )
    for layer in (model[0], model[3]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = ResumableLoader(
        torch.arange(LENGTH), batch_size=4, shuffle=True, seed=7, rank=rank, world_size=world
    )
    sess = Session.attach(run_name="resplit")
    sess.register(model=model, optimizer=opt, data=loader)
    sess.state.extras["seed"] = 7  # the run's seed, saved with every checkpoint
    indices: list[int] = []
    epochs: list[int] = []
    step_epochs: list[int] = []  # the epoch of each step: every rank must end an epoch at the same step
    clock["built"] = time.monotonic() - start
    with sess:
        sess.restore()
        clock["restored"] = time.monotonic() - start
        draws = [random.random(), float(np.random.rand()), torch.rand(2).tolist()]
        for _, batch in sess.loop(loader, max_steps=sess.step + steps):
            indices += batch.tolist()
            epochs += [sess.state.epoch] * len(batch)
            step_epochs.append(sess.state.epoch)
            loss = model(batch.float().unsqueeze(1) / LENGTH).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sess.log(loss=float(loss.detach()))
        clock["trained"] = time.monotonic() - start
    clock["closed"] = time.monotonic() - start
    code = sess.exit_code
    if code == 0:
        saved = sorted(p.name for p in (work / "checkpoints").glob(f"ckpt-{sess.step:010d}-*"))
        report = {
            "indices": indices,
            "epochs": epochs,
            "step_epochs": step_epochs,
            "draws": draws,
            "samples_seen": sess.state.samples_seen,
            "final_checkpoint": saved[-1].removeprefix("ckpt-") if saved else None,
            "length": LENGTH,
            "clock": clock,
        }
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        dist.barrier()  # leave together (see session_child.py)
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
