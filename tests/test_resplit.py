"""Restore at another world size (issue 17, item 2): the data position re-split (`resplit`, pure, and through
real `ResumableLoader`s), the RNG streams re-derived (`rederive`), and one end-to-end run under torchrun
(FSDP2 through the Session, gloo): 2 ranks read half an epoch and save, 1 rank finishes it, twice identically,
then 2 ranks finish the epoch the 1-rank run had begun."""

from __future__ import annotations

import copy
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import IterableDataset, SubsetRandomSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.data import (
    EpochPosition,
    LoaderError,
    ResumableLoader,
    epoch_position,
    resplit,
)
from supervisor.errors import UserError
from supervisor.rng import rederive
from supervisor.sharded_state import SessionShardedState
from supervisor.state import TrainingState

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own noise

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "resplit_child.py"


# -- resplit, pure ---------------------------------------------------------------------------------------


@st.composite
def positions(draw: Any) -> list[EpochPosition]:
    """Old ranks' epochs: disjoint orders of (possibly different) lengths, each read up to some point."""
    world = draw(st.integers(1, 6))
    pool = iter(draw(st.permutations(range(60))))
    result = []
    for _ in range(world):
        order = tuple(next(pool) for _ in range(draw(st.integers(0, 60 // world))))
        result.append(EpochPosition(order, draw(st.integers(0, len(order)))))
    return result


@settings(max_examples=300, deadline=None)
@given(positions(), st.integers(1, 7))
def test_resplit_gives_every_unseen_sample_to_exactly_one_new_rank(old: list[EpochPosition], new_world: int):
    shares = [resplit(old, r, new_world) for r in range(new_world)]
    unseen = [i for p in old for i in p.unseen]
    handed = [i for share in shares for i in share]
    assert sorted(handed) == sorted(unseen) and len(set(handed)) == len(handed)
    seen = [i for p in old for i in p.order[: p.seen]]
    assert sorted(seen + handed) == sorted(i for p in old for i in p.order)  # the epoch, exactly
    sizes = [len(s) for s in shares]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= (1 if new_world > 1 else 0)
    assert sizes.count(sizes[0]) == (len(unseen) % new_world or new_world)  # the first R mod W' get one more
    assert shares == [resplit(copy.deepcopy(old), r, new_world) for r in range(new_world)]  # deterministic


def test_resplit_interleaves_the_old_ranks_remainders_in_a_fixed_order():
    old = [EpochPosition((10, 11, 12, 13), 1), EpochPosition((20, 21, 22, 23), 2)]
    assert resplit(old, 0, 1) == [11, 22, 12, 23, 13]
    assert (resplit(old, 0, 2), resplit(old, 1, 2)) == ([11, 12, 13], [22, 23])


@pytest.mark.parametrize("bad", [(-1, 2), (2, 2), (0, 0), (0.0, 1)])
def test_resplit_refuses_a_rank_outside_the_world(bad):
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        resplit([], *bad)


# -- through real loaders ----------------------------------------------------------------------------------


def loader(
    rank: int, world: int, length: int, *, shuffle: bool = True, batch: int = 3, **kw: Any
) -> ResumableLoader:
    return ResumableLoader(
        torch.arange(length), batch_size=batch, shuffle=shuffle, seed=11, rank=rank, world_size=world, **kw
    )


def read(it_loader: ResumableLoader, batches: int) -> list[int]:
    """Read `batches` batches of the current epoch the way a training loop does (break mid-epoch)."""
    got: list[int] = []
    for n, b in enumerate(it_loader, 1):
        got += b.tolist()
        if n == batches:
            break
    return got


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(4, 41),  # every shard non-empty (torch cannot shuffle an empty one)
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.floats(0, 1),
    st.integers(0, 3),
)
def test_a_half_read_epoch_finishes_at_another_world_size_without_a_skip_or_a_repeat(
    world, new_world, length, batch, shuffle, drop_last, fraction, k_mid
):
    def make(rank: int, w: int) -> ResumableLoader:
        return loader(rank, w, length, shuffle=shuffle, batch=batch, drop_last=drop_last)

    old = [make(r, world) for r in range(world)]
    k = round(fraction * len(old[0]))  # batches read, the same on every rank (lock-step)
    seen_by = [read(ld, k) if k else [] for ld in old]
    states = [copy.deepcopy(ld.state_dict()) for ld in old]
    for r, state in enumerate(states):  # epoch_position rebuilds what each rank read, in order
        pos = epoch_position(state, r, world, length)
        assert list(pos.order[: pos.seen]) == (seen_by[r] if k else [])
    seen = [i for s in seen_by for i in s]

    new = [make(r, new_world) for r in range(new_world)]
    shares = [ld.resume_resplit(states, world, seed=5 + r)[0] for r, ld in enumerate(new)]
    rest: list[int] = []
    for r, ld in enumerate(new):
        if not shares[r]:  # no re-split epoch: its next epoch is an ordinary one (checked below)
            continue
        got = [i for b in ld for i in b.tolist()] if not (r == 0 and k_mid) else []
        if r == 0 and k_mid:  # a save and restore inside the re-split epoch changes nothing
            got = read(ld, min(k_mid, -(-len(shares[0]) // batch)))  # within the re-split epoch
            new[0] = again = make(0, new_world)
            again.load_state_dict(copy.deepcopy(ld.state_dict()))
            got += [i for b in again for i in b.tolist()]
        assert got == shares[r]  # read in order, every sample of its share, the last batch maybe short
        rest += got
    assert len(rest) == len(set(rest)) and not set(rest) & set(seen)
    if k == 0:  # nothing of the epoch read: an ordinary epoch at the new world size
        assert rest == []
    else:  # with drop_last, what the old ranks would have dropped at the end is read too, never lost
        assert set(rest) | set(seen) == set(range(length - length % world))

    # from the next epoch on: each new rank its own shard at W', its generator seeded from the re-derived seed
    for r, ld in enumerate(new):
        expected = make(r, new_world)
        expected.generator.manual_seed(5 + r)
        assert [b.tolist() for b in ld] == [b.tolist() for b in expected]


@pytest.mark.parametrize("workers", [0, 2])
def test_epoch_position_reads_the_order_and_position_with_or_without_worker_processes(workers):
    old = [loader(r, 2, 30, num_workers=workers) for r in range(2)]
    seen_by = [read(ld, 2) for ld in old]
    for r, ld in enumerate(old):
        pos = epoch_position(copy.deepcopy(ld.state_dict()), r, 2, 30)
        assert list(pos.order[: pos.seen]) == seen_by[r] and len(pos.order) == 15
        assert sorted(pos.order) == list(range(r, 30, 2))
    new = loader(0, 1, 30, num_workers=workers)
    share, unseen = new.resume_resplit([ld.state_dict() for ld in old], 2, seed=1)
    assert unseen == 18 and sorted(share + seen_by[0] + seen_by[1]) == list(range(30))
    assert [i for b in new for i in b.tolist()] == share


def test_a_resplit_epoch_resplits_again_and_a_later_epoch_is_ordinary():
    """2 -> 3 mid-epoch, then 3 -> 2 in the middle of the re-split epoch: still the epoch exactly once."""
    length = 40
    old = [loader(r, 2, length) for r in range(2)]
    seen = [i for ld in old for i in read(ld, 2)]
    mid = [loader(r, 3, length) for r in range(3)]
    for r, ld in enumerate(mid):
        ld.resume_resplit([ld0.state_dict() for ld0 in old], 2, seed=r)
        seen += read(ld, 1)
    last = [loader(r, 2, length) for r in range(2)]
    for r, ld in enumerate(last):
        share, unseen = ld.resume_resplit([m.state_dict() for m in mid], 3, seed=r)
        assert unseen == length - len(seen)
    rest = [i for ld in last for b in ld for i in b.tolist()]
    assert sorted(seen + rest) == list(range(length))


class Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(5))


def test_a_loader_the_session_cannot_resplit_is_a_typed_error_naming_why():
    custom = ResumableLoader(torch.arange(10), batch_size=2, sampler=SubsetRandomSampler(range(10)))
    with pytest.raises(LoaderError, match="sampler") as caught:
        custom.resume_resplit([loader(0, 1, 10).state_dict()], 1, seed=0)
    assert isinstance(caught.value, UserError)
    stream = ResumableLoader(Stream(), batch_size=2)
    with pytest.raises(LoaderError, match="IterableDataset"):
        stream.resume_resplit([stream.state_dict()], 2, seed=0)
    other_size = loader(0, 1, 12)
    with pytest.raises(LoaderError, match="dataset of 10 samples, this one has 12"):
        other_size.resume_resplit([loader(0, 1, 10).state_dict()], 1, seed=0)


# -- rederive and the sharded state's hook, in one process --------------------------------------------------


def test_rederive_is_deterministic_and_distinct_per_rank_world_step_and_stream():
    seeds = {
        (w, r, step, stream): rederive(7, step, r, w, stream)
        for w in (1, 2, 3, 4)
        for r in range(w)
        for step in (0, 100)
        for stream in ("rng", "data")
    }
    assert len(set(seeds.values())) == len(seeds)
    assert all(rederive(7, s, r, w, stream) == v for (w, r, s, stream), v in seeds.items())
    assert rederive(8, 0, 0, 1) != rederive(7, 0, 0, 1)
    assert all(0 <= v < 2**64 for v in seeds.values())
    with pytest.raises(ValueError, match="rank"):
        rederive(7, 0, 2, 2)


def draws() -> list[Any]:
    return [random.random(), float(np.random.rand()), torch.rand(3).tolist()]


def session_state(rank: int, world: int, data: Any = None, seed: int | None = 3) -> SessionShardedState:
    state = TrainingState()
    state.register("model", torch.nn.Linear(2, 2))
    state.register("data", data if data is not None else loader(rank, world, 30))
    if seed is not None:
        state.extras["seed"] = seed
    return SessionShardedState(state, "model", ["data"])


def saved_at(world: int, batches: int) -> list[Any]:
    """What `world` ranks' `rank_state()` gave after each read `batches` batches (in one process)."""
    saved = []
    for r in range(world):
        old = session_state(r, world)
        old.state.samples_seen = 3 * batches
        read(old.state["data"], batches)
        torch.manual_seed(100 + r)  # each rank's own stream
        saved.append(json.loads(json.dumps(old.rank_state())))
    return saved


@pytest.mark.parametrize("seed", [3, None])
def test_restores_of_one_checkpoint_at_one_world_size_draw_the_same_and_ranks_differ(seed, caplog):
    saved = saved_at(2, 2)
    results = []
    for _ in range(2):
        ranks = []
        for r in range(3):
            new = session_state(r, 3, seed=seed)
            with caplog.at_level("WARNING", logger="rollback_supervisor.checkpoint"):
                new.load_rank_states_resharded(saved, 2, r, 3, 40)
            ranks.append((draws(), [b.tolist() for b in new.state["data"]], new.state.samples_seen))
        results.append(ranks)
    assert results[0] == results[1]
    assert len({json.dumps(d) for d, _, _ in results[0]}) == 3
    assert sum(n for _, _, n in results[0]) == 2 * 6  # samples_seen: the sum over ranks is unchanged
    lines = [
        r.getMessage() for r in caplog.records if "saved by 2 ranks and is restored on 3" in r.getMessage()
    ]
    assert len(lines) == 2  # one line per restore (rank 0's)
    assert ('extras["seed"]' in lines[0]) == (
        seed is not None
    ) and "'data': the 18 samples of the epoch not yet read are shared out, 6 per rank" in lines[0]
    other_step = session_state(0, 3, seed=seed)
    other_step.load_rank_states_resharded(saved, 2, 0, 3, 41)
    assert draws() != results[0][0][0]


def test_at_the_same_world_size_each_rank_gets_its_own_samples_seen_back():
    saved = saved_at(2, 3)
    again = session_state(1, 2)
    again.load_rank_state(saved[1])
    assert again.state.samples_seen == 9 and again.state["data"].state_dict()["loader"]["_num_yielded"] == 3


def test_a_data_part_that_is_not_a_resumable_loader_is_a_typed_error_naming_it():
    plain = StatefulDataLoader(torch.arange(30), batch_size=3)
    saved = [
        session_state(r, 2, data=StatefulDataLoader(torch.arange(30), batch_size=3)).rank_state()
        for r in (0, 1)
    ]
    with pytest.raises(LoaderError, match="data part 'data' .*saved by 2 ranks and is restored on 1"):
        session_state(0, 1, data=plain).load_rank_states_resharded(saved, 2, 0, 1, 5)


# -- end to end: torchrun, gloo, FSDP2 through the Session --------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, phase: str, work: Path, out: Path, steps: int, checkpoint_id: str = "") -> float:
    """Run the child under torchrun (gloo, CPU); returns its wall time."""
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("ROLLBACK_SUPERVISOR_PLAN", None)
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}", str(CHILD), phase, str(work), str(out), str(steps), checkpoint_id,
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    (out / "log.txt").write_text(done.stdout + done.stderr)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return time.monotonic() - t0


def ranks(out: Path, nproc: int) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def in_epoch(report: dict[str, Any], epoch: int) -> list[int]:
    return [i for i, e in zip(report["indices"], report["epochs"], strict=True) if e == epoch]


@pytest.mark.e2e
@pytest.mark.slow
def test_two_ranks_save_mid_epoch_one_rank_finishes_it_twice_identically_then_two_finish_its_next(tmp_path):
    work = tmp_path / "work"
    # 2 ranks read 3 batches of 4 of their 25 and save: 24 of the 50 read
    times = [torchrun(2, "save", work, tmp_path / "a", 3)]
    a = ranks(tmp_path / "a", 2)
    epoch = list(range(a[0]["length"]))
    seen_at_2 = in_epoch(a[0], 0) + in_epoch(a[1], 0)
    assert len(seen_at_2) == 24 == len(set(seen_at_2))

    # 1 rank: the 26 unseen in 7 batches (the last one short), then 2 batches of its own next epoch; twice
    times += [torchrun(1, "finish", work, tmp_path / run, 9, a[0]["final_checkpoint"]) for run in ("b", "c")]
    (b,), (c,) = ranks(tmp_path / "b", 1), ranks(tmp_path / "c", 1)
    rest = in_epoch(b, 0)
    assert len(rest) == 26 and sorted(seen_at_2 + rest) == epoch  # no sample skipped, none read twice
    assert len(in_epoch(b, 1)) == 8
    for key in (
        "indices",
        "epochs",
        "draws",
        "samples_seen",
    ):  # the second restore: identical order and draws
        assert b[key] == c[key], key
    assert b["samples_seen"] == a[0]["samples_seen"] + a[1]["samples_seen"] + 34
    log = (tmp_path / "b" / "log.txt").read_text()
    assert "saved by 2 ranks and is restored on 1" in log and "'data': the 26 samples" in log, log[-3000:]

    # 1 -> 2: two ranks finish the epoch the 1-rank run had begun (8 read, 42 left: 21 each)
    times.append(torchrun(2, "finish", work, tmp_path / "d", 7, b["final_checkpoint"]))
    d = ranks(tmp_path / "d", 2)
    assert sorted(in_epoch(b, 1) + in_epoch(d[0], 1) + in_epoch(d[1], 1)) == epoch
    assert d[0]["draws"] != d[1]["draws"]
    assert sum(r["samples_seen"] for r in d) == b["samples_seen"] + 2 * 7 * 4 - 3 * 2  # 2 short batches of 1
    print(
        "torchrun wall times (s):",
        [round(t, 1) for t in times],
        "rank 0 clocks:",
        [r["clock"] for r in (a[0], b, c, d[0])],
    )
