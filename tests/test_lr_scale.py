"""`lr_scale` holds for every scheduler in torch.optim.lr_scheduler, read from the LR each optimizer step used.

A real Session trains a small model 20 steps and checkpoints; two more segments restore that checkpoint (as a
rollback plan names it), one with `lr_scale` 1 and one with 0.5, and train 50 steps each. The LR in every
param group at every `optimizer.step()` of the scaled one must be exactly half the unscaled one's: scaling by
a power of two is exact in floating point, so `==` holds for closed-form and chained schedules alike.
The in-process rollback (a NaN loss, a rule with `lr_scale: 0.5`) is checked against an uninterrupted run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.optim import lr_scheduler as S

from supervisor.checkpoint import open_store
from supervisor.runtime import Session
from supervisor.runtime.lr_scale import apply_lr_scale
from supervisor.runtime.plan import LaunchPlan, RestoreSpec

BEFORE, AFTER = 20, 50

CASES: dict[str, Callable[[torch.optim.Optimizer], object]] = {
    "LambdaLR": lambda o: S.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.1 * s)),
    "MultiplicativeLR": lambda o: S.MultiplicativeLR(o, lambda s: 0.97),
    "StepLR": lambda o: S.StepLR(o, 7, gamma=0.5),
    "MultiStepLR": lambda o: S.MultiStepLR(o, [10, 30, 45], gamma=0.3),
    "ConstantLR": lambda o: S.ConstantLR(o, factor=0.25, total_iters=30),
    "LinearLR": lambda o: S.LinearLR(o, start_factor=0.1, end_factor=1.0, total_iters=40),
    "ExponentialLR": lambda o: S.ExponentialLR(o, gamma=0.95),
    "PolynomialLR": lambda o: S.PolynomialLR(o, total_iters=60, power=2.0),
    "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=30, eta_min=0.01),
    "CosineAnnealingWarmRestarts": lambda o: S.CosineAnnealingWarmRestarts(o, T_0=8, T_mult=2, eta_min=0.005),
    "CyclicLR": lambda o: S.CyclicLR(o, base_lr=[0.01, 0.005], max_lr=[0.1, 0.05], step_size_up=5),
    "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=[0.1, 0.05], total_steps=100),
    "SequentialLR": lambda o: S.SequentialLR(
        o, [S.LinearLR(o, start_factor=0.1, total_iters=10), S.ExponentialLR(o, gamma=0.9)], milestones=[30]
    ),
    "ChainedScheduler": lambda o: S.ChainedScheduler(
        [S.ConstantLR(o, factor=0.5, total_iters=35), S.CosineAnnealingLR(o, T_max=40, eta_min=0.002)]
    ),
    "ReduceLROnPlateau": lambda o: S.ReduceLROnPlateau(o, factor=0.7, patience=2, min_lr=[0.002, 0.001]),
}

POLICY = """\
version: 1
name: lr-scale
checkpoint: {every_steps: 10, keep_last: 20, async: false}
monitor:
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
    lr_scale: 0.5
"""


def test_the_table_covers_every_scheduler_in_torch():
    """A scheduler torch adds later gets a row here, or this test says which one is missing."""
    public = {
        name
        for name, cls in vars(S).items()
        if isinstance(cls, type) and issubclass(cls, S.LRScheduler) and not name.startswith("_")
    }
    assert public - {"LRScheduler"} == set(CASES)


def _plan(workdir: Path, segment: int, restore: RestoreSpec) -> LaunchPlan:
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY)
    return LaunchPlan(
        lineage="lr",
        workdir=str(workdir),
        checkpoint_dir=str(workdir / "checkpoints"),
        tracking_uri="sqlite:///unused.db",  # the spool below is the sink: no MLflow in the training process
        run_id="run",
        segment=segment,
        policy_path=str(policy),
        metrics_spool=str(workdir / "metrics" / f"{segment}.jsonl"),
        restore=restore,
    )


def _segment(
    plan: LaunchPlan, case: str, max_steps: int, nan_at: int | None = None
) -> dict[int, tuple[float, ...]]:
    """Train under a Session; the LR of each param group at each optimizer step, by step (the last one run)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters(), "lr": 0.1}, {"params": model[1].parameters(), "lr": 0.05}],
        momentum=0.9,
    )
    sched = CASES[case](opt)
    batches = [torch.randn(8, 4) for _ in range(16)]
    sess = Session(plan)
    used: dict[int, tuple[float, ...]] = {}
    opt.register_step_pre_hook(
        lambda o, a, k: used.__setitem__(sess.step, tuple(g["lr"] for g in o.param_groups))
    )
    sess.register(model=model, optimizer=opt, scheduler=sched)
    nan_due = nan_at is not None
    with sess:
        for step, x in sess.loop(batches, max_steps=max_steps):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if isinstance(sched, S.ReduceLROnPlateau):
                sched.step(1.0)  # a flat metric: it reduces every patience + 1 steps, down to min_lr
            else:
                sched.step()
            if nan_due and step == nan_at:  # once: the step comes back after the rollback
                nan_due = False
                sess.log(loss=math.nan)
            else:
                sess.log(loss=loss.item())
    assert sess.exit_code == 0
    return used


