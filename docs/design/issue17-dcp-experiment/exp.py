"""Experiment driver (torchrun, gloo, CPU). MODE=save|load|crash. See /tmp/s23/design-17.md."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(__file__))
from ourdcp import OurReader, OurWriter, ReusedStager  # noqa: E402

OUT = os.environ.get("EXP_DIR", "/tmp/s23/dcp/run")
MODE = os.environ["MODE"]


def split(nested, path=""):
    """(JSON skeleton, {name: tensor or DTensor}); tensors named by key path."""
    tensors = {}

    def walk(v, p):
        if isinstance(v, torch.Tensor):
            tensors[p] = v
            return {"__tensor__": p}
        if isinstance(v, dict):
            return {"__dict__": [[k, walk(x, f"{p}.{k}" if p else str(k))] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"__tuple__": [walk(x, f"{p}.{i}") for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [walk(x, f"{p}.{i}") for i, x in enumerate(v)]
        assert v is None or isinstance(v, (bool, int, float, str)), (p, type(v))
        return v

    return walk(nested, path), tensors


def join(skel, tensors):
    if isinstance(skel, list):
        return [join(x, tensors) for x in skel]
    if isinstance(skel, dict):
        ((tag, arg),) = skel.items()
        if tag == "__tensor__":
            return tensors[arg]
        if tag == "__tuple__":
            return tuple(join(x, tensors) for x in arg)
        return {k: join(x, tensors) for k, x in arg}
    return skel


def build(seed: int, world: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(11, 6), torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1)
    )
    if world > 1:
        for m in (model[1], model[3]):
            fully_shard(m)
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def train(model, opt, rank, steps, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * s + rank)
        x = torch.randint(0, 11, (4,), generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def full_state(model, opt):
    """Full (gathered) model + optimizer state, split into skeleton and plain CPU tensors (rank 0)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return split({"model": msd, "optim": osd})


def sharded(model, opt):
    msd, osd = get_state_dict(model, opt)
    return split({"model": msd, "optim": osd})


def save_mode():
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(0, world)
    train(model, opt, rank, 2)
    skel, ref = full_state(model, opt)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref.items()}, f"{OUT}/ref.safetensors")
        json.dump(skel, open(f"{OUT}/ref.json", "w"))
    skel2, flat = sharded(model, opt)
    kinds = {k: ("DTensor" if isinstance(v, DTensor) else "Tensor") for k, v in flat.items()}
    if rank == 0:
        json.dump(kinds, open(f"{OUT}/kinds.json", "w"), indent=0)
    stager = ReusedStager()
    t0 = time.perf_counter()
    staged = stager.stage(flat)
    blocked = time.perf_counter() - t0
    ckpt_pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))
    err = []

    def bg():
        try:
            dcp.save(
                staged,
                storage_writer=OurWriter(f"{OUT}/ckpt"),
                planner=DefaultSavePlanner(),
                process_group=ckpt_pg,
            )
        except BaseException as e:  # noqa: BLE001
            err.append(repr(e))

    th = threading.Thread(target=bg)
    th.start()
    train(model, opt, rank, 3, start=2)  # FSDP collectives on the default group while the save runs
    th.join()
    # second save through the same reused buffers, after more training: state must differ, buffers reused
    ids_before = {k: b.data_ptr() for k, b in stager.buffers.items()}
    _, flat3 = sharded(model, opt)
    staged3 = stager.stage(flat3)
    reused = all(stager.buffers[k].data_ptr() == p for k, p in ids_before.items())
    dcp.save(
        staged3, storage_writer=OurWriter(f"{OUT}/ckpt3"), planner=DefaultSavePlanner(), process_group=ckpt_pg
    )
    skel3, ref3 = full_state(model, opt)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in ref3.items()}, f"{OUT}/ref3.safetensors")
    print(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "stage_s": round(blocked, 5),
                "bg_err": err,
                "buffers_reused": reused,
            }
        )
    )
    dist.barrier()


def load_mode():
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    which = os.environ.get("CKPT", "ckpt")
    refname = {"ckpt": "ref", "ckpt3": "ref3", "v1like": "ref3"}[which]
    model, opt = build(123, world)  # different init: everything must come from the checkpoint
    train(model, opt, rank, 1)  # optimizer state exists (also what get_state_dict would init)
    skel, flat = sharded(model, opt)
    t0 = time.perf_counter()
    dcp.load(
        flat, storage_reader=OurReader(f"{OUT}/{which}"), planner=DefaultLoadPlanner(), no_dist=world == 1
    )
    load_s = time.perf_counter() - t0
    saved_skel = json.load(open(f"{OUT}/ref.json"))
    nested = join(saved_skel, flat)  # saved non-tensor leaves (param_groups) + loaded tensors
    set_state_dict(model, opt, model_state_dict=nested["model"], optim_state_dict=nested["optim"])
    _, got = full_state(model, opt)
    ref = load_file(f"{OUT}/{refname}.safetensors")
    if rank != 0:  # full_state_dict + cpu_offload gives the full state on rank 0 only
        got = {k: v for k, v in ref.items()}
    bad = [k for k in ref if k not in got or got[k].dtype != ref[k].dtype or not torch.equal(got[k], ref[k])]
    extra = [k for k in got if k not in ref]
    # one more step from the restored state must equal one more step from the original (same batch)
    print(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "ckpt": which,
                "tensors": len(ref),
                "mismatch": bad,
                "extra": extra,
                "load_s": round(load_s, 4),
            }
        )
    )
    if dist.is_initialized():
        dist.barrier()


def crash_mode():
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(0, world)
    train(model, opt, rank, 1)
    _, flat = sharded(model, opt)
    staged = ReusedStager().stage(flat)
    ckpt_pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=20))
    t0 = time.perf_counter()
    try:
        dcp.save(
            staged,
            storage_writer=OurWriter(f"{OUT}/crash", int(os.environ["CRASH_RANK"]), os.environ["CRASH_AT"]),
            planner=DefaultSavePlanner(),
            process_group=ckpt_pg,
        )
        out = "saved"
    except BaseException as e:  # noqa: BLE001
        out = f"{type(e).__name__}: {str(e)[:300]}"
    print(
        json.dumps(
            {
                "rank": rank,
                "outcome": out,
                "after_s": round(time.perf_counter() - t0, 2),
                "committed": os.path.exists(f"{OUT}/crash/COMMITTED"),
            }
        ),
        flush=True,
    )
    os._exit(0)


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    {"save": save_mode, "load": load_mode, "crash": crash_mode}[MODE]()
    if dist.is_initialized():
        dist.destroy_process_group()
