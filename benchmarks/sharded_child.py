"""A torchrun child of `bench checkpoint --sharded`: FSDP2 (fully_shard) + AdamW, every rank measuring its part.

Usage: sharded_child.py measure|relaunch CONFIG_JSON
- measure: build, train a few steps, then `reps` rounds of every measurement (our save, restore and in-process
  rollback against dcp.save, dcp.async_save, dcp.load and a memcpy floor); each rank writes OUT/rank<r>.json.
- relaunch: what a relaunch does until it can train: imports, process group, model, restore of the latest
  commit from our store; each rank writes OUT/relaunch-<n>.rank<r>.json with its clock readings
  (time.monotonic, one clock for every process of the machine, so the parent can subtract its exec time).
"""

from __future__ import annotations

import time

T_START = time.monotonic()  # before the heavy imports: a relaunch pays for them

import datetime  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import xxhash  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from supervisor.checkpoint.retention import KeepLast  # noqa: E402
from supervisor.checkpoint.sharded import ShardedCheckpoints  # noqa: E402
from supervisor.sharded_state import ShardedTrainingState  # noqa: E402

T_IMPORTED = time.monotonic()
BATCH = 4
#: Bounded collectives: a lost peer fails the benchmark instead of hanging it.
TIMEOUT = datetime.timedelta(seconds=600)


def width_for(params: int) -> int:
    """The layer width `benchmarks.checkpoint.build` uses for this size (the same model shapes)."""
    return 2048 if params >= 50_000_000 else 1024 if params >= 5_000_000 else 256


def build(params: int, device: str, *, meta: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of square Linear layers of about `params` parameters, each layer and the root `fully_shard`ed.

    `meta`: built on the meta device and only then given (uninitialized) memory for this rank's shards, as a
    large job does when a checkpoint will overwrite every value: the relaunch pays no full-model init."""
    width = width_for(params)
    layers = max(1, round(params / (width * width + width)))
    torch.manual_seed(0)  # every rank builds the same full model, and fully_shard keeps its own rows
    with torch.device("meta" if meta else device):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    if meta:
        model.to_empty(device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def forward_backward(model: torch.nn.Module, width: int, device: str, gen: torch.Generator) -> None:
    x = torch.randn(BATCH, width, generator=gen).to(device)
    model(x).pow(2).mean().backward()


def local_tensors(state: ShardedTrainingState) -> dict[str, torch.Tensor]:
    """This rank's own shards of every state tensor (what it must save and restore)."""
    _, flat = state.snapshot()
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in flat.items()}


def digest(state: ShardedTrainingState) -> str:
    """xxh3 over this rank's shard bytes, by name: a relaunch's restore must give exactly these back."""
    h = xxhash.xxh3_64()
    for name, t in sorted(local_tensors(state).items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Stamp:
    """The time a future's done-callback ran; wait() until it has (result() may return before callbacks run)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.at = 0.0

    def set(self, _future: Any) -> None:
        self.at = time.perf_counter()
        self._event.set()

    def wait(self) -> float:
        if not self._event.wait(TIMEOUT.total_seconds()):
            raise TimeoutError("dcp.async_save's staging never completed")
        return self.at


class DiskFallbacks(logging.Handler):
    """Counts `restore_memory` calls that went to disk instead (it logs why): the JSON must not call a disk
    restore an in-memory one."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "from disk, not memory" in record.getMessage():
            self.count += 1


class Clock:
    """Per-rank timings of collective operations: every rank starts together (a barrier), device work is
    synchronized before the clock stops."""

    def __init__(self, group: Any, cuda: bool):
        self.group, self.cuda = group, cuda
        self.times: dict[str, list[float]] = defaultdict(list)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self) -> float:
        dist.barrier(group=self.group)
        self.sync()
        return time.perf_counter()

    def stop(self, key: str, t0: float) -> float:
        self.sync()
        dt = time.perf_counter() - t0
        self.times[key].append(dt)
        return dt

    def timed(self, key: str, fn: Callable[[], Any]) -> Any:
        t0 = self.start()
        result = fn()
        self.stop(key, t0)
        return result


def init(device: str) -> tuple[int, int]:
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        # nccl trains; gloo carries the checkpoint groups' CPU collectives (DCP's planning, our commit)
        dist.init_process_group("cpu:gloo,cuda:nccl", timeout=TIMEOUT)
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def api(ckpts: ShardedCheckpoints) -> dict[str, bool]:
    """Which of ShardedCheckpoints' paths exist in this checkout (the async save and the memory ring are
    optional): the JSON says which one was measured."""
    return {
        "async_save": "blocking" in inspect.signature(ckpts.save).parameters and hasattr(ckpts, "wait"),
        "restore_memory": hasattr(ckpts, "restore_memory"),
        "overlap": "overlap" in inspect.signature(ckpts.save).parameters,
    }


