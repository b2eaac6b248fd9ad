"""The registered objects the supervisor acts on beyond saving them: optimizers, schedulers, the data loader."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from supervisor.runtime.lr_scale import apply_lr_scale
from supervisor.runtime.wiring import part_kind
from supervisor.state import TrainingState

log = logging.getLogger("rollback_supervisor.session")

#: Called around every optimizer step with that optimizer (the fault drill hooks in here).
OptimizerHook = Callable[[torch.optim.Optimizer], None]


@dataclass
class Registered:
    """What `register()` was given, sorted by what the supervisor does with it."""

    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    #: What is saved for the data loader (a plain StatefulDataLoader's exact wrapper), if one was registered.
    loader: Any = None
    #: Registered parts that differ per rank (the data loader): each rank's own is saved under ranks.<r>.
    rank_parts: list[str] = field(default_factory=list)

    def add(
        self,
        state: TrainingState,
        name: str,
        obj: Any,
        *,
        before_step: OptimizerHook | None = None,
        after_step: OptimizerHook | None = None,
    ) -> None:
        """Register `obj` in `state` under `name` and note its kind; hook optimizers' steps."""
        state.register(name, obj)
        kind = part_kind(obj)
        if kind == "optimizer":
            self.optimizers.append(obj)
            if before_step is not None:
                obj.register_step_pre_hook(lambda opt, args, kwargs: before_step(opt))
            if after_step is not None:
                obj.register_step_post_hook(lambda opt, args, kwargs: after_step(opt))
        elif kind == "scheduler":
            self.schedulers.append(obj)
        elif kind == "loader":
            self.loader = state[name]
            self.rank_parts.append(name)

    def skip_batches(self, n: int) -> None:
        if self.loader is None or not hasattr(self.loader, "skip_batches"):
            raise TypeError(
                f"the plan asks to skip {n} batches, but no registered data loader has skip_batches(); "
                "register a supervisor.data.ResumableLoader as data=..."
            )
        self.loader.skip_batches(n)

    def scale_lr(self, scale: float) -> None:
        apply_lr_scale(self.optimizers, self.schedulers, scale)

    def applied(self) -> tuple[float, float]:
        """(the first optimizer's LR, batches the loader skipped): what this rank actually has after a restore."""
        lr = self.optimizers[0].param_groups[0]["lr"] if self.optimizers else float("nan")
        return float(lr), float(getattr(self.loader, "batches_skipped", 0))
