"""Restore at another world size (issue 17, item 2): the data position re-split (`resplit`, pure, and through
real `ResumableLoader`s), the RNG streams re-derived (`rederive`), and one end-to-end run under torchrun
(FSDP2 through the Session, gloo): 2 ranks read half an epoch and save, 1 rank finishes it, twice identically,
then 3 ranks finish the epoch the 1-rank run had begun, in lock step though their shares differ."""

from __future__ import annotations

import copy
import itertools
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
from supervisor.sharded_state import SessionShardedState, unpack_json
from supervisor.state import TrainingState

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own noise

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "resplit_child.py"


# -- resplit, pure ---------------------------------------------------------------------------------------


@st.composite
def positions(draw: Any) -> list[EpochPosition]:
    """Old ranks' epochs: disjoint orders of (possibly different) lengths, each read up to some point, some
    with a drop_last tail (`stop`), some between epochs."""
    world = draw(st.integers(1, 6))
    pool = iter(draw(st.permutations(range(60))))
    result = []
    for _ in range(world):
        order = tuple(next(pool) for _ in range(draw(st.integers(0, 60 // world))))
        if not order and draw(st.booleans()):
            result.append(EpochPosition((), 0, begun=False))
            continue
        stop = draw(st.none() | st.integers(0, len(order)))
        result.append(EpochPosition(order, draw(st.integers(0, len(order) if stop is None else stop)), stop))
    return result


@settings(max_examples=300, deadline=None)
@given(positions(), st.integers(1, 7), st.integers(1, 5))
def test_resplit_gives_every_unseen_sample_to_one_new_rank_in_the_same_number_of_batches_on_every_rank(
    old: list[EpochPosition], new_world: int, batch: int
):
    plans = [resplit(old, r, new_world, batch) for r in range(new_world)]
    unseen = [i for p in old for i in p.unseen]
    handed = [i for plan in plans for i in plan.share]
    q = len(unseen) // new_world
    counts = {len(plan.batches) for plan in plans}
    assert counts == {-(-q // batch)}  # every new rank: ceil(q / batch_size) batches, so one epoch end
    for plan in plans:
        sizes = [len(b) for b in plan.batches]
        assert all(1 <= n <= batch + 1 for n in sizes) and (not sizes or max(sizes) - min(sizes) <= 1)
        assert (plan.unread, plan.per_rank, plan.in_epoch) == (len(unseen), q, any(p.begun for p in old))
        assert plan.dropped == tuple(i for p in old for i in p.order[max(p.seen, p.end) :])
    if q == 0:  # fewer unseen than new ranks: nobody reads any of them, and they are named as skipped
        assert handed == [] and all(sorted(plan.skipped) == sorted(unseen) for plan in plans)
    else:  # no sample skipped or read twice
        assert sorted(handed) == sorted(unseen) and all(plan.skipped == () for plan in plans)
        shares = [len(plan.share) for plan in plans]
        assert shares == [q + (r < len(unseen) % new_world) for r in range(new_world)]
        assert any(len(b) == batch + 1 for plan in plans for b in plan.batches) == (
            q % batch == 0 and len(unseen) % new_world > 0
        )
    seen = [i for p in old for i in p.order[: p.seen]]
    lost = [i for i in plans[0].skipped + plans[0].dropped]
    assert sorted(seen + handed + lost) == sorted(i for p in old for i in p.order)  # the epoch, exactly
    assert plans == [resplit(copy.deepcopy(old), r, new_world, batch) for r in range(new_world)]


def test_resplit_interleaves_the_old_ranks_remainders_in_a_fixed_order():
    old = [EpochPosition((10, 11, 12, 13), 1), EpochPosition((20, 21, 22, 23), 2)]
    assert resplit(old, 0, 1, 2).batches == ((11, 22), (12, 23), (13,))
    assert (resplit(old, 0, 2, 2).share, resplit(old, 1, 2, 2).share) == ([11, 12, 13], [22, 23])


@pytest.mark.parametrize(
    ("batch", "expected"),
    [  # 3 old ranks with 3 unread each, restored on 2: shares of 5 and 4 (before: 5 vs 4, and 2 vs 1 batches)
        (1, [[(0, 20), (11,), (2,), (22,)], [(10,), (1,), (21,), (12,)]]),
        (4, [[(0, 20, 11, 2, 22)], [(10, 1, 21, 12)]]),  # one batch each: rank 0's holds batch_size + 1
        (3, [[(0, 20, 11), (2, 22)], [(10, 1), (21, 12)]]),  # cut as evenly as possible, the larger first
    ],
)
def test_new_ranks_read_the_same_number_of_batches_when_their_shares_differ(batch, expected):
    old = [EpochPosition((10 * r, 10 * r + 1, 10 * r + 2), 0) for r in range(3)]
    assert [[tuple(b) for b in resplit(old, r, 2, batch).batches] for r in range(2)] == expected


def test_fewer_unread_samples_than_new_ranks_are_skipped_by_name_and_the_epoch_is_empty_everywhere():
    old = [EpochPosition((1, 2, 3), 2), EpochPosition((4, 5, 6), 3), EpochPosition((7, 8, 9), 2)]
    plans = [resplit(old, r, 3, 2) for r in range(3)]
    assert all(p.batches == () and p.in_epoch and p.skipped == (3, 9) and p.unread == 2 for p in plans)
    between = [EpochPosition((), 0, begun=False)] * 2  # between epochs: no re-split epoch at all
    assert not resplit(between, 0, 3, 2).in_epoch


@pytest.mark.parametrize("bad", [(-1, 2, 1), (2, 2, 1), (0, 0, 1), (0.0, 1, 1), (0, 1, 0), (0, 1, None)])
def test_resplit_refuses_a_rank_outside_the_world_or_a_batch_size_below_one(bad):
    with pytest.raises(ValueError, match="0 <= rank < world_size|batch_size"):
        resplit([], *bad)


# -- through real loaders ----------------------------------------------------------------------------------


def loader(
    rank: int, world: int, length: int, *, shuffle: bool = True, batch: int | None = 3, **kw: Any
) -> ResumableLoader:
    return ResumableLoader(
        torch.arange(length), batch_size=batch, shuffle=shuffle, seed=11, rank=rank, world_size=world, **kw
    )


def read(it_loader: ResumableLoader, batches: int) -> list[int]:
    """Read `batches` batches of the current epoch the way a training loop does (break mid-epoch)."""
    got: list[int] = []
    for n, b in enumerate(it_loader, 1):
        got += b.tolist() if b.dim() else [int(b)]
        if n == batches:
            break
    return got


def epoch(ld: ResumableLoader) -> list[list[int]]:
    """One epoch of `ld`, batch by batch (the next iter() after it ends starts the next epoch)."""
    return [b.tolist() for b in ld]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.integers(5, 41),  # every shard non-empty (torch cannot shuffle an empty one)
    st.integers(1, 4),
    st.booleans(),
    st.booleans(),
    st.floats(0, 1),
    st.integers(0, 3),
)
def test_a_half_read_epoch_finishes_at_another_world_size_in_lock_step_without_a_skip_or_a_repeat(
    world, new_world, length, batch, shuffle, drop_last, fraction, k_mid
):
    def make(rank: int, w: int) -> ResumableLoader:
        return loader(rank, w, length, shuffle=shuffle, batch=batch, drop_last=drop_last)

    full = [[i for b in epoch(make(r, world)) for i in b] for r in range(world)]  # what an unbroken run reads
    old = [make(r, world) for r in range(world)]
    k = round(fraction * len(old[0]))  # batches read, the same on every rank (lock-step)
    seen_by = [read(ld, k) if k else [] for ld in old]
    states = [copy.deepcopy(ld.state_dict()) for ld in old]
    for r, state in enumerate(states):  # epoch_position rebuilds what each rank read, in order
        pos = epoch_position(state, r, world, length, batch_size=batch, drop_last=drop_last)
        assert list(pos.order[: pos.seen]) == seen_by[r] and pos.begun == (k > 0)
    seen = [i for s in seen_by for i in s]

    new = [make(r, new_world) for r in range(new_world)]
    plans = [ld.resume_resplit(states, world, seed=5 + r) for r, ld in enumerate(new)]
    assert len({len(p.batches) for p in plans}) == 1  # every new rank reads as many batches
    rest: list[int] = []
    for r, ld in enumerate(new):
        if not plans[r].in_epoch:  # nothing of the epoch read: no re-split epoch (checked below)
            continue
        got = epoch(ld) if not (r == 0 and k_mid) else []
        if r == 0 and k_mid:  # a save and restore inside the re-split epoch changes nothing
            got = [b.tolist() for b in itertools.islice(ld, min(k_mid, len(plans[0].batches)))]
            new[0] = again = make(0, new_world)
            again.load_state_dict(copy.deepcopy(ld.state_dict()))
            got += epoch(again)
        assert got == [list(b) for b in plans[r].batches]  # read in order, in the planned batches; maybe none
        rest += [i for b in got for i in b]
    assert len(rest) == len(set(rest)) and not set(rest) & set(seen)
    skipped, dropped = set(plans[0].skipped), set(plans[0].dropped)
    if k == 0:  # nothing of the epoch read: an ordinary epoch at the new world size
        assert rest == [] and not skipped and not dropped
    else:  # with drop_last, what the old ranks would have dropped stays dropped; else nothing lost but q == 0
        assert set(rest) | set(seen) | skipped == {i for f in full for i in f}
        assert dropped == set(range(length - length % world)) - {i for f in full for i in f} - set(seen)
        assert bool(skipped) == (plans[0].per_rank == 0 and plans[0].unread > 0)

    # from the next epoch on: each new rank its own shard at W', its generator seeded from the re-derived seed
    for r, ld in enumerate(new):
        expected = make(r, new_world)
        expected.generator.manual_seed(5 + r)
        assert epoch(ld) == epoch(expected)


@pytest.mark.parametrize(
    ("workers", "every", "batches"),
    [(0, 1, 2), (2, 1, 2), (2, 3, 2), (2, 3, 4), (2, 4, 5)],  # (2, 3, 2): the snapshot is the epoch's start
)
def test_epoch_position_reads_the_order_and_position_with_or_without_worker_processes(
    workers, every, batches
):
    """With worker processes the position is the last snapshot (every `every` steps) plus the batches since."""
    old = [loader(r, 2, 30, num_workers=workers, snapshot_every_n_steps=every) for r in range(2)]
    seen_by = [read(ld, batches) for ld in old]
    for r, ld in enumerate(old):
        pos = epoch_position(copy.deepcopy(ld.state_dict()), r, 2, 30, batch_size=3, drop_last=False)
        assert list(pos.order[: pos.seen]) == seen_by[r] and len(pos.order) == 15
        assert sorted(pos.order) == list(range(r, 30, 2))
    new = loader(0, 1, 30, num_workers=workers)
    plan = new.resume_resplit([ld.state_dict() for ld in old], 2, seed=1)
    assert plan.unread == 30 - 6 * batches and sorted(plan.share + seen_by[0] + seen_by[1]) == list(range(30))
    assert [i for b in new for i in b.tolist()] == plan.share


def test_a_position_that_does_not_fit_the_loader_is_a_typed_error():
    state = loader(0, 1, 30, batch=4).state_dict()
    read_two = loader(0, 1, 30, batch=4)
    read(read_two, 2)
    with pytest.raises(LoaderError, match="samples_yielded=8 is not a whole number of batches of 3"):
        epoch_position(read_two.state_dict(), 0, 1, 30, batch_size=3, drop_last=False)
    assert not epoch_position(state, 0, 1, 30, batch_size=4, drop_last=False).begun


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
        assert ld.resume_resplit([m.state_dict() for m in mid], 3, seed=r).unread == length - len(seen)
    rest = [i for ld in last for b in ld for i in b.tolist()]
    assert sorted(seen + rest) == list(range(length))


def test_a_re_split_epoch_saved_before_batch_sizes_were_saved_resumes_in_full_batches():
    ld = loader(0, 1, 32, batch=4)
    ld.resume_resplit([loader(r, 2, 32, batch=4).state_dict() for r in range(2)], 2, seed=0)  # between epochs
    assert ld.state_dict().get("remainder") is None
    old = [loader(r, 2, 32, batch=4) for r in range(2)]
    for o in old:
        read(o, 1)  # 12 of 16 each unread: 24 on one rank in 6 batches of 4
    ld.resume_resplit([o.state_dict() for o in old], 2, seed=0)
    state = ld.state_dict()
    assert state["remainder"]["sizes"].tolist() == [4] * 6
    state["remainder"]["indices"], state["remainder"]["seen"] = state["remainder"]["indices"][:10], 4
    del state["remainder"]["sizes"]  # as saved before: full batches, the last one short
    again = loader(0, 1, 32, batch=4)
    again.load_state_dict(state)
    assert [len(b) for b in again] == [4, 2]
    state["remainder"]["seen"] = 3
    with pytest.raises(LoaderError, match="not a batch boundary"):
        loader(0, 1, 32, batch=4).load_state_dict(state)


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
    unbatched = loader(0, 1, 10, batch=None)
    read(unbatched, 3)
    with pytest.raises(LoaderError, match="batch_size=None"):
        loader(0, 2, 10, batch=None).resume_resplit([unbatched.state_dict()], 1, seed=0)


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


def resharded(saved: list[Any], saved_world: int, world: int, make: Any, caplog: Any) -> list[Any]:
    """Restore `saved` on `world` ranks (in one process), each with the data part `make(rank, world)`; the
    ranks' states and rank 0's warning line."""
    news = []
    for r in range(world):
        new = session_state(r, world, data=make(r, world))
        with caplog.at_level("WARNING", logger="rollback_supervisor.checkpoint"):
            new.load_rank_states_resharded(saved, saved_world, r, world, 40)
        news.append(new)
    return news


def test_fewer_unread_than_new_ranks_skips_them_by_name_and_every_rank_starts_the_next_epoch(caplog):
    saved = saved_at(3, 3)  # 3 ranks, 10 samples each, 9 read: 3 unread for 4 new ranks
    news = resharded(saved, 3, 4, lambda r, w: loader(r, w, 30), caplog)
    unread = [i for own in saved for i in loader_position(own).unseen]
    assert len(unread) == 3
    for r, new in enumerate(
        news
    ):  # an empty re-split epoch on every rank: one epoch end, then an ordinary one
        assert epoch(new.state["data"]) == []
        expected = loader(r, 4, 30)
        expected.generator.manual_seed(rederive(3, 40, r, 4, "data"))
        assert epoch(new.state["data"]) == epoch(expected) and len(epoch(expected)) == 3
    line = next(r.getMessage() for r in caplog.records if "restored on 4" in r.getMessage())
    assert (
        f"the 3 samples of the epoch not yet read (indices {interleaved(saved)}) are fewer than the 4" in line
    )
    assert "SKIPPED, the re-split epoch is empty on every rank and every rank starts the next epoch" in line


def loader_position(own: Any, world: int = 3, length: int = 30, batch: int = 3) -> EpochPosition:
    data = unpack_json(own)["data"]
    return epoch_position(data, data["split"]["rank"], world, length, batch_size=batch, drop_last=False)


def interleaved(saved: list[Any]) -> list[int]:
    unseen = [loader_position(own).unseen for own in saved]
    return [u[i] for i in range(max(map(len, unseen))) for u in unseen if i < len(u)]


def test_with_drop_last_what_the_old_ranks_would_have_dropped_stays_dropped_and_is_named(caplog):
    def make(r: int, w: int) -> ResumableLoader:
        return loader(r, w, 14, shuffle=False, drop_last=True)

    saved = []
    for r in range(2):  # 2 ranks over 14 samples: 7 each, 2 batches of 3 and one dropped; 1 batch read
        old = session_state(r, 2, data=make(r, 2))
        read(old.state["data"], 1)
        saved.append(json.loads(json.dumps(old.rank_state())))
    (new,) = resharded(saved, 2, 1, make, caplog)
    assert epoch(new.state["data"]) == [[6, 7, 8], [9, 10, 11]]  # not 12 and 13: an unbroken run drops them
    line = next(r.getMessage() for r in caplog.records if "restored on 1" in r.getMessage())
    assert (
        "with drop_last, the 2 samples the saving ranks' epoch ends would have dropped are dropped " in line
    )
    assert "(indices [12, 13])" in line and "every rank reads them in 2 batches" in line


def test_a_checkpoint_without_per_rank_counts_takes_rank_0s_count_for_every_saving_rank(caplog):
    """Before per-rank counts the saved counter is rank 0's own (`Session.loop` counts per rank): 2 ranks that
    read 3 batches of 3 each read 18 in all, which the 3 new ranks' counts sum to."""
    saved = saved_at(2, 3)
    for own in saved:
        del own["skeleton"]["counters"]
    news = []
    for r in range(3):
        new = session_state(r, 3)
        new.state.samples_seen = 9  # the global state's counter, as rank 0 saved it
        with caplog.at_level("WARNING", logger="rollback_supervisor.checkpoint"):
            new.load_rank_states_resharded(saved, 2, r, 3, 40)
        news.append(new.state.samples_seen)
    assert news == [6, 6, 6]
    assert any("predates per-rank counts" in r.getMessage() for r in caplog.records)


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
def test_two_ranks_save_mid_epoch_one_rank_finishes_it_twice_identically_then_three_finish_its_next(tmp_path):
    work = tmp_path / "work"
    # 2 ranks read 3 batches of 4 of their 25 and save: 24 of the 50 read
    times = [torchrun(2, "save", work, tmp_path / "a", 3)]
    a = ranks(tmp_path / "a", 2)
    epoch = list(range(a[0]["length"]))
    seen_at_2 = in_epoch(a[0], 0) + in_epoch(a[1], 0)
    assert len(seen_at_2) == 24 == len(set(seen_at_2))

    # 1 rank: the 26 unseen in 7 batches (ceil(26/4), cut evenly: five of 4, two of 3), then 6 batches of its
    # own next epoch; twice
    times += [torchrun(1, "finish", work, tmp_path / run, 13, a[0]["final_checkpoint"]) for run in ("b", "c")]
    (b,), (c,) = ranks(tmp_path / "b", 1), ranks(tmp_path / "c", 1)
    rest = in_epoch(b, 0)
    assert len(rest) == 26 and sorted(seen_at_2 + rest) == epoch  # no sample skipped, none read twice
    assert b["step_epochs"] == [0] * 7 + [1] * 6 and len(in_epoch(b, 1)) == 24
    for key in (
        "indices",
        "epochs",
        "draws",
        "samples_seen",
    ):  # the second restore: identical order and draws
        assert b[key] == c[key], key
    assert b["samples_seen"] == a[0]["samples_seen"] + a[1]["samples_seen"] + 50
    log = (tmp_path / "b" / "log.txt").read_text()
    assert "saved by 2 ranks and is restored on 1" in log and "'data': the 26 samples" in log, log[-3000:]

    # 1 -> 3: three ranks finish the epoch the 1-rank run had begun: 26 left, shares of 9, 9 and 8, each read in
    # 2 batches (as 3, 3 and 2 batches the ranks would end the epoch at different steps), then 2 of epoch 2
    times.append(torchrun(3, "finish", work, tmp_path / "d", 4, b["final_checkpoint"]))
    d = ranks(tmp_path / "d", 3)
    assert sorted(in_epoch(b, 1) + [i for r in d for i in in_epoch(r, 1)]) == epoch
    assert [len(in_epoch(r, 1)) for r in d] == [9, 9, 8]
    assert [r["step_epochs"] for r in d] == [[1, 1, 2, 2]] * 3  # every rank ends the epoch at the same step
    assert len({json.dumps(r["draws"]) for r in d}) == 3
    assert sum(r["samples_seen"] for r in d) == b["samples_seen"] + 26 + 3 * 2 * 4
    log = (tmp_path / "d" / "log.txt").read_text()
    assert "8 per rank and one more to each of the first 2 ranks; every rank reads them in 2 batches" in log
    print(
        "torchrun wall times (s):",
        [round(t, 1) for t in times],
        "rank 0 clocks:",
        [r["clock"] for r in (a[0], b, c, d[0])],
    )
