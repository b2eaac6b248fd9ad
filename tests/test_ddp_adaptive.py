"""Under DDP an adaptive cadence does not block on rank 0's write in flight: every rank agrees to save after it.

Two real processes (torch.multiprocessing, gloo on 127.0.0.1), a real Session and store on each; rank 0's
first commit is held by a gate (its metrics are "not yet sent"), as in tests/test_session_saves.py.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = [pytest.mark.slow]
STEPS = 40


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, workdir: str) -> None:
    from supervisor.checkpoint import open_store
    from supervisor.runtime import Session
    from tests.test_session_saves import GatedMetrics, _policy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        work = Path(workdir)
        sess = Session.attach(workdir=work / "run", policy=_policy(work, adaptive=True, every_steps=2))
        gates = None
        if rank == 0:
            sess._metrics = gates = GatedMetrics()
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sess.register(model=model, optimizer=opt)
        batches = [torch.randn(4, 8) for _ in range(STEPS)]
        in_flight: list[int] = []
        committed: list[int] | None = None
        try:
            for step, x in sess.loop(batches, max_steps=STEPS):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
                if gates is not None:
                    if gates.gates and not gates.gates[0].is_set():
                        in_flight.append(step)
                    if step == 29:
                        committed = [i.step for i in open_store(sess.plan.checkpoint_dir).list()]
                    if step == 30:
                        gates.gates[0].set()
        finally:
            if gates is not None:
                gates.open_all()
            sess.close()
        (work / f"rank{rank}.json").write_text(
            json.dumps({"in_flight": in_flight, "step": sess.step, "committed_at_29": committed})
        )
    finally:
        dist.destroy_process_group()


def test_every_rank_trains_on_while_rank_0_writes_under_an_adaptive_cadence(tmp_path: Path):
    (tmp_path / "policy.yaml").parent.mkdir(exist_ok=True)
    mp.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0["step"] == rank1["step"] == STEPS
    # The first write waited for its gate until step 30, and both ranks trained on meanwhile. With the old
    # agreement rank 0 blocked on that write at its next due save, so every rank stopped until the commit's
    # bounded wait for its metrics (10 s) gave up and committed it: by step 29 it was committed.
    assert rank0["committed_at_29"] == [], rank0
    assert rank0["in_flight"][-1] == 30 and len(rank0["in_flight"]) >= 25, rank0["in_flight"]
