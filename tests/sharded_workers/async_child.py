"""A torchrun child for the asynchronous sharded-checkpoint tests (issue 17, slice 5): FSDP2 on CPU over gloo.

Usage: async_child.py MODE ...
- save OUT STORE: train, and every other step save asynchronously while training goes on; each save's local
  shards and RNG state are cloned at the save (the synchronous reference). Then: the ring buffers' addresses
  per save, a restore from disk and from memory into a fresh model at this world size against the reference
  of that step, a memory restore that falls back to disk, and the time an async and a sync save block
  training (a larger model). Each rank writes OUT/save.rank<r>.json.
- session STEPS OUT [FAIL]: the model trained under `Session` (the policy decides the saves). After an
  in-process rollback, every rank restores the same checkpoint again, from disk, into a second model and
  compares it with the live state the rollback left. FAIL: rank 1's writer raises (disk full) in its first
  background save. Each rank writes OUT/rank<r>.json; rank 0 also the gathered final state.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from supervisor.checkpoint.memory import local_shards
from supervisor.checkpoint.overlap import OverlappedCopy
from supervisor.checkpoint.sharded import ShardedCheckpoints, checkpoint_group
from supervisor.sharded_state import ShardedTrainingState, flatten_sharded


def build(seed: int, width: int = 7) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Uneven shards (11 rows) and an empty one at 2 ranks (a 1-row weight); dropout draws from the RNG."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, width),
        torch.nn.Linear(width, width),
        torch.nn.Dropout(0.2),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )
    for layer in (model[1], model[4]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    loss = model(batch).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss)


def local(state: Any) -> dict[str, torch.Tensor]:
    """This rank's local shards of every model and optimizer tensor, cloned."""
    shards, _ = local_shards(state.snapshot()[1])
    return {k: v.detach().clone() for k, v in shards.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def save_mode(out: str, store: str) -> None:
    rank = dist.get_rank()
    group = checkpoint_group(60.0)
    control = dist.new_group(backend="gloo")
    model, opt = build(0)
    state = ShardedTrainingState(model, opt)
    gen = torch.Generator().manual_seed(100 + rank)
    refs: dict[str, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
    ptrs: dict[str, list[int]] = {}
    report: dict[str, Any] = {"rank": rank}
    with ShardedCheckpoints(store, process_group=group, control_group=control, memory_slots=2) as ckpts:
        ids = []
        for step in range(1, 9):
            train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))
            if step % 2 == 0:
                ref = (local(state), torch.get_rng_state())
                cid = ckpts.save(step, state, {"loss": 1.0}, blocking=False)
                assert cid is not None
                snap = ckpts.ring.get(cid)
                assert snap is not None
                ptrs[cid] = [snap.tensors[k].data_ptr() for k in sorted(snap.tensors)]
                refs[cid] = ref
                ids.append(cid)
                report.setdefault("writing_after_submit", []).append(ckpts.writing())
        ckpts.wait()
        report["writing_after_wait"] = ckpts.writing()
        report["ids"] = ids
        # Two memory slots: saves 1 and 3 share one slot's buffers, 2 and 4 the other's, and the slots differ.
        report["reused"] = ptrs[ids[0]] == ptrs[ids[2]] and ptrs[ids[1]] == ptrs[ids[3]]
        report["distinct"] = not (set(ptrs[ids[0]]) & set(ptrs[ids[1]])) - {0}  # 0: an empty shard's buffer
        report["held"] = [ckpts.holds(i) for i in ids]

        fresh, fresh_opt = build(1)
        probe = ShardedTrainingState(fresh, fresh_opt)
        train_step(fresh, fresh_opt, torch.randint(0, 11, (4, 3), generator=gen))  # optimizer state exists
        results: dict[str, bool] = {}
        for tag, which, how in (
            ("disk_second", ids[1], "disk"),
            ("memory_last", ids[3], "memory"),
            ("fallback_first", ids[0], "memory"),  # no longer in the ring: every rank reads the disk
            ("disk_last", ids[3], "disk"),
        ):
            torch.manual_seed(999)  # a different stream, which the restore must put back
            got = ckpts.restore(probe, which) if how == "disk" else ckpts.restore_memory(probe, which)
            tensors, rng = refs[which]
            results[tag] = (
                got == which and same(local(probe), tensors) and torch.equal(torch.get_rng_state(), rng)
            )
        report["restored"] = results
    report["overlap"] = overlap_mode(store + "-overlap", group, control)
    report["capture_failure"] = capture_failure_mode(store + "-capture", group, control)
    report["timing"] = timing(store + "-timing", group, control)
    with open(os.path.join(out, f"save.rank{rank}.json"), "w") as f:
        json.dump(report, f)


