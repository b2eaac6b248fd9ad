"""The fault drill's hardware kinds (issue 28): `sdc`, `sdc_persistent`, `slow` and `stuck`, on real tensors and
real optimizers, with the sleeps injected."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from supervisor.errors import UserError
from supervisor.runtime.faults import (
    KINDS,
    SLOW_SECONDS,
    Fault,
    FaultInjector,
    flip_top_exponent_bit,
    parse_faults,
)

GOOD = [
    ("sdc@3", Fault("sdc", 3), "sdc@3"),
    ("sdc@3:rank1", Fault("sdc", 3, 1), "sdc@3:rank1"),
    ("sdc_persistent@4:rank0", Fault("sdc_persistent", 4, 0), "sdc_persistent@4:rank0"),
    ("slow@10", Fault("slow", 10), "slow@10"),
    ("slow@10:rank1", Fault("slow", 10, 1), "slow@10:rank1"),
    ("slow@10:0.5s", Fault("slow", 10, None, 0.5), "slow@10:0.5s"),
    ("slow@10:rank1:.25s", Fault("slow", 10, 1, 0.25), "slow@10:rank1:0.25s"),
    ("slow@10:rank1:2s", Fault("slow", 10, 1, 2.0), "slow@10:rank1:2s"),
    ("stuck@7:rank1", Fault("stuck", 7, 1), "stuck@7:rank1"),
]


@pytest.mark.parametrize(("spec", "fault", "key"), GOOD)
def test_parse_new_kinds_and_round_trip_their_keys(spec: str, fault: Fault, key: str):
    assert parse_faults(spec) == [fault]
    assert fault.key == key
    assert parse_faults(key) == [fault]


BAD = [
    # (item, what the message must say was wrong)
    ("slow@10:rank1:0s", "the sleep '0s' is not a positive number of seconds"),
    ("slow@10:0.5s:rank1", "'rank1' comes too late"),
    ("slow@10:rank1:1s:2s", "a second sleep '2s'"),
    ("slow@10:fast", "'fast' is not rankN or a sleep such as 0.5s"),
    ("slow@10:-1s", "'-1s' is not rankN or a sleep"),
    ("kill@10:0.5s", "only slow takes a sleep, and kill got '0.5s'"),
    ("stuck@7:rank1:rank0", "'rank0' comes too late"),
    ("sdc@3:node1", "'node1' is not rankN"),
    ("sdc!@3", "unknown kind 'sdc!'"),
    ("stuck@x", "step 'x' is not a positive integer"),
    ("stuck", "no @STEP"),
]


@pytest.mark.parametrize(("item", "why"), BAD)
def test_bad_items_say_which_item_what_was_wrong_and_the_grammar(item: str, why: str):
    with pytest.raises(UserError) as caught:
        parse_faults(f"nan@1, {item}")
    message = str(caught.value)
    assert f"item {item!r}: {why}" in message
    assert "KIND@STEP[:rankN][:SECONDSs]" in message and "sdc_persistent" in message


def test_every_kind_is_described():
    assert {"sdc", "sdc_persistent", "slow", "stuck"} <= set(KINDS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_the_flip_changes_one_bit_of_one_element(dtype: torch.dtype):
    t = torch.linspace(-0.9, 0.9, 12, dtype=dtype).reshape(3, 4)
    before = t.clone()
    flip_top_exponent_bit(t, 6)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    diff = (t.view(ints) ^ before.view(ints)).flatten()
    assert diff.nonzero().flatten().tolist() == [6]
    assert bin(int(diff[6]) & ((1 << (8 * t.element_size())) - 1)).count("1") == 1
    assert abs(float(t.flatten()[6])) > 100 * abs(float(before.flatten()[6]))  # the top exponent bit: loud
    flip_top_exponent_bit(t, 6)
    assert torch.equal(t.view(ints), before.view(ints))


# -- sdc on a real model and optimizer --------------------------------------------------------------


def train(injector: FaultInjector | None, steps: range, model: torch.nn.Module | None = None) -> tuple:
    """Steps of a tiny regression, with the injector hooked as the TrainingCore hooks it; (model, losses)."""
    if model is None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    if injector is not None:
        opt.register_step_pre_hook(lambda o, a, k: injector.before_optimizer_step(step, [o]))
        opt.register_step_post_hook(lambda o, a, k: injector.after_optimizer_step([o]))
    x = torch.arange(12.0).reshape(3, 4) / 10
    losses = []
    for step in steps:  # noqa: B007 (the hooks read it)
        loss = model(x).square().mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if injector is not None:
            injector.after_step(step)
    return model, losses


def bits(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().view(torch.int32) for p in model.parameters()]


def test_sdc_flips_once_per_lineage_so_a_replay_of_the_step_differs(tmp_path: Path):
    _, clean = train(None, range(1, 5))
    fired = tmp_path / "faults-fired.json"
    _, faulty = train(FaultInjector(parse_faults("sdc@2"), fired), range(1, 5))
    assert faulty[:2] == clean[:2]  # the metrics of step 2 come before its update
    assert faulty[2] != clean[2] and abs(faulty[2]) > 1e6 * abs(clean[2])  # step 3 sees the flipped weight
    assert fired.exists() and "sdc@2" in fired.read_text()
    # A relaunch (a new injector on the same fired file) runs step 2 again: no flip, the clean value.
    _, replay = train(FaultInjector(parse_faults("sdc@2"), fired), range(1, 5))
    assert replay == clean


def test_sdc_persistent_flips_every_run_of_its_step_on_its_rank_only(tmp_path: Path):
    spec = parse_faults("sdc_persistent@2:rank0")
    fired = tmp_path / "faults-fired.json"
    _, first = train(FaultInjector(spec, fired, rank=0), range(1, 5))
    _, again = train(FaultInjector(spec, fired, rank=0), range(1, 5))
    _, other_rank = train(FaultInjector(spec, fired, rank=1), range(1, 5))
    _, clean = train(None, range(1, 5))
    assert first == again and first[2] != clean[2]  # bit for bit the same wrong value on its own rank
    assert other_rank == clean
    assert not fired.exists()  # never recorded: it fires on every run
    # In one process too: re-running step 2 (an in-process replay from the state before it) flips again.
    torch.manual_seed(0)
    replayed = torch.nn.Linear(4, 2)
    injector = FaultInjector(spec, fired, rank=0)
    train(injector, range(1, 2), replayed)
    snapshot = bits(replayed)
    train(injector, range(2, 3), replayed)
    once = bits(replayed)
    replays = []
    for hooked in (injector, None, injector):
        with torch.no_grad():
            for p, saved in zip(replayed.parameters(), snapshot, strict=True):
                p.view(torch.int32).copy_(saved)
        train(hooked, range(2, 3), replayed)
        replays.append(bits(replayed))
    same = [all(torch.equal(a, b) for a, b in zip(once, r, strict=True)) for r in replays]
    assert same == [True, False, True]  # flipped on each run of step 2; a run without the fault differs


def test_sdc_on_one_rank_leaves_the_other_rank_alone(tmp_path: Path):
    _, clean = train(None, range(1, 4))
    _, rank1 = train(FaultInjector(parse_faults("sdc@2:rank0"), tmp_path / "f.json", rank=1), range(1, 4))
    assert rank1 == clean


# -- slow and stuck, with the sleep injected ----------------------------------------------------------


def test_slow_sleeps_every_step_from_its_step_until_the_segment_ends(tmp_path: Path):
    slept: list[float] = []
    fired = tmp_path / "faults-fired.json"
    injector = FaultInjector(parse_faults("slow@3:rank1:0.5s"), fired, rank=1, sleep=slept.append)
    for step in range(1, 7):
        injector.after_step(step)
    assert slept == [0.5] * 4  # steps 3, 4, 5, 6
    injector.after_step(2)  # an in-process rollback to before the fault: still the same slow process
    assert slept == [0.5] * 5
    relaunched = FaultInjector(parse_faults("slow@3:rank1:0.5s"), fired, rank=1, sleep=slept.append)
    for step in range(1, 7):
        relaunched.after_step(step)
    assert slept == [0.5] * 5  # fired once per lineage: the relaunched segment runs at full speed


def test_slow_defaults_and_targets_one_rank(tmp_path: Path):
    slept: list[float] = []
    for rank in (0, 1):
        injector = FaultInjector(
            parse_faults("slow@2:rank1"), tmp_path / "f.json", rank=rank, sleep=slept.append
        )
        for step in range(1, 4):
            injector.after_step(step)
    assert slept == [SLOW_SECONDS, SLOW_SECONDS]


class Blocked(Exception):
    """Raised by the injected sleep: the rank would block here for good."""


def test_stuck_blocks_its_rank_for_good_after_recording_it(tmp_path: Path):
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:
            raise Blocked

    fired = tmp_path / "faults-fired.json"
    other = FaultInjector(parse_faults("stuck@4:rank1"), fired, rank=0, sleep=sleep)
    stuck = FaultInjector(parse_faults("stuck@4:rank1"), fired, rank=1, sleep=sleep)
    for step in range(1, 6):
        other.after_step(step)
    assert slept == []
    for step in range(1, 4):
        stuck.after_step(step)
    with pytest.raises(Blocked):
        stuck.after_step(4)
    assert slept == [3600, 3600, 3600]  # it never comes back on its own
    assert "stuck@4:rank1" in (tmp_path / "faults-fired.rank1.json").read_text()
    relaunched = FaultInjector(parse_faults("stuck@4:rank1"), fired, rank=1, sleep=sleep)
    relaunched.after_step(4)  # once per lineage
    assert len(slept) == 3


def test_sdc_flips_an_element_every_step_uses_not_an_unused_embedding_row(tmp_path: Path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 4), torch.nn.Linear(4, 3))
    with torch.no_grad():
        model[1].weight.mul_(100)  # so the embedding rows in use get the largest gradients by far
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no update: only the flip changes a parameter
    injector = FaultInjector(parse_faults("sdc@1"), tmp_path / "f.json")
    opt.register_step_pre_hook(lambda o, a, k: injector.before_optimizer_step(1, [o]))
    opt.register_step_post_hook(lambda o, a, k: injector.after_optimizer_step([o]))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1, 2, 3]])).square().sum().backward()
    assert model[0].weight.grad.abs().max() > model[1].weight.grad.abs().max()
    opt.step()
    changed = [int((p.detach() != b).sum()) for p, b in zip(model.parameters(), before, strict=True)]
    assert changed == [0, 1, 0]  # one element of the Linear's weight (dense gradient), the largest one there


def test_a_bad_batch_follows_the_data_not_the_process(tmp_path: Path):
    spec = parse_faults("bad_batch@2:rank1")
    fired = tmp_path / "faults-fired.json"
    _, own = train(FaultInjector(spec, fired, rank=0), range(1, 5))  # rank 0's own batches: never
    _, clean = train(None, range(1, 5))
    assert own == clean
    moved = FaultInjector(spec, fired, rank=0)
    moved.data_rank = 1  # rank 0 computes rank 1's batches (the replay's second stage)
    _, poisoned = train(moved, range(1, 5))
    assert poisoned[:2] == clean[:2] and all(math.isnan(v) for v in poisoned[2:])
    _, again = train(FaultInjector(spec, fired, rank=1), range(1, 5))  # on its own rank, on every run
    assert all(math.isnan(v) for v in again[2:])
    assert not fired.exists() and not fired.with_name("faults-fired.rank1.json").exists()  # never recorded
