"""An LR scale that holds for every torch scheduler: scale the LRs a schedule is computed from, not one step.

Scaling `param_group["lr"]` once is lost at the next step of any scheduler that sets the LR absolutely
(OneCycleLR, CyclicLR, the closed forms SequentialLR calls at its milestones, floors such as `eta_min` and
`min_lrs`). So every LR-valued field is scaled: the optimizer's groups (`lr`, `initial_lr`, and OneCycleLR's
`max_lr`/`min_lr`) and, through each scheduler's own `state_dict()`/`load_state_dict()` round trip, its base,
max, min and last LRs, nested schedulers included. The schedule then continues as an exact copy scaled by
`scale` (bit for bit when `scale` is a power of two; otherwise within the rounding of one multiplication).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger("rollback_supervisor.session")

#: LR-valued keys of an optimizer's param groups (OneCycleLR keeps its peak and floor there).
GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
#: LR-valued lists in a scheduler's state (CyclicLR: base_lrs/max_lrs; ReduceLROnPlateau: min_lrs).
STATE_LISTS = ("base_lrs", "max_lrs", "min_lrs", "_last_lr")
#: LR-valued scalars in a scheduler's state (cosine floors, ReduceLROnPlateau's default floor).
STATE_SCALARS = ("eta_min", "default_min_lr")
#: Where SequentialLR and ChainedScheduler keep their schedulers' states.
NESTED = "_schedulers"


def _scaled(value: Any, scale: float) -> Any:
    return (
        value * scale
        if isinstance(value, float | int | torch.Tensor) and not isinstance(value, bool)
        else value
    )


def scaled_scheduler_state(state: dict[str, Any], scale: float) -> tuple[dict[str, Any], list[str]]:
    """A copy of a scheduler's state with every LR-valued field scaled, and the key paths that were scaled."""
    out, done = dict(state), []
    for key in STATE_LISTS:
        if isinstance(out.get(key), list | tuple):
            out[key] = [_scaled(v, scale) for v in out[key]]
            done.append(key)
    for key in STATE_SCALARS:
        if out.get(key) is not None:
            out[key] = _scaled(out[key], scale)
            done.append(key)
    if "min_lrs" in out and out.get("eps") is not None:
        # ReduceLROnPlateau skips a reduction smaller than `eps`, an absolute LR: scaled with the LRs, it makes
        # the same decisions.
        out["eps"] = _scaled(out["eps"], scale)
        done.append("eps")
    if isinstance(out.get(NESTED), list | tuple):
        nested = [scaled_scheduler_state(s, scale) for s in out[NESTED]]
        out[NESTED] = [s for s, _ in nested]
        done += [f"{NESTED}.{i}.{key}" for i, (_, keys) in enumerate(nested) for key in keys]
    return out, done


def apply_lr_scale(
    optimizers: Iterable[torch.optim.Optimizer], schedulers: Iterable[Any], scale: float
) -> None:
    """Scale the learning rate for good: every optimizer's LRs and every LR each scheduler computes from.

    The optimizers of the schedulers are scaled too (once each), so registering a scheduler is enough.
    """
    schedulers = list(schedulers)
    owners = [getattr(s, "optimizer", None) for s in schedulers]
    unique: dict[int, torch.optim.Optimizer] = {}
    for opt in [*optimizers, *owners]:
        if isinstance(opt, torch.optim.Optimizer):
            unique.setdefault(id(opt), opt)
    for opt in unique.values():
        for group in opt.param_groups:
            for key in GROUP_KEYS:
                if key not in group:
                    continue
                if isinstance(group[key], torch.Tensor):
                    group[key].mul_(scale)  # a tensor LR (capturable optimizers) is read in place
                else:
                    group[key] = _scaled(group[key], scale)
    for sched in schedulers:
        state, keys = scaled_scheduler_state(sched.state_dict(), scale)
        sched.load_state_dict(state)
        if keys:
            log.info("lr x%g: %s scaled %s", scale, type(sched).__name__, ", ".join(keys))
        else:
            log.warning(
                "lr x%g: %s keeps none of the LR fields this supervisor knows (%s); its next step may undo "
                "the scale",
                scale,
                type(sched).__name__,
                ", ".join(STATE_LISTS + STATE_SCALARS),
            )
