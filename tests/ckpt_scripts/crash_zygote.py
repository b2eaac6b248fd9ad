"""Forks checkpoint-saving children on request, so a test can SIGKILL many of them without paying for a
fresh interpreter and a torch import each time.

Reads one JSON command per stdin line: {"store", "progress", "seed", "async"}. For each it forks a child
that saves checkpoints in a loop, appending "committed <id>" to `progress` after every finished commit;
it prints {"pid": ...}, waits for the child (the test kills it) and prints {"status": ...}.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.state import TrainingState


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def child(cmd: dict) -> None:
    model, opt = build(cmd["seed"])
    state = TrainingState()
    state.register("model", model)
    state.register("optimizer", opt)
    fd = os.open(cmd["progress"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, b"opening\n")
    options = CheckpointOptions(cmd["store"], keep_last=3, async_save=cmd["async"], memory_slots=1)
    with CheckpointManager(options, state) as mgr:
        os.write(fd, b"opened\n")
        latest = mgr.latest()
        step = latest.step if latest else 0
        while True:
            step += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)
            info = mgr.save(step, metrics={"loss": float(step % 7)})
            mgr.wait()
            os.write(fd, f"committed {info.id}\n".encode())


def main() -> int:
    # One intra-op thread keeps the children fork-safe; building once here pays torch's first-use costs
    # (seconds) before any fork, so a child starts saving within milliseconds.
    torch.set_num_threads(1)
    build(0)
    for line in sys.stdin:
        cmd = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(cmd)
            except BaseException as exc:  # reported through the exit status
                print(f"child failed: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": status}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
