"""Whether to checkpoint after a step: small strategies over one explicit decision context (orbax-style).

Each strategy is a frozen dataclass with `should_save(ctx)`; they combine with `|` (any of) and `&` (all of).
None reads a clock: the context carries the time, so every strategy is tested without waiting.
`build_save_policy` composes the policy's `checkpoint:` section (every_steps, every_seconds, adaptive).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

#: The least lineage time the failure rate is estimated over: a run seconds old has not yet shown that it is
#: reliable, but checkpointing as if it failed every few seconds would cost more than it could save.
MIN_OBSERVED_S = 60.0


@dataclass(frozen=True)
class SaveContext:
    """Everything a save decision may look at, for the step that just ended."""

    step: int
    #: Monotonic seconds now.
    now: float
    last_save_step: int = 0
    #: When the last save (or the segment's start) was; None before the cadence started.
    last_save_time: float | None = None
    #: The store has as many writes in flight as it allows: a save now would block training.
    writing: bool = False
    #: A stop was requested: its own (emergency) checkpoint, if any, follows.
    stopping: bool = False
    #: The loop's last step: the final checkpoint follows.
    final: bool = False
    #: Mean seconds per step lately; None until a step was timed.
    step_time_s: float | None = None
    #: Seconds a save blocks training (smoothed); None until a save was timed.
    save_cost_s: float | None = None
    #: The mean time between failures assumed for the lineage.
    mtbf_s: float = MIN_OBSERVED_S


class SavePolicy(Protocol):
    """Decides whether the step in `ctx` is checkpointed.

    `defers_while_writing`: a write in flight alone can veto a save (under DDP rank 0 tells the other ranks so);
    `interval_steps(ctx)`: the step interval it keeps at `ctx`, None when steps do not trigger it.
    """

    @property
    def defers_while_writing(self) -> bool: ...

    def should_save(self, ctx: SaveContext) -> bool: ...

    def interval_steps(self, ctx: SaveContext) -> int | None: ...


class _Combines:
    """The defaults of a strategy that neither counts steps nor waits for writes, and `|`/`&`."""

    @property
    def defers_while_writing(self) -> bool:
        return False

    def interval_steps(self, ctx: SaveContext) -> int | None:
        return None

    def __or__(self, other: SavePolicy) -> AnyOf:
        return AnyOf((self, other))  # type: ignore[arg-type]

    def __and__(self, other: SavePolicy) -> AllOf:
        return AllOf((self, other))  # type: ignore[arg-type]


@dataclass(frozen=True)
class AnyOf(_Combines):
    """Save when any of `policies` says so."""

    policies: tuple[SavePolicy, ...]

    @property
    def defers_while_writing(self) -> bool:
        return bool(self.policies) and all(p.defers_while_writing for p in self.policies)

    def should_save(self, ctx: SaveContext) -> bool:
        return any(p.should_save(ctx) for p in self.policies)

    def interval_steps(self, ctx: SaveContext) -> int | None:
        """The shortest of the members' step intervals (whichever comes first triggers)."""
        intervals = [i for p in self.policies if (i := p.interval_steps(ctx)) is not None]
        return min(intervals) if intervals else None


@dataclass(frozen=True)
class AllOf(_Combines):
    """Save only when every one of `policies` says so."""

    policies: tuple[SavePolicy, ...]

    @property
    def defers_while_writing(self) -> bool:
        return any(p.defers_while_writing for p in self.policies)

    def should_save(self, ctx: SaveContext) -> bool:
        return all(p.should_save(ctx) for p in self.policies)

    def interval_steps(self, ctx: SaveContext) -> int | None:
        """The longest of the members' step intervals (every one must agree)."""
        intervals = [i for p in self.policies if (i := p.interval_steps(ctx)) is not None]
        return max(intervals) if intervals else None


@dataclass(frozen=True)
class Never(_Combines):
    """No periodic checkpoint (only the final and emergency ones)."""

    def should_save(self, ctx: SaveContext) -> bool:
        return False