def overlap_mode(store: str, group: Any, control: Any) -> dict[str, Any]:
    """An overlapped async save: the copy of parameters and optimizer state is held back until the next
    forward and backward have run and the optimizer's step has begun (which must wait for it); what the ring
    and the disk then hold equals the state cloned at the save, bit for bit."""
    model, opt = build(3)
    state = ShardedTrainingState(model, opt)
    gen = torch.Generator().manual_seed(300 + dist.get_rank())
    train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))
    release = threading.Event()
    copier = OverlappedCopy(on_chunk=lambda chunk: release.wait(30))
    out: dict[str, Any] = {}
    with ShardedCheckpoints(store, process_group=group, control_group=control, overlap=copier) as ckpts:
        ref = (local(state), torch.get_rng_state())
        cid = ckpts.save(1, state, {"loss": 1.0}, blocking=False)
        out["pending_after_save"] = copier.pending
        timer = threading.Timer(0.3, release.set)
        timer.start()
        train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))  # its step waits for the copy
        out["waited_s"] = copier.waited_s
        out["live_moved"] = not same(local(state), ref[0])
        ckpts.wait()
        probe_model, probe_opt = build(4)
        probe = ShardedTrainingState(probe_model, probe_opt)
        train_step(probe_model, probe_opt, torch.randint(0, 11, (4, 3), generator=gen))
        for how in ("memory", "disk"):
            torch.manual_seed(999)
            got = ckpts.restore_memory(probe, cid) if how == "memory" else ckpts.restore(probe, cid)
            out[how] = (
                got == cid and same(local(probe), ref[0]) and torch.equal(torch.get_rng_state(), ref[1])
            )
    return out


class FailingRankState(ShardedTrainingState):
    """Rank 1 cannot capture its share when `fail` is set (its rank state raises), rank 0 can."""

    fail = False

    def rank_state(self) -> dict[str, Any]:
        if self.fail and dist.get_rank() == 1:
            raise MemoryError("no host memory for the rank state")
        return super().rank_state()


def capture_failure_mode(store: str, group: Any, control: Any) -> dict[str, Any]:
    """A capture that fails on rank 1 alone fails that save on every rank together (async and blocking), and
    the saves after it commit with every rank in step: no hang, no checkpoint mixing two saves."""
    model, opt = build(5)
    state = FailingRankState(model, opt)
    gen = torch.Generator().manual_seed(500 + dist.get_rank())
    out: dict[str, Any] = {"async_error": None, "blocking_error": None}
    with ShardedCheckpoints(store, process_group=group, control_group=control) as ckpts:
        train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))
        state.fail = True
        ckpts.save(1, state, blocking=False)
        state.fail = False
        try:
            ckpts.wait()
        except Exception as exc:
            out["async_error"] = type(exc).__name__
        state.fail = True
        try:
            ckpts.save(2, state)
        except Exception as exc:
            out["blocking_error"] = type(exc).__name__
        state.fail = False
        train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))
        ref = local(state)
        cid = ckpts.save(3, state, blocking=False)
        ckpts.wait()
        out["committed"] = [i.id for i in ckpts.catalog.list()]
        probe_model, probe_opt = build(6)
        probe = ShardedTrainingState(probe_model, probe_opt)
        train_step(probe_model, probe_opt, torch.randint(0, 11, (4, 3), generator=gen))
        out["restored"] = ckpts.restore(probe, cid) == cid and same(local(probe), ref)
        out["last"] = cid
    return out


