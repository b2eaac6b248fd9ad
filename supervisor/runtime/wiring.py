"""Glue between the policy, the launch plan and the store, for the training side."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from supervisor.checkpoint import CheckpointInfo, CheckpointOptions, KeepBestSpec
from supervisor.runtime.plan import LaunchPlan

#: The policy a stand-alone run uses when it is given none.
DEFAULT_PRESET = "palm-spike"


def load_session_policy(plan: LaunchPlan) -> Any:
    """The plan's policy file, or the default preset for stand-alone runs."""
    from policies import load_policy, load_preset

    return load_policy(plan.policy_path) if plan.policy_path else load_preset(DEFAULT_PRESET)


def checkpoint_options(
    policy: Any, plan: LaunchPlan, config: dict[str, Any] | None = None
) -> CheckpointOptions:
    """The store's options from the policy's `checkpoint:` section; the plan decides where the store lives."""
    ck = policy.checkpoint
    keep_best = (
        KeepBestSpec(ck.keep_best.metric, ck.keep_best.mode, ck.keep_best.count) if ck.keep_best else None
    )
    return CheckpointOptions(
        directory=plan.checkpoint_dir,
        remote=plan.checkpoint_remote,
        keep_last=ck.keep_last,
        keep_best=keep_best,
        keep_every_steps=ck.keep_every_steps,
        async_save=ck.async_,
        memory_slots=ck.memory_slots,
        verify=ck.verify,
        config=config,
    )


def to_records(infos: Iterable[CheckpointInfo], invalid: Iterable[str] = ()) -> list[Any]:
    """The store's info records as the decision engine's catalogue; abandoned or invalid ones are not valid."""
    from policies import CheckpointRecord

    bad = set(invalid)
    return [
        CheckpointRecord(
            i.id, i.step, dict(i.metrics), valid=not i.abandoned and i.id not in bad, wall_time=i.wall_time
        )
        for i in infos
    ]


def apply_lr_scale(optimizers: list[torch.optim.Optimizer], schedulers: list[Any], scale: float) -> None:
    """Scale the learning rate for good: optimizer groups and the schedulers' base LRs (both are checkpointed)."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] *= scale
            if "initial_lr" in group:
                group["initial_lr"] *= scale
    for sched in schedulers:
        sched.base_lrs = [lr * scale for lr in sched.base_lrs]
        if hasattr(sched, "_last_lr"):
            sched._last_lr = [lr * scale for lr in sched._last_lr]
