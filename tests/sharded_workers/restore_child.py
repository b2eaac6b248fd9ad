"""A rank of a 2-rank FSDP2 run (launched by hand, gloo, CPU) that restores after rank 0 corrupts ranks.1.json.

Usage: restore_child.py OUT STORE TIMEOUT_S
Saves at steps 1 and 2; rank 0 then flips one base64 character of save 2's ranks.1.json (same size); every
rank restores "latest", then save 2 by id. Then rank 0 alone fails before DCP's collectives: a second writer
of the store (its lock), a save whose clock raises (the commit record). Last, rank 0 flips a character of
save 1's manifest and every rank restores save 1 by id. Each rank writes OUT/rank<r>.json: what each call
returned or raised.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

import torch.distributed as dist

from supervisor.checkpoint.dcp_writer import rank_file
from supervisor.checkpoint.manifest import CKPT_PREFIX, MANIFEST
from supervisor.checkpoint.sharded import RankLost, ShardedCheckpoints
from supervisor.errors import CheckpointError
from supervisor.sharded_state import ShardedTrainingState
from tests.sharded_workers.fsdp_child import build, train


def flip_base64_char(path: str) -> None:
    """Change one base64 character in place, keeping the file's size (a bit flip that JSON still parses)."""
    raw = bytearray(open(path, "rb").read())
    at = max(i for i, b in enumerate(raw) if chr(b).isalnum())
    raw[at] = ord("B") if raw[at] != ord("B") else ord("C")
    with open(path, "r+b") as f:
        f.write(raw)


def main() -> None:
    out, store, timeout_s = sys.argv[1:4]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(0, world)
    state = ShardedTrainingState(model, opt)
    report: dict[str, object] = {"rank": rank}
    broken_clock = False

    def clock() -> float:
        if broken_clock:
            raise OSError("clock unavailable (injected)")  # rank 0 alone reads it, building the commit
        return time.time()

    def attempt(tag: str, call: Callable[[], object]) -> None:
        try:
            report[tag] = call()
        except (CheckpointError, RankLost) as exc:
            report[tag] = [type(exc).__name__, str(exc)]

    with ShardedCheckpoints(store, collective_timeout_s=float(timeout_s), clock=clock) as ckpts:
        train(model, opt, rank, 1)
        report["save1"] = save1 = ckpts.save(1, state)
        train(model, opt, rank, 1)
        report["save2"] = save2 = ckpts.save(2, state)
        if rank == 0:
            flip_base64_char(os.path.join(store, rank_file(str(save2), 1)))
        dist.barrier()
        attempt("latest", lambda: ckpts.restore(state, "latest"))
        attempt("explicit", lambda: ckpts.restore(state, str(save2)))
        # Rank 0 alone fails before DCP's collectives: every rank raises the same error at once.
        attempt("second_writer", lambda: ShardedCheckpoints(store, collective_timeout_s=float(timeout_s)))
        broken_clock = True
        attempt("save_broken_clock", lambda: ckpts.save(3, state))
        broken_clock = False
        if rank == 0:
            flip_base64_char(os.path.join(store, f"{CKPT_PREFIX}{save1}", MANIFEST))
        dist.barrier()
        attempt("corrupt_manifest", lambda: ckpts.restore(state, str(save1)))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