def measure(cfg: dict[str, Any]) -> None:
    rank, world = init(cfg["device"])
    cuda = cfg["device"] == "cuda"
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    ours_group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    dcp_group = dist.new_group(backend="gloo", timeout=TIMEOUT)  # DCP's own, as torchtitan and FACTS advise
    clock = Clock(dist.new_group(backend="gloo", timeout=TIMEOUT), cuda)
    work = Path(cfg["workdir"])
    model, opt = build(cfg["params"], device)
    width = width_for(cfg["params"])
    gen = torch.Generator().manual_seed(1 + rank)
    state = ShardedTrainingState(model, opt)

    def train_step(timed: bool = True) -> None:
        t0 = clock.start()
        forward_backward(model, width, device, gen)
        if timed:
            clock.stop("fwd_bwd_s", t0)
        opt.step()
        opt.zero_grad()

    for _ in range(2):  # optimizer state exists, as in a run
        train_step()
    clock.times.clear()
    local = local_tensors(state)
    local_bytes = sum(t.numel() * t.element_size() for t in local.values())
    src = torch.ones(local_bytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(local_bytes, dtype=torch.uint8, pin_memory=cuda)

    phases: dict[str, float] = {}

    def hook(phase: str, _rank: int) -> None:
        """Called on whichever thread writes (a background one for an async save)."""
        phases[phase] = time.perf_counter()

    written: list[int] = []
    write_s: list[float] = []
    kwargs: dict[str, Any] = {}
    if "control_group" in inspect.signature(ShardedCheckpoints).parameters:
        # a group only the training thread uses, as the Session passes: restore_memory agrees on it
        kwargs["control_group"] = dist.new_group(backend="gloo", timeout=TIMEOUT)
    ckpts = ShardedCheckpoints(
        work / "store", process_group=ours_group, retention=KeepLast(2), phase_hook=hook, **kwargs
    )
    paths = api(ckpts)
    fallbacks = DiskFallbacks()
    ckpt_log = logging.getLogger("rollback_supervisor.checkpoint")
    ckpt_log.setLevel(logging.INFO)  # the fallback is logged at INFO (nothing prints it: no handler but ours)
    ckpt_log.addHandler(fallbacks)

    def save(step: int, overlapped: bool = False) -> str:
        """Our save: the training thread's blocked time, then the time until every rank's files are
        committed; both clocks start at the call. An async save's write runs beside the next forward and
        backward, as in training (timed: what the background write costs the training thread)."""
        t0 = clock.start()
        if overlapped:
            # The copy of parameters and optimizer state runs beside the next forward and backward; the
            # optimizer's step would wait for it: charged here as DCP's DefaultStager's wait is.
            cid = ckpts.save(step, state, blocking=False, overlap=True)
            returned = clock.stop("ours_overlap_return_s", t0)
            t1 = time.perf_counter()
            forward_backward(model, width, device, gen)
            clock.stop("ours_overlap_fwd_bwd_s", t1)
            clock.times["blocking_save_overlap_s"].append(returned + ckpts.wait_capture())
            opt.zero_grad()  # for the measurement only: the state is unchanged
            ckpts.wait()
            clock.stop("save_total_overlap_s", t0)
            return cid
        elif paths["async_save"]:
            cid = ckpts.save(step, state, blocking=False)
            clock.stop("blocking_save_copy_s", t0)
            t1 = time.perf_counter()
            forward_backward(model, width, device, gen)
            clock.stop("ours_overlapped_fwd_bwd_s", t1)
            opt.zero_grad()  # for the measurement only: the state is unchanged
            ckpts.wait()
        else:
            cid = ckpts.save(step, state)
            clock.stop("blocking_save_s", t0)
        clock.stop("save_total_s", t0)
        if not isinstance(cid, str):  # an async save may hand back its id only once committed
            latest = ckpts.catalog.latest("none")
            assert latest is not None, "our save committed nothing"
            cid = latest.id
        return cid

    # Warm-up, untimed, as the first saves of a run: they allocate the reused host buffers (every slot of our
    # ring, and DCP's stager).
    for _ in range(len(getattr(ckpts, "ring", ())) or 1):
        cid = save(0)
    async_stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
    )
    dcp.async_save(
        state.state_dicts(),
        storage_writer=FileSystemWriter(str(work / "dcp-warm")),
        process_group=dcp_group,
        async_stager=async_stager,
    ).upload_completion.result()
    clock.times.clear()
    dist.barrier(group=clock.group)
    if rank == 0:
        shutil.rmtree(work / "dcp-warm")

    for rep in range(1, cfg["reps"] + 1):
        train_step()  # new bytes in every tensor, so dedup has nothing to skip
        clock.timed("memcpy_s", lambda: dst.copy_(src))
        if paths[
            "overlap"
        ]:  # the overlapped save first: the plain one below is the latest, which a relaunch restores
            save(rep, overlapped=True)
            train_step(timed=False)
        phases.clear()
        cid = save(rep)
        write_s.append(phases["after_blob"] - phases["write_start"])
        manifest = ckpts.catalog.manifest(cid)
        mine = f"blobs/{cid}.r{rank}"
        written.append(sum(f.size for f in manifest.files if f.path.startswith(mine)))

        sd = state.state_dicts()
        fresh = work / f"dcp-{rep}"
        clock.timed(
            "dcp_save_s",
            lambda: dcp.save(sd, storage_writer=FileSystemWriter(str(fresh)), process_group=dcp_group),  # noqa: B023
        )
        # dcp.async_save out of the box: the FileSystemWriter stages (a blocking copy), then writes on a thread.
        t0 = clock.start()
        future = dcp.async_save(
            sd, storage_writer=FileSystemWriter(str(work / f"dcp-async-{rep}")), process_group=dcp_group
        )
        clock.stop("dcp_async_save_writer_stager_s", t0)
        future.result()
        clock.stop("dcp_async_save_writer_stager_total_s", t0)
        # torchtitan's way: a reused DefaultStager stages on its own thread; the training thread goes on with
        # the next forward and backward, and must wait for the staging before the next optimizer step.
        t0 = clock.start()
        response = dcp.async_save(
            sd,
            storage_writer=FileSystemWriter(str(work / f"dcp-async2-{rep}")),
            process_group=dcp_group,
            async_stager=async_stager,
        )
        returned = clock.stop("dcp_async_save_default_stager_return_s", t0)
        staged = Stamp()  # when the staging thread finished (at once if it already had)
        response.staging_completion.add_done_callback(staged.set)
        t1 = time.perf_counter()
        forward_backward(model, width, device, gen)
        clock.stop("dcp_async_overlapped_fwd_bwd_s", t1)
        t2 = time.perf_counter()
        response.staging_completion.result()
        clock.times["dcp_async_save_default_stager_s"].append(returned + time.perf_counter() - t2)
        clock.times["dcp_async_save_default_stager_staging_s"].append(staged.wait() - t0)
        response.upload_completion.result()
        clock.stop("dcp_async_save_default_stager_total_s", t0)
        opt.zero_grad()  # the overlapped backward was for the measurement only: the state is unchanged

        def dcp_load() -> None:
            loaded = state.state_dicts()
            dcp.load(loaded, checkpoint_id=str(fresh), process_group=dcp_group)  # noqa: B023
            state.load(loaded)

        clock.timed("dcp_load_s", dcp_load)
        clock.timed("restore_disk_s", lambda: ckpts.restore(state, cid))  # noqa: B023
        if paths["restore_memory"]:
            clock.timed("in_process_rollback_s", lambda: ckpts.restore_memory(state, cid))  # noqa: B023
        else:
            clock.timed("in_process_rollback_s", lambda: ckpts.restore(state, cid))  # noqa: B023
        dist.barrier(group=clock.group)
        if rank == 0:
            for name in (f"dcp-{rep}", f"dcp-async-{rep}", f"dcp-async2-{rep}"):
                shutil.rmtree(work / name)
    async_stager.close()
    report = {
        "rank": rank,
        "world_size": world,
        "device": device,
        "local_state_bytes": local_bytes,
        "params_local": sum(p.to_local().numel() for p in model.parameters()),
        "times": dict(clock.times),
        "bytes_written": written,
        "write_s": write_s,
        "paths": paths,
        "verify": ckpts.verify,
        "in_process_from_disk": fallbacks.count,
        "last_checkpoint": cid,
        "digest": digest(state),  # the state of `cid` (just rolled back to): what a relaunch must restore
    }
    ckpts.close()
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def relaunch(cfg: dict[str, Any]) -> None:
    """From exec to ready-to-train after a relaunch: restore the latest commit into a freshly built model."""
    rank, _ = init(cfg["device"])
    t_pg = time.monotonic()
    cuda = cfg["device"] == "cuda"
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    group = dist.new_group(backend="gloo", timeout=TIMEOUT)
    model, opt = build(cfg["params"], device, meta=True)
    state = ShardedTrainingState(model, opt)
    state.snapshot()  # get_state_dict creates the AdamW state the restore fills in, as a relaunch must
    t_built = time.monotonic()
    with ShardedCheckpoints(Path(cfg["workdir"]) / "store", process_group=group) as ckpts:
        cid = ckpts.restore(state)
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)
    t_ready = time.monotonic()
    report = {
        "rank": rank,
        "checkpoint": cid,
        "t_start": T_START,
        "t_imported": T_IMPORTED,
        "t_process_group": t_pg,
        "t_built": t_built,
        "t_ready": t_ready,
        "digest": digest(state),
    }
    Path(cfg["out"], f"relaunch-{cfg['attempt']}.rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, config = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    {"measure": measure, "relaunch": relaunch}[mode](config)
