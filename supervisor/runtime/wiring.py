"""Glue between the policy, the launch plan and the store, for the training side."""

from __future__ import annotations

from typing import Any

import torch

from supervisor.checkpoint import CheckpointOptions, KeepBestSpec
from supervisor.runtime.lr_scale import apply_lr_scale as apply_lr_scale  # the session applies it
from supervisor.runtime.plan import LaunchPlan

#: The policy a stand-alone run uses when it is given none.
DEFAULT_PRESET = "palm-spike"


def load_session_policy(plan: LaunchPlan) -> Any:
    """The policy the supervisor validated, as the plan carries it (a `PolicyView`: no pydantic, no schema);
    else the plan's policy file, validated here, or the default preset for stand-alone runs."""
    if plan.policy is not None:
        from policies.plain import PolicyView

        return PolicyView.of(plan.policy)
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
        overlap=ck.overlap,
        verify=ck.verify,
        config=config,
        allow_nonfinite=ck.allow_nonfinite,
    )


def part_kind(obj: Any) -> str:
    """What a registered object is to the session: "optimizer", "scheduler", "loader" or "other".

    Decided by type and protocol, never by class name: any `LRScheduler` (ReduceLROnPlateau, SequentialLR and
    ChainedScheduler included) or an object with `base_lrs` is a scheduler; any torch `DataLoader` (plain
    ones are refused or wrapped when registered, see `supervisor.data.loader_part`) or an object with
    `skip_batches()` is the data loader.
    """
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, LRScheduler | ReduceLROnPlateau) or hasattr(obj, "base_lrs"):
        return "scheduler"
    if isinstance(obj, torch.utils.data.DataLoader) or callable(getattr(obj, "skip_batches", None)):
        return "loader"
    return "other"
