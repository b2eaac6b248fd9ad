"""The DDP agreement: one maximum over every rank's view of the step, and what the merged view means."""

from __future__ import annotations

import pytest

from supervisor.runtime.agreement import Agreement, StepView
from supervisor.runtime.stops import StopMode


def over(*views: StepView):
    """A reduce over these other ranks' views plus the caller's (what all_reduce(MAX) does)."""

    def reduce(*mine: int) -> tuple[int, ...]:
        return tuple(max(column) for column in zip(mine, *(v.flags() for v in views), strict=True))

    return reduce


@pytest.mark.parametrize(
    "view",
    [
        StepView(),
        StepView(anomaly=True),
        StepView(stop=StopMode.CHECKPOINT, save_due=True),
        StepView(stop=StopMode.NOW, writing=True),
    ],
)
def test_a_view_round_trips_through_its_flags(view):
    assert StepView.from_flags(*view.flags()) == view


@pytest.mark.parametrize(
    ("mine", "theirs", "save", "stop", "stopped"),
    [
        (StepView(save_due=True), StepView(), True, None, False),
        (StepView(), StepView(save_due=True), True, None, False),  # one rank due: all save
        (StepView(save_due=True), StepView(writing=True), False, None, False),  # rank 0 still writing
        (StepView(save_due=True), StepView(stop=StopMode.CHECKPOINT), False, StopMode.CHECKPOINT, True),
        (StepView(stop=StopMode.CHECKPOINT), StepView(stop=StopMode.NOW), False, StopMode.NOW, True),
        (StepView(save_due=True), StepView(anomaly=True), False, None, True),
    ],
)
def test_every_rank_gets_the_same_decision(mine, theirs, save, stop, stopped):
    agreement = Agreement(over(theirs))
    merged = agreement.agree(mine)
    assert (merged.save, merged.stop, agreement.stopped) == (save, stop, stopped)
    other = Agreement(over(mine)).agree(theirs)
    assert other == merged
