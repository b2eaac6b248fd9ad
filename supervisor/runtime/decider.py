"""What a step's end means, apart from acting on it: heartbeat pacing, anomalies, whether a save is due, and
under DDP what every rank agrees on. The only writer of the save cadence."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from supervisor.events import Event
from supervisor.monitor import DetectorSet, Point
from supervisor.monitor.detectors import rank_step_metrics
from supervisor.runtime.agreement import Agreement, StepView
from supervisor.runtime.cadence import Cadence
from supervisor.runtime.stops import StopRequest

#: How often the heartbeat is written (and the supervisor's pid checked) while training.
BEAT_EVERY_S = 0.5


class StepDecider:
    """Decides after each step from the cadence, the detectors and (under DDP) the agreement.

    Every rank's detectors watch the values it logs itself (a NaN on any rank is an anomaly; the agreement
    makes it every rank's). `observes`: this rank also watches every rank's step times (under DDP rank 0 only:
    one straggler report, not one per rank). Nearly pure: the clocks are injected. Not thread-safe: the training thread calls it.
    """

    def __init__(
        self,
        cadence: Cadence,
        detectors: DetectorSet,
        agreement: Agreement | None = None,
        *,
        observes: bool = True,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.cadence, self._detectors, self.agreement = cadence, detectors, agreement
        self._observes, self._clock, self._wall = observes, clock, wall
        self._last_beat = 0.0
        #: Under DDP, the last agreed step and its per-rank metrics (`rank_step_metrics`), until observed.
        self.rank_metrics: tuple[int, dict[str, float]] | None = None

    def restarted(self, step: int) -> None:
        """The state was restored to `step`: the detectors start a new segment, the cadence counts from here."""
        self._detectors.reset_segment()
        self.cadence.start(step, self._clock())
        self.rank_metrics = None

    def tick(self) -> tuple[float, bool]:
        """A step ended now: (now, whether to beat the heartbeat and poll the stop sources)."""
        now = self._clock()
        self.cadence.observe_step(now)
        beat = now - self._last_beat >= BEAT_EVERY_S
        if beat:
            self._last_beat = now
        return now, beat

    def anomalies(self, step: int, metrics: dict[str, float]) -> list[Event]:
        """What the detectors see in this rank's metrics of the step (under DDP each names its rank)."""
        wall = self._wall()
        segment = self._detectors.segment
        points = [Point(key, step, float(value), wall, segment) for key, value in metrics.items()]
        if self.rank_metrics is not None:  # the previous step's, known once every rank agreed on it
            ranks_step, ranks = self.rank_metrics
            points[:0] = [Point(key, ranks_step, value, wall, segment) for key, value in ranks.items()]
            self.rank_metrics = None
        return [self._with_rank(event) for point in points for event in self._detectors.observe(point)]

    def _with_rank(self, event: Event) -> Event:
        """Under DDP, an anomaly in this rank's own values names the rank (a straggler names the slow one)."""
        event = self._with_host(event)
        if self.agreement is None or "rank" in event.evidence:
            return event
        return dataclasses.replace(event, evidence={**event.evidence, "rank": self.agreement.rank})

    def _with_host(self, event: Event) -> Event:
        """A straggler event names the host its rank runs on (as the first agreement told every rank)."""
        ranks = self.agreement.ranks if self.agreement is not None else None
        rank = event.evidence.get("rank")
        if (
            event.type != "straggler"
            or ranks is None
            or not isinstance(rank, int)
            or rank >= len(ranks.hosts)
        ):
            return event
        return dataclasses.replace(event, evidence={**event.evidence, "host": ranks.hosts[rank]})

    def save_due(self, step: int, now: float, *, writing: bool, stopping: bool, final: bool) -> bool:
        """Whether the save policy checkpoints `step` (`writing`: the store has a write in flight)."""
        return self.cadence.due(step, now, writing=writing, stopping=stopping, final=final)

    def may_save(self, step: int) -> bool:
        """Whether the save policy would checkpoint `step` now; observes and changes nothing."""
        return self.cadence.due(step, self._clock())

    def agree(
        self,
        events: list[Event],
        pending: StopRequest | None,
        *,
        due: bool,
        writing: bool,
        step: int | None = None,
    ) -> StepView:
        """Under DDP, every rank's merged view; this rank defers a save for its write only if its policy does.

        `step`: the step that ended, whose per-rank times (if the agreement carries them) become `rank_metrics`.
        """
        if self.agreement is None:
            raise RuntimeError("StepDecider.agree() is for DDP: build it with an Agreement")
        defer = writing and self.cadence.defers_while_writing
        mine = StepView(bool(events), pending.mode if pending else None, due, defer)
        merged = self.agreement.agree(mine)
        ranks = self.agreement.ranks
        if (
            self._observes
            and step is not None
            and ranks is not None
            and (metrics := rank_step_metrics(ranks.step_s))
        ):
            self.rank_metrics = (step, metrics)
        return merged

    @property
    def may_stop(self) -> bool:
        """Whether a pending stop is carried out now: always alone; under DDP once every rank agreed."""
        return self.agreement is None or self.agreement.stopped

    def saved(self, step: int, blocked_s: float, now: float) -> None:
        """A save of `step` blocked training `blocked_s` and ended at `now`."""
        self.cadence.observe_save(blocked_s)
        self.cadence.saved(step, now)
