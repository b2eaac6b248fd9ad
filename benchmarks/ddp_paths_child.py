"""A torchrun child of `bench checkpoint --ddp-paths`: one DDP model (gloo, CPU), both of the Session's ways to
checkpoint it, side by side in every rep.

Usage: ddp_paths_child.py CONFIG_JSON; each rank writes OUT/rank<r>.json.

- rank-0 path (what the Session does under DDP today): every rank's own state (its RNG streams) is gathered to
  rank 0 on the Session's group (`Distributed.gather_state`), rank 0 alone saves the replicated full state with
  its `CheckpointManager` (async_save), the other ranks do nothing more; a restore is `PlanRestore`'s: rank 0
  restores, names the id (`broadcast_outcome`), then every other rank reads the full state
  (`ReadOnlyCheckpoints`).
- sharded path: every rank's `ShardedCheckpoints` over a `ShardedTrainingState` of the DDP model, save(blocking=
  False) then wait(); DCP's planner gives each replicated tensor to one rank, so each rank writes a share; a
  restore reads on every rank at once.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from torch.nn.parallel import DistributedDataParallel

from benchmarks.checkpoint import build, perturb
from benchmarks.sharded_child import Clock
from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.checkpoint.catalog import open_store
from supervisor.checkpoint.retention import KeepLast
from supervisor.checkpoint.sharded import ShardedCheckpoints
from supervisor.runtime.distributed import Distributed, ReadOnlyCheckpoints
from supervisor.sharded_state import ShardedTrainingState
from supervisor.state import TrainingState

#: Bounded collectives: a lost peer fails the benchmark instead of hanging it.
TIMEOUT = datetime.timedelta(seconds=600)
BATCH = 4
KEEP = 2  # checkpoints kept per store: bounds the disk a 100M run takes


def digest(state: ShardedTrainingState) -> str:
    """xxh3 over every model and optimizer tensor, by name: a restore must give exactly these bytes back."""
    h = xxhash.xxh3_64()
    _, flat = state.snapshot()
    for name, t in sorted(flat.items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def blob_bytes(store_dir: Path, cid: str, prefix: str) -> int:
    """Bytes of the checkpoint's tensor files under `prefix` (one rank's share, or all of rank 0's)."""
    manifest = open_store(store_dir).manifest(cid)
    return sum(f.size for f in manifest.files if f.path.startswith(prefix))