def timing(store: str, group: Any, control: Any) -> dict[str, float]:
    """Median time a save blocks training, synchronous and asynchronous, on a larger model (~4.5M params
    plus Adam, 54 MB in all, half per rank)."""
    model, opt = build(2, width=1500)
    gen = torch.Generator().manual_seed(7)
    train_step(model, opt, torch.randint(0, 11, (4, 3), generator=gen))
    state = ShardedTrainingState(model, opt)
    blocked: dict[str, list[float]] = {"sync": [], "async": []}
    with ShardedCheckpoints(store, process_group=group, control_group=control, memory_slots=1) as ckpts:
        for i in range(6):
            how = "async" if i % 2 else "sync"
            dist.barrier(group=control)
            t0 = time.perf_counter()
            ckpts.save(i, state, blocking=how == "sync")
            blocked[how].append(time.perf_counter() - t0)
            ckpts.wait()
    return {k: statistics.median(v) for k, v in blocked.items()}


def session_mode(steps: int, out: str, fail: bool) -> int:
    from supervisor.data import ResumableLoader
    from supervisor.runtime import Session
    from supervisor.state import rank_seed

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    data = torch.randint(0, 11, (96, 4), generator=torch.Generator().manual_seed(5))
    loader = ResumableLoader(
        data, batch_size=4, shuffle=True, drop_last=True, seed=7, rank=rank, world_size=world
    )
    torch.manual_seed(rank_seed(7, rank, world))  # each rank its own dropout stream
    sess = Session.attach(config={"steps": steps}, run_name="fsdp-async")
    sess.register(model=model, optimizer=opt, scheduler=sched, data=loader)
    report: dict[str, Any] = {"rank": rank, "pid": os.getpid()}
    seen_rollbacks = 0
    with sess:
        if fail and rank == 1:
            writes = []

            def disk_full(phase: str, at_rank: int) -> None:
                if phase == "write_start":
                    writes.append(phase)
                    if len(writes) == 1:
                        raise OSError(errno.ENOSPC, "No space left on device (test: rank 1's first save)")

            sess.manager.checkpoints.phase_hook = disk_full
        for step, batch in sess.loop(loader, max_steps=steps):
            if sess.rollbacks_in_process != seen_rollbacks:  # the rollback just restored the state
                seen_rollbacks = sess.rollbacks_in_process
                report["same_as_disk"] = same_as_disk(sess.manager, model, opt)
            loss = train_step(model, opt, batch)
            sched.step()
            sess.log(loss=loss, lr=sched.get_last_lr()[0])
            if step % 10 == 0:  # what the policy's rollback target is chosen by
                sess.log(val_loss=loss)
    code = sess.exit_code
    report.update(
        step=sess.step,
        lr=sched.get_last_lr()[0],
        rollbacks_in_process=sess.rollbacks_in_process,
        batches_skipped=loader.batches_skipped,
        save_failures=sess.save_failures,
    )
    if code == 0:
        model_sd, optim_sd = get_state_dict(
            model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            _, tensors = flatten_sharded({"model": model_sd, "optimizer": optim_sd})
            save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "final.safetensors"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if code == 0:
        dist.barrier()  # leave together (see session_child.py)
    dist.destroy_process_group()
    return code


class _Probe(ShardedTrainingState):
    """A second model restored from disk: it keeps the rank state it is given instead of applying it."""

    saved: Any = None

    def load_rank_state(self, saved: Any) -> None:
        self.saved = saved


def same_as_disk(store: Any, model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Every rank: the checkpoint of step 20 (the rollback's target) from disk into a second model equals, bit
    for bit, the state the in-process rollback just restored (from memory) into the live one."""
    rng = torch.get_rng_state()
    target = next(i.id for i in reversed(store.list()) if i.step == 20)
    live = local(ShardedTrainingState(model, opt))
    fresh, fresh_opt = build(3)
    train_step(fresh, fresh_opt, torch.randint(0, 11, (4, 3)))  # optimizer state exists
    probe = _Probe(fresh, fresh_opt)
    store.checkpoints.restore(probe, target)
    torch.set_rng_state(rng)  # the probe's build and step drew from the live stream: put it back
    return same(local(probe), live)


def main() -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    dist.init_process_group("gloo")
    mode = sys.argv[1]
    if mode == "save":
        save_mode(sys.argv[2], sys.argv[3])
        dist.barrier()
        dist.destroy_process_group()
        return 0
    if mode == "session":
        return session_mode(int(sys.argv[2]), sys.argv[3], len(sys.argv) > 4 and sys.argv[4] == "fail")
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main())
