"""A rank of a 2-rank FSDP2 run (launched by hand, gloo, CPU) whose second sharded save meets a fault.

Usage: commit_child.py OUT STORE FAULT_RANK PHASE KIND TIMEOUT_S
KIND: kill (SIGKILL itself: a real signal), hang (sleep until the test kills it), oserror (the write fails),
refuse (rank 0's gate refuses save 2 at PHASE: "plan" before the write, "finish" just before the commit).
Before each save, rank 0 writes the gathered state to OUT/ref<n>.safetensors (test-only reference). Each rank
that lives on writes OUT/rank<r>.json: how save 2 ended, and with oserror whether save 3 then committed.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time

import torch.distributed as dist

from supervisor.checkpoint.sharded import RankLost, ShardedCheckpoints
from supervisor.errors import CheckpointError
from supervisor.sharded_state import ShardedTrainingState
from tests.sharded_workers.fsdp_child import build, gather, train


def main() -> None:
    out, store, fault_rank, phase, kind, timeout_s = sys.argv[1:7]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    armed = False

    def hook(at: str, r: int) -> None:
        if not armed or kind == "refuse" or (r, at) != (int(fault_rank), phase):
            return
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            time.sleep(600)
        else:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

    gate_calls = []

    def gate(checkpoint_id: str) -> str | None:
        gate_calls.append(checkpoint_id)
        wanted = 1 if phase == "plan" else 2  # the gate is asked twice per save: planning, then committing
        refuse = armed and kind == "refuse" and len([c for c in gate_calls if c == checkpoint_id]) == wanted
        return "a rollback went past it (injected)" if refuse else None

    model, opt = build(0, world)
    state = ShardedTrainingState(model, opt)
    report: dict[str, object] = {"rank": rank}
    with ShardedCheckpoints(
        store, collective_timeout_s=float(timeout_s), phase_hook=hook, gate=gate
    ) as ckpts:
        train(model, opt, rank, 1)
        gather(model, opt, out, "ref1", rank)
        report["save1"] = ckpts.save(1, state)
        train(model, opt, rank, 1)
        gather(model, opt, out, "ref2", rank)
        armed = True
        t0 = time.monotonic()
        try:
            report["save2"] = ckpts.save(2, state)
        except (CheckpointError, RankLost) as exc:
            report["save2_error"] = type(exc).__name__
            report["save2_message"] = str(exc)
        report["save2_s"] = round(time.monotonic() - t0, 3)
        armed = False
        if report.get("save2_error") == "CheckpointError" or report.get("save2", "") is None:
            # A failed or refused save: training goes on and saves again.
            train(model, opt, rank, 1)
            gather(model, opt, out, "ref3", rank)
            report["save3"] = ckpts.save(3, state)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if "save2_error" not in report or report["save2_error"] == "CheckpointError":
        dist.destroy_process_group()
    else:
        os._exit(3)  # the group is unusable after a lost rank: exit at once, as a relaunch would want


if __name__ == "__main__":
    main()