@dataclass(frozen=True)
class EverySteps(_Combines):
    """Steps that are multiples of `steps`: aligned across restarts, whatever step a segment resumed at."""

    steps: int

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step % self.steps == 0

    def interval_steps(self, ctx: SaveContext) -> int | None:
        return self.steps


@dataclass(frozen=True)
class StepsSinceSave(_Combines):
    """`steps` steps after the last save (or the segment's start)."""

    steps: int

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.step - ctx.last_save_step >= self.steps

    def interval_steps(self, ctx: SaveContext) -> int | None:
        return self.steps


@dataclass(frozen=True)
class EverySeconds(_Combines):
    """`seconds` after the last save (or the segment's start)."""

    seconds: float

    def should_save(self, ctx: SaveContext) -> bool:
        return ctx.last_save_time is not None and ctx.now - ctx.last_save_time >= self.seconds


def young_daly_interval(save_cost_s: float, mtbf_s: float) -> float:
    """The first-order optimal checkpoint interval, sqrt(2 * C * MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2.0 * max(save_cost_s, 1e-6) * max(mtbf_s, 1e-6))


@dataclass(frozen=True)
class Adaptive(_Combines):
    """The Young/Daly interval from the measured save cost and failure rate, in steps, capped at `cap`.

    Until a step is timed the interval is the cap; once one is but no save is, it is one step, so the
    segment saves now and learns what a save costs instead of waiting for the cap.
    """

    cap: int | None = None

    def interval_steps(self, ctx: SaveContext) -> int | None:
        """The interval at `ctx` in steps; None when nothing is known yet and there is no cap."""
        if not ctx.step_time_s:
            return self.cap
        if ctx.save_cost_s is None:
            return 1
        steps = max(1, round(young_daly_interval(ctx.save_cost_s, ctx.mtbf_s) / ctx.step_time_s))
        return min(steps, self.cap) if self.cap else steps

    def should_save(self, ctx: SaveContext) -> bool:
        interval = self.interval_steps(ctx)
        return interval is not None and ctx.step - ctx.last_save_step >= interval


@dataclass(frozen=True)
class NotWhileWriting(_Combines):
    """Not while a write is in flight: a policy free to pick its moment saves at the first step after it."""

    @property
    def defers_while_writing(self) -> bool:
        return True

    def should_save(self, ctx: SaveContext) -> bool:
        return not ctx.writing


@dataclass(frozen=True)
class NotWhenStopping(_Combines):
    """Not when a stop is pending or on the last step: the stop's or the final checkpoint follows."""

    def should_save(self, ctx: SaveContext) -> bool:
        return not ctx.stopping and not ctx.final


def build_save_policy(
    every_steps: int | None,
    every_seconds: float | None,
    adaptive: bool,
    keep_every_steps: int | None = None,
) -> AllOf:
    """The policy for a `checkpoint:` section.

    Alone, `every_steps` saves at its multiples. With `every_seconds` or `adaptive`, steps count from the
    last save, and whichever of steps and seconds comes first triggers. An adaptive cadence never blocks on
    a write in flight (it saves right after it instead); a fixed one keeps its schedule and waits.
    `keep_every_steps` also saves at its multiples, whatever the other triggers did: retention keeps those
    checkpoints as milestones, and a cadence counting from the last save would step past them.
    """
    periodic: list[SavePolicy] = []
    if keep_every_steps is not None and not (
        every_steps is not None
        and every_seconds is None
        and not adaptive
        and keep_every_steps % every_steps == 0
    ):
        periodic.append(EverySteps(keep_every_steps))
    if adaptive:
        periodic.append(Adaptive(every_steps))
    elif every_seconds is not None and every_steps is not None:
        periodic.append(StepsSinceSave(every_steps))
    elif every_steps is not None:
        periodic.append(EverySteps(every_steps))
    if every_seconds is not None:
        periodic.append(EverySeconds(every_seconds))
    guards: list[SavePolicy] = [NotWhenStopping()]
    if adaptive:
        guards.append(NotWhileWriting())
    return AllOf((AnyOf(tuple(periodic)) if periodic else Never(), *guards))
