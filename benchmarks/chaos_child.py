"""The processes `bench chaos` kills and the ones that check what each kill left, forked from one zygote.

The zygote imports torch once and forks a child per command, so that a trial costs a fork rather than an
interpreter and a torch import (seconds here). One JSON command per stdin line:

- `{"op": "save", ...}`: a saver. It opens the store as a relaunched training process would, resumes from
  the latest checkpoint, and saves step after step (each save waited for) until the bench SIGKILLs it. It
  announces each phase of each save on the marker pipe: `B <phase> <step> <time>` as the phase begins (the
  system-wide monotonic clock, which the bench reads too), `E ...` as it ends. The phases are the store's own functions, wrapped here in the child (nothing in the library).
- `{"op": "verify", ...}`: a checker. It opens the store from this new process, restores the latest
  checkpoint, and compares every tensor with the state saved at that step, bit for bit; JSON to `out`.

For each command the zygote prints `{"pid": ...}`, then `{"status": ...}` once the child is gone.
The state is a pure function of the step (`expected(step)`), so any process can tell what a step held.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: phase -> the store functions (module, attribute) that are that phase, in save order. The upload runs on
#: the upload thread, beside the local retention, and ends with the remote retention.
PHASES = {
    "copy": [("supervisor.checkpoint.memory", "SnapshotRing.capture")],  # live state -> host buffers
    "checksum": [("supervisor.checkpoint.writer", "plan")],  # every tensor's xxh3-128 (dedup, restore checks)
    "write": [("supervisor.checkpoint.writer", "write_blob")],  # tensor data, its xxh3-64 hashed as written
    "commit": [("supervisor.checkpoint.local", "LocalStore.commit")],  # manifest, renames, fsyncs, marker
    "retention": [
        ("supervisor.checkpoint.pipeline", "WritePipeline.retain"),  # local deletes, blob gc
        ("supervisor.checkpoint.remote", "RemoteTier.apply_retention"),  # the same on the remote
    ],
    "upload": [("supervisor.checkpoint.remote", "RemoteTier.upload")],  # blobs, manifest, marker to S3
}
KEEP_LAST = 3


class ChaosState(torch.nn.Module):
    """Half frozen (deduplicated from the first checkpoint on), half moving: `base + step` at each step."""

    def __init__(self, nbytes: int, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        n = max(1024, nbytes // 4 // 4)  # four float32 tensors
        self.frozen_a = torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False)
        self.frozen_b = torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False)
        self.moving_a = torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False)
        self.moving_b = torch.nn.Parameter(torch.randn(n, generator=gen), requires_grad=False)
        self._base = {k: self._parameters[k].detach().clone() for k in ("moving_a", "moving_b")}

    @torch.no_grad()
    def set_step(self, step: int) -> None:
        for name, base in self._base.items():
            self._parameters[name].copy_(base).add_(float(step))


def expected(nbytes: int, step: int) -> dict[str, torch.Tensor]:
    state = ChaosState(nbytes)
    state.set_step(step)
    return {k: v.detach().clone() for k, v in state.state_dict().items()}


def _resolve(module: str, attr: str) -> tuple[Any, str]:
    owner: Any = __import__(module, fromlist=["_"])
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not callable(getattr(owner, name, None)):
        raise AttributeError(f"bench chaos: {module}.{attr} is gone; update benchmarks/chaos_child.PHASES")
    return owner, name


def announce_phases(fd: int, current: Callable[[], int]) -> None:
    """Wrap each phase's function so that it writes `B`/`E <phase> <step> <time>` to `fd` around its work."""
    for phase, (module, attr) in ((p, f) for p, fns in PHASES.items() for f in fns):
        owner, name = _resolve(module, attr)
        fn = getattr(owner, name)

        def wrapped(*args: Any, __fn: Any = fn, __phase: str = phase, **kwargs: Any) -> Any:
            os.write(fd, f"B {__phase} {current()} {time.monotonic():.6f}\n".encode())
            try:
                return __fn(*args, **kwargs)
            finally:
                os.write(fd, f"E {__phase} {current()} {time.monotonic():.6f}\n".encode())

        setattr(owner, name, functools.wraps(fn)(wrapped))