def _halved(lrs: dict[int, tuple[float, ...]], steps: range) -> list[tuple[float, ...]]:
    return [tuple(0.5 * lr for lr in lrs[s]) for s in steps]


@pytest.mark.parametrize("case", sorted(CASES))
def test_lr_scale_from_a_rollback_plan_holds_for_50_steps(tmp_path: Path, case: str):
    _segment(_plan(tmp_path, 0, RestoreSpec()), case, BEFORE)
    target = next(i.id for i in open_store(tmp_path / "checkpoints").list() if i.step == BEFORE)
    plain = _segment(_plan(tmp_path, 1, RestoreSpec(target, rollback=True)), case, BEFORE + AFTER)
    scaled = _segment(
        _plan(tmp_path, 2, RestoreSpec(target, lr_scale=0.5, rollback=True)), case, BEFORE + AFTER
    )
    after = range(BEFORE + 1, BEFORE + AFTER + 1)
    assert set(plain) == set(scaled) == set(after)
    assert [scaled[s] for s in after] == _halved(plain, after)
    assert len({plain[s] for s in after}) > 1 or case == "ConstantLR", (
        "the schedule must move after the restore"
    )


@pytest.mark.parametrize("case", ["OneCycleLR", "SequentialLR", "ReduceLROnPlateau", "CyclicLR"])
def test_lr_scale_of_an_in_process_rollback_holds_to_the_end(tmp_path: Path, case: str):
    steps = BEFORE + AFTER
    clean = _segment(_plan(tmp_path / "clean", 0, RestoreSpec()), case, steps)
    rolled = _segment(_plan(tmp_path / "rolled", 0, RestoreSpec()), case, steps, nan_at=BEFORE + 5)
    events = (tmp_path / "rolled" / "events.jsonl").read_text().splitlines()
    assert len(events) == 1 and '"handled_in_process": true' in events[0]
    after = range(BEFORE + 1, steps + 1)  # the rollback went back to the step-20 checkpoint
    assert [rolled[s] for s in after] == _halved(clean, after)
    assert [rolled[s] for s in range(1, BEFORE + 1)] == [clean[s] for s in range(1, BEFORE + 1)]


def test_a_nested_scheduler_is_scaled_once_through_its_parent():
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.2)
    inner = [S.ConstantLR(opt, factor=0.5, total_iters=3), S.ExponentialLR(opt, gamma=0.9)]
    chained = S.ChainedScheduler(inner)
    apply_lr_scale([opt], [chained], 0.5)
    state = chained.state_dict()
    assert [s["base_lrs"] for s in state["_schedulers"]] == [[0.1], [0.1]]
    assert opt.param_groups[0]["initial_lr"] == 0.1


class Guarded(S.LambdaLR):
    """A scheduler that refuses writes to its private attributes while `frozen`."""

    frozen = False

    def __setattr__(self, name: str, value: object) -> None:
        if self.frozen and name.startswith("_"):
            raise AssertionError(f"wrote the scheduler's private attribute {name}")
        super().__setattr__(name, value)


def test_scaling_writes_no_private_scheduler_attribute():
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.2)
    sched = Guarded(opt, lambda s: 1.0 / (1 + s))
    opt.step()
    sched.step()
    sched.frozen = True
    apply_lr_scale([opt], [sched], 0.5)  # through state_dict()/load_state_dict() only
    assert sched.get_last_lr() == [0.5 * 0.2 / 2] == [opt.param_groups[0]["lr"]]
