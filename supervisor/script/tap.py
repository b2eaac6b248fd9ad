"""The output tap: every line a script prints passes through it, and the metrics it reads go where they are used.

Each parsed line goes to the metric spool (the shipper takes it to the lineage's MLflow run, as it does for a
`Session`), to a queue the segment's watcher drains into the detectors, onto the step timeline that labels
checkpoint files (`step_at`), onto the metric timeline that gives a version the metrics of its own step
(`metrics_at`, not those printed by the time the scanner got to it), and to the step listeners (the fault drill's external faults). Thread-safe: the
launcher calls it from one reader thread per stream.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.launcher import OnLine
from supervisor.script.output import OutputParser, Parsed
from supervisor.spool import SpoolWriter

log = logging.getLogger("rollback_supervisor.script")

#: Steps kept on the timeline; the oldest half goes when it is full (files are labelled within seconds).
TIMELINE = 1 << 16
#: A line with the step and metric names of one read less than this many seconds before is another rank's
#: print of the same step (the ranks of a DDP job step together, within milliseconds of each other), not a new
#: point. A script that restarted itself and printed a step again gets there only after its start-up and its
#: steps since, which takes longer.
DUPLICATE_WINDOW_S = 5.0


@dataclass(frozen=True)
class Reading:
    """One parsed line and when the supervisor read it (wall clock, comparable with file mtimes)."""

    time: float
    parsed: Parsed


class OutputTap:
    """Parses a segment's output lines (see module docstring)."""

    def __init__(
        self,
        parser: OutputParser,
        *,
        spool: SpoolWriter | None = None,
        start_step: int = 0,
        on_step: Callable[[int], None] | None = None,
        then: OnLine | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.parser = parser
        self.spool = spool
        self.start_step = start_step
        self.on_step = on_step
        self.then = then
        self._clock = clock
        self._lock = threading.Lock()
        self._queue: list[Reading] = []
        self._times: list[float] = []
        self._steps: list[int] = []
        self._latest: dict[str, float] = {}
        self._metric_steps: list[int] = []  # the step of each line that printed metrics, in reading order
        self._metrics: list[dict[str, float]] = []
        self._recent: OrderedDict[tuple[int, frozenset[str]], float] = (
            OrderedDict()
        )  # (step, names) -> read at
        self.duplicates = 0  # lines dropped as another rank's print of a step already read

    def __call__(self, stream: str, line: str) -> None:
        parsed = self.parser.parse(line)
        if parsed is not None:
            self.read(parsed)
        if self.then is not None:
            self.then(stream, line)

    def read(self, parsed: Parsed) -> None:
        """Take one parsed line (what `__call__` does with a line that matched); another rank's print of a step
        already read (`DUPLICATE_WINDOW_S`) is dropped, so a job whose every rank prints counts each step once."""
        with self._lock:
            now = self._clock()
            if parsed.metrics and self._duplicate(parsed, now):
                return
            self._queue.append(Reading(now, parsed))
            if len(self._times) >= TIMELINE:
                del self._times[: TIMELINE // 2], self._steps[: TIMELINE // 2]
            self._times.append(now)
            self._steps.append(parsed.step)
            self._latest.update(parsed.metrics)
            if parsed.metrics:
                if len(self._metric_steps) >= TIMELINE:
                    del self._metric_steps[: TIMELINE // 2], self._metrics[: TIMELINE // 2]
                self._metric_steps.append(parsed.step)
                self._metrics.append(dict(parsed.metrics))
            if self.spool is not None and parsed.metrics:
                ms = int(now * 1000)
                self.spool.send([(k, v, ms, parsed.step) for k, v in parsed.metrics.items()])
        if self.on_step is not None:
            self.on_step(parsed.step)

    def _duplicate(self, parsed: Parsed, now: float) -> bool:
        """Whether a line with this step and these metric names was read within the window (lock held)."""
        recent = self._recent
        while recent and next(iter(recent.values())) < now - DUPLICATE_WINDOW_S:
            recent.popitem(last=False)
        key = (parsed.step, frozenset(parsed.metrics))
        if key not in recent:
            recent[key] = now
            return False
        self.duplicates += 1
        if self.duplicates == 1:
            log.warning(
                "step %d was printed again with the same metrics (%s) by another process of the job, seconds "
                "apart: only the first line of each step counts; print metrics on rank 0 only (as nanoGPT "
                "does) so that they are rank 0's",
                parsed.step,
                ", ".join(sorted(parsed.metrics)),
            )
        return True

    def take(self) -> list[Reading]:
        """The lines parsed since the last call, oldest first."""
        with self._lock:
            taken, self._queue = self._queue, []
        return taken

    def step_at(self, when: float) -> int:
        """The step of the last line read at or before `when` (the segment's start step before any)."""
        with self._lock:
            i = bisect.bisect_right(self._times, when)
            return self._steps[i - 1] if i else self.start_step

    def last_step(self) -> int | None:
        """The step of the last line read; None before any."""
        with self._lock:
            return self._steps[-1] if self._steps else None

    def metrics_at(self, step: int) -> dict[str, float]:
        """The last value of each metric printed at or before `step` (lines read in step order; a line whose
        step went back, after a script's own restart, counts from where it was read)."""
        with self._lock:
            i = len(self._metric_steps)
            while i and self._metric_steps[i - 1] > step:
                i -= 1
            out: dict[str, float] = {}
            while i and len(out) < len(self._latest):
                i -= 1
                for key, value in self._metrics[i].items():
                    out.setdefault(key, value)
            return out

    def latest(self) -> dict[str, float]:
        """The last value printed of each metric."""
        with self._lock:
            return dict(self._latest)

    def close(self) -> None:
        with self._lock:
            if self.spool is not None:
                self.spool.close()