def _options(directory: str, remote: str | None) -> Any:
    from supervisor.checkpoint import CheckpointOptions

    return CheckpointOptions(directory, remote=remote, keep_last=KEEP_LAST, memory_slots=1, async_save=True)


def save(cmd: dict[str, Any]) -> None:
    """Save step after step until killed, announcing every phase on the marker pipe."""
    from supervisor.checkpoint import CheckpointManager
    from supervisor.state import TrainingState

    fd = cmd["marker_fd"]
    step = 0
    announce_phases(fd, lambda: step)
    model = ChaosState(cmd["nbytes"])
    state = TrainingState()
    state.register("model", model)
    with CheckpointManager(_options(cmd["store"], cmd.get("remote")), state) as mgr:
        latest = mgr.restore("latest") if mgr.latest() is not None else None
        step = latest.step if latest else 0
        os.write(fd, f"R {step}\n".encode())  # resumed at this step
        while True:
            step += 1
            model.set_step(step)
            mgr.save(step)
            mgr.wait()
            os.write(fd, f"D {step}\n".encode())  # done: committed (and uploaded)


def verify(cmd: dict[str, Any]) -> dict[str, Any]:
    """Check what a kill left: every committed checkpoint, then a restore of the latest, bit for bit."""
    from supervisor.checkpoint import open_store

    out: dict[str, Any] = {"views": {}}
    # Read-only first, before any writer's start-up cleanup: is any checkpoint committed half-way?
    local = open_store(cmd["store"])
    out["invalid_committed"] = [
        f"local {i.id}: {reason}" for i in local.list() if (reason := local.verify(i.id, "full")) is not None
    ]
    if cmd.get("remote"):
        remote = open_store(cmd["remote"])
        out["invalid_committed"] += [
            f"remote {i.id}: {reason}"
            for i in remote.list()
            if (reason := remote.verify(i.id, "full")) is not None
        ]
    views = {"local": cmd["store"]}
    if cmd.get("remote"):
        views["fresh_machine"] = cmd["scratch"]  # an empty local store: everything comes from the remote
    for view, directory in views.items():
        out["views"][view] = _restore_latest(directory, cmd.get("remote"), cmd["nbytes"])
        if view == "fresh_machine":
            shutil.rmtree(directory, ignore_errors=True)
    return out


def _restore_latest(directory: str, remote: str | None, nbytes: int) -> dict[str, Any]:
    from supervisor.checkpoint import CheckpointManager
    from supervisor.state import TrainingState

    model = ChaosState(nbytes, seed=12345)  # different bytes from any step's state
    state = TrainingState()
    state.register("model", model)
    t0 = time.monotonic()
    try:
        with CheckpointManager(_options(directory, remote), state) as mgr:
            if mgr.latest() is None:
                return {"step": None, "id": None, "error": None, "mismatched": []}
            info = mgr.restore("latest")
    except Exception as exc:
        return {"step": None, "id": None, "error": f"{type(exc).__name__}: {exc}", "mismatched": []}
    want = expected(nbytes, info.step)
    got = model.state_dict()
    mismatched = [
        k
        for k, v in want.items()
        if not torch.equal(got[k].reshape(-1).view(torch.uint8), v.view(torch.uint8))
    ]
    if state.step != info.step:
        mismatched.append(f"counters.step={state.step}")
    return {
        "step": info.step,
        "id": info.id,
        "error": None,
        "mismatched": mismatched,
        "restore_s": round(time.monotonic() - t0, 4),
    }


def main() -> int:
    # One intra-op thread and torch's first-use costs paid here, before any fork: children start at once and
    # fork from a process without threads.
    torch.set_num_threads(1)
    expected(1 << 16, 1)
    import supervisor.checkpoint.manager  # noqa: F401  (imported once, before the forks)

    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                if cmd["op"] == "save":
                    save(cmd)
                else:
                    result = verify(cmd)
                    Path(cmd["out"]).write_text(json.dumps(result))
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
