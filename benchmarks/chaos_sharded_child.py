"""The ranks `bench chaos --sharded` kills and the processes that check what each kill left, forked from one zygote.

The zygote imports torch and the library once and forks a child per command, so that a rank costs a fork
rather than an interpreter and a torch import (2 s here). One JSON command per stdin line; one JSON answer per
command on stdout:

- `{"op": "rank", ...}` → `{"pid": ...}`: one rank of a 2-rank FSDP2 run (gloo, 127.0.0.1). It resumes from the
  latest checkpoint of the store (a restore at world 2), then trains a step, writes the gathered reference of
  that step, and saves it through `ShardedCheckpoints`, again and again. With a `kill` it SIGKILLs a rank (itself,
  or its peer) from the `phase_hook` at one phase of one save; without one, the bench kills it on a timer.
  Any error (the survivor's `RankLost` or a failed collective) is announced, and the rank exits 3 at once.
- `{"op": "check", ...}` → `{"pid": ...}`: a new process (no process group) that opens the store as a
  relaunch would, restores `latest` at world 1, and writes what it found to `out` (JSON): the id, the gathered
  state compared with references, `.tmp` and orphan blobs after the open, and `verify` of every commit.
- `{"op": "reap", "pids": [...], "timeout": s}` → `{"exits": {pid: [status, monotonic time] | null}}`.

Markers go to the pipe `marker_fd` as single writes (atomic), `<rank> <what> <step> <monotonic time> ...`:
`ready`, `train`, `gather`, `save`, `phase <name>`, `saved <cid>`, `kill <victim>`, `error <type> <message>`.

References are the full state gathered with torch's own `get_state_dict(full_state_dict=True)` and written
with safetensors (tensors) plus JSON (everything else) by rank 0 before each save: the check compares against
them, not against anything the library under test wrote.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

WORLD = 2
VOCAB = 11


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A tiny model with uneven shards (11 rows over 2 ranks) and an empty one (a 1-row weight)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 6), torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1)
    )
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[1], model[3]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    """One step on a batch that depends only on (step, rank): a resumed run repeats an uninterrupted one."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    model(torch.randint(0, VOCAB, (4,), generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _split(value: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """A nested state as JSON, each tensor replaced by its key in `tensors` (independent of the library's own)."""
    if isinstance(value, torch.Tensor):
        tensors[prefix] = value.detach().cpu().contiguous().clone()
        return {"tensor": prefix}
    if isinstance(value, dict):
        return {str(k): _split(v, f"{prefix}.{k}", tensors) for k, v in sorted(value.items(), key=str)}
    if isinstance(value, (list, tuple)):
        return [_split(v, f"{prefix}.{i}", tensors) for i, v in enumerate(value)]
    return value


def gathered(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON skeleton, tensors) of the full model and optimizer state (collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split({"model": model_sd, "optimizer": optim_sd}, "", tensors)
    return skeleton, tensors


def write_ref(path: str, skeleton: Any, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, path + ".safetensors")
    Path(path + ".json").write_text(json.dumps(skeleton, sort_keys=True))


def differences(path: str, skeleton: Any, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What differs, bit for bit, between a state and the reference at `path` (empty: identical)."""
    from safetensors.torch import load_file

    want = load_file(path + ".safetensors")
    out = [f"missing {k}" for k in sorted(want.keys() - tensors.keys())]
    out += [f"unexpected {k}" for k in sorted(tensors.keys() - want.keys())]
    out += [
        f"differs {k}"
        for k in sorted(want.keys() & tensors.keys())
        if want[k].dtype != tensors[k].dtype or not torch.equal(want[k], tensors[k])
    ]
    if json.loads(Path(path + ".json").read_text()) != json.loads(json.dumps(skeleton, sort_keys=True)):
        out.append("non-tensor state (param groups) differs")
    return out


class Markers:
    """One line per event on the bench's pipe, each a single write (atomic below PIPE_BUF)."""

    def __init__(self, fd: int, rank: int):
        self.fd, self.rank = fd, rank

    def __call__(self, what: str, step: int, *extra: object) -> None:
        words = [str(self.rank), what, str(step), f"{time.monotonic():.6f}", *map(str, extra)]
        os.write(self.fd, (" ".join(words).replace("\n", " ")[:500] + "\n").encode())


def _wait_dead(pid: int, timeout: float = 10.0) -> None:
    """Until `pid` (not our child) has exited: its pidfd turns readable."""
    fd = os.pidfd_open(pid)
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def rank_main(cmd: dict[str, Any]) -> int:
    import torch.distributed as dist

    from supervisor.checkpoint.options import parse_id
    from supervisor.checkpoint.retention import KeepLast
    from supervisor.checkpoint.sharded import ShardedCheckpoints
    from supervisor.errors import CheckpointNotFound
    from supervisor.sharded_state import ShardedTrainingState

    rank, timeout = int(cmd["rank"]), float(cmd["timeout_s"])
    mark = Markers(int(cmd["marker_fd"]), rank)
    kill = cmd.get("kill")  # {"victim": r, "phase": p, "save": k}: who dies, and where
    refs = cmd["refs"]
    step, saves = 0, 0

    def hook(phase: str, r: int) -> None:
        mark("phase", step, phase)
        if kill is None or saves != kill["save"] or phase != kill["phase"]:
            return
        victim = int(kill["victim"])
        if victim == rank:  # the victim is at this phase itself
            mark("kill", step, victim)
            os.kill(os.getpid(), signal.SIGKILL)
        elif phase in ("plan", "finish", "before_marker", "committed"):  # only rank 0 gets there
            mark("kill", step, victim)
            os.kill(pids[victim], signal.SIGKILL)
            _wait_dead(pids[victim])  # the peer is gone before this rank goes on with the phase

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{cmd['port']}",
            rank=rank,
            world_size=WORLD,
            timeout=datetime.timedelta(seconds=timeout),
        )
        pids: list[int] = [0] * WORLD
        dist.all_gather_object(pids, os.getpid())
        model, opt = build(WORLD)
        state = ShardedTrainingState(model, opt)
        with ShardedCheckpoints(
            cmd["store"], collective_timeout_s=timeout, retention=KeepLast(3), phase_hook=hook
        ) as ckpts:
            try:
                cid = ckpts.restore(state)
                step = parse_id(cid)[0]
                skeleton, tensors = gathered(model, opt)
                if rank == 0:
                    write_ref(os.path.join(refs, "resume"), skeleton, tensors)
                mark("resumed", step, cid)
            except CheckpointNotFound:
                mark("resumed", 0, "none")
            mark("ready", step)
            while saves < int(cmd["max_saves"]):
                step += 1
                mark("train", step)
                train_step(model, opt, rank, step)
                mark("gather", step)
                skeleton, tensors = gathered(model, opt)
                if rank == 0:
                    write_ref(os.path.join(refs, f"s{step}"), skeleton, tensors)
                saves += 1
                mark("save", step, saves)
                cid = ckpts.save(step, state)
                mark("saved", step, cid)
            dist.barrier()  # a peer that died in the last save fails this, not a silent exit 0
    except BaseException as exc:  # the survivor: RankLost, or a training collective that failed
        first = (str(exc).strip().splitlines() or [""])[0]
        mark("error", step, type(exc).__name__, first)
        traceback.print_exc()
        return 3
    dist.destroy_process_group()
    mark("done", step)
    return 0


def check(cmd: dict[str, Any]) -> dict[str, Any]:
    """Open the store from this new process, restore latest at world 1, compare with the candidates' references."""
    from supervisor.checkpoint.local import TMP
    from supervisor.checkpoint.options import parse_id
    from supervisor.checkpoint.sharded import ShardedCheckpoints
    from supervisor.errors import CheckpointNotFound
    from supervisor.sharded_state import ShardedTrainingState

    store = cmd["store"]
    model, opt = build(1)
    out: dict[str, Any] = {"id": None, "step": None, "error": None, "differences": {}}
    t0 = time.monotonic()
    with ShardedCheckpoints(store) as ckpts:  # opening cleans .tmp and orphans, as a relaunch's open does
        out["tmp_left"] = sorted(os.listdir(os.path.join(store, TMP)))
        out["orphan_blobs"] = sorted(set(ckpts.catalog.blob_files()) - ckpts.catalog.referenced_blobs())
        try:
            out["id"] = ckpts.restore(ShardedTrainingState(model, opt))
            out["step"] = parse_id(out["id"])[0]
        except CheckpointNotFound:
            pass
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["restore_s"] = round(time.monotonic() - t0, 4)
        # What `rollback-supervisor checkpoints verify` runs, on every remaining commit.
        out["commits"] = [i.id for i in ckpts.catalog.list()]
        out["invalid"] = {
            i: reason for i in out["commits"] if (reason := ckpts.catalog.verify(i, "full")) is not None
        }
    if out["id"] is not None and out["error"] is None:
        skeleton, tensors = gathered(model, opt)
        for name, path in cmd["refs"].items():  # the candidates' references, by role ("old", "new")
            out["differences"][name] = differences(path, skeleton, tensors)
    for name, (a, b) in cmd.get("same", {}).items():  # pairs of references that must be equal
        from safetensors.torch import load_file

        skeleton_a = json.loads(Path(a + ".json").read_text())
        out["differences"][name] = differences(b, skeleton_a, load_file(a + ".safetensors"))
    return out


def _reap(cmd: dict[str, Any]) -> dict[str, Any]:
    left = {int(p) for p in cmd["pids"]}
    exits: dict[str, Any] = {str(p): None for p in left}
    deadline = time.monotonic() + float(cmd["timeout"])
    while left and time.monotonic() < deadline:
        for pid in sorted(left):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exits[str(pid)] = [status, time.monotonic()]
                left.discard(pid)
        if left:
            time.sleep(0.005)
    return {"exits": exits}


def main() -> int:
    # One intra-op thread, and torch's and the library's imports paid here, before any fork.
    torch.set_num_threads(1)
    import importlib

    for name in ("safetensors.torch", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp"):
        importlib.import_module(name)
    import supervisor.checkpoint.retention  # noqa: F401
    import supervisor.checkpoint.sharded  # noqa: F401
    import supervisor.sharded_state  # noqa: F401

    model, opt = build(1)
    train_step(model, opt, 0, 1)  # first-use costs (Adam's state, the autograd engine)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "reap":
            print(json.dumps(_reap(cmd)), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.dup2(2, 1)  # the answers on stdout are the zygote's alone
                if cmd["op"] == "rank":
                    code = rank_main(cmd)
                else:
                    try:
                        found = check(cmd)
                    except Exception as exc:  # reported as a bad round by the bench, which goes on
                        found = {
                            "failed": f"{type(exc).__name__}: {exc}",
                            "traceback": traceback.format_exc(),
                        }
                    Path(cmd["out"]).write_text(json.dumps(found))
                    code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