def measure(cfg: dict[str, Any]) -> None:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    # The Session's groups: its own (gather, broadcast, agreement) and the sharded writers' (checkpoint_group).
    session = Distributed(rank, world, dist.new_group(backend="gloo", timeout=TIMEOUT))
    ckpt_group = session.checkpoint_group(TIMEOUT.total_seconds())
    clock = Clock(dist.new_group(backend="gloo", timeout=TIMEOUT), cuda=False)
    work = Path(cfg["workdir"])
    torch.manual_seed(0)  # the same model and AdamW state on every rank, as DDP keeps them
    plain, opt = build(cfg["params"])
    model = DistributedDataParallel(plain)
    width = plain[0].in_features
    gen = torch.Generator().manual_seed(1 + rank)  # each rank its own batches; DDP averages the gradients

    def train_step() -> None:
        model(torch.randn(BATCH, width, generator=gen)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    # The rank-0 path: the Session's TrainingState, rank 0's manager, the other ranks' reader.
    tstate = TrainingState()
    tstate.register("model", model)
    tstate.register("optimizer", opt)
    tstate.rank = rank
    rank0_dir = work / "rank0-store"
    manager = (
        CheckpointManager(CheckpointOptions(rank0_dir, async_save=True, keep_last=KEEP), tstate)
        if rank == 0
        else None
    )
    dist.barrier(group=session.group)  # rank 0's store exists before a reader opens it
    reader = ReadOnlyCheckpoints(rank0_dir, tstate, verify="full") if rank else None
    # The sharded path, built as the Session's ShardedStore builds it.
    sstate = ShardedTrainingState(model, opt)
    sharded_dir = work / "sharded-store"
    ckpts = ShardedCheckpoints(
        sharded_dir,
        process_group=ckpt_group,
        retention=KeepLast(KEEP),
        verify="full",
        control_group=session.group,
    )
    step = 0

    def rank0_save() -> str:
        """Saver.save under DDP: every rank's share gathered to rank 0, rank 0's async save; then the wait."""
        nonlocal step
        step += 1
        t0 = clock.start()
        rank_states = session.gather_state(tstate.rank_state_dict([]))  # no data loader registered here
        cid = manager.save(step, rank_states=rank_states).id if manager is not None else ""
        clock.stop("rank0_blocking_save_s", t0)
        if manager is not None:
            manager.wait()
        clock.stop("rank0_save_total_s", t0)
        return session.broadcast_text(cid if rank == 0 else None)

    def sharded_save() -> str:
        nonlocal step
        step += 1
        t0 = clock.start()
        cid = ckpts.save(step, sstate, blocking=False)
        clock.stop("sharded_blocking_save_s", t0)
        ckpts.wait()
        clock.stop("sharded_save_total_s", t0)
        assert isinstance(cid, str), "the sharded save was refused"
        return cid

    def rank0_restore(cid: str) -> None:
        """PlanRestore.restore under DDP, from disk as after a relaunch: rank 0 restores and names the id, then
        every other rank restores it read-only."""
        t0 = clock.start()
        if manager is not None:
            t1 = time.perf_counter()
            info = manager.restore(cid, tier="local")
            clock.times["rank0_restore_own_read_s"].append(time.perf_counter() - t1)
            session.broadcast_outcome(info.id)
        else:
            chosen = session.broadcast_outcome(None)
            assert chosen == cid and reader is not None
            t1 = time.perf_counter()
            reader.restore(chosen)
            clock.times["rank0_restore_own_read_s"].append(time.perf_counter() - t1)
        clock.stop("rank0_restore_s", t0)

    def sharded_restore(cid: str) -> None:
        clock.timed("sharded_restore_s", lambda: ckpts.restore(sstate, cid))

    # Warm-up, untimed, as a run's first saves: they allocate every slot of each path's host ring.
    for _ in range(max(len(ckpts.ring), 1)):
        train_step()
        rank0_save()
        sharded_save()
    clock.times.clear()

    exact = {"rank0_path": [], "sharded": [], "sharded_memory": []}
    written: dict[str, list[int]] = {"rank0_path": [], "sharded": []}
    order: list[str] = []
    loads: list[float] = []
    for rep in range(cfg["reps"]):
        loads.append(os.getloadavg()[0])
        train_step()  # new bytes in every tensor: neither store's dedup has anything to skip
        want = digest(sstate)
        # Alternate which path goes first, so neither always meets the other's page cache and dirty pages.
        first_rank0 = rep % 2 == 0
        order.append("rank0_path" if first_rank0 else "sharded")
        if first_rank0:
            cid0, cid1 = rank0_save(), sharded_save()
        else:
            cid1, cid0 = sharded_save(), rank0_save()
        written["rank0_path"].append(blob_bytes(rank0_dir, cid0, "blobs/") if rank == 0 else 0)
        written["sharded"].append(blob_bytes(sharded_dir, cid1, f"blobs/{cid1}.r{rank}"))
        restores = [("rank0_path", rank0_restore, cid0), ("sharded", sharded_restore, cid1)]
        for name, restore, cid in restores if first_rank0 else restores[::-1]:
            perturb(plain, opt)  # every value differs from the checkpoint's: the restore must write them all
            restore(cid)
            exact[name].append(digest(sstate) == want)
        # In-process rollback: the sharded path copies back from every rank's ring; the rank-0 path has none
        # under DDP (the Session leaves every anomaly to the supervisor: a relaunch, timed as rank0_restore_s).
        perturb(plain, opt)
        clock.timed("sharded_restore_memory_s", lambda: ckpts.restore_memory(sstate, cid1))  # noqa: B023
        exact["sharded_memory"].append(digest(sstate) == want)

    report = {
        "rank": rank,
        "world_size": world,
        "params": sum(p.numel() for p in plain.parameters()),
        "state_bytes": sum(t.numel() * t.element_size() for t in sstate.snapshot()[1].values()),
        "times": dict(clock.times),
        "bytes_written": written,
        "restored_bit_exact": exact,
        "first": order,
        "load_average_1m_per_rep": loads,
        "digest": digest(sstate),
    }
    ckpts.close()
    if manager is not None:
        manager.close()
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(report))
    # Leave together, then release the groups in order, as `Distributed.finish` does.
    session.finish()
    dist.destroy_process_group(clock.group)
    dist.destroy_process_group()


if __name__ == "__main__":
    measure(json.loads(Path(sys.argv[1]).read_text()))
