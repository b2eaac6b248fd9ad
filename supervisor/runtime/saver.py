"""One checkpoint from the training side: per-rank state gathered, metrics sent before the commit, cost timed."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.runtime.metrics import MetricsSent
from supervisor.runtime.registry import Registered
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.seams import CheckpointReader, Collective, Outputs
from supervisor.state import TrainingState


@dataclass(frozen=True)
class SaveResult:
    """One save from the training side: whether it landed, how long it blocked training, when it ended."""

    ok: bool
    blocked_s: float
    ended: float


class Saver:
    """Saves through the store without ever letting a failed save stop training.

    What `save()` blocked training for is the cadence's save cost: the caller records it (the decider owns
    the cadence).
    """

    def __init__(
        self,
        state: TrainingState,
        registered: Registered,
        outputs: Outputs,
        failures: SaveFailures,
        dist: Collective | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._state, self._registered, self._outputs = state, registered, outputs
        self._failures, self._dist, self._clock = failures, dist, clock

    def save(
        self, store: CheckpointReader, step: int, metrics: dict[str, float], *, force: bool = False
    ) -> SaveResult:
        """Checkpoint `step`; not `ok` if it failed (reported: a full or broken disk does not stop training)."""
        t0 = self._clock()
        self._outputs.heartbeat.beat(step, "checkpoint")
        values = {k: float(v) for k, v in metrics.items()}
        # A committed checkpoint implies its metrics are recorded (after a SIGKILL nothing before it is missing
        # from MLflow): the writer waits for them before the commit, so training does not wait for MLflow.
        sent = MetricsSent(self._outputs.metrics, step)
        rank_states = None
        if self._dist is not None:  # every rank takes part; rank 0 stores each rank's share under ranks.<r>
            rank_states = self._dist.gather_state(self._state.rank_state_dict(self._registered.rank_parts))
        ok = True
        try:
            self._failures.despite(
                step,
                store.save,
                step,
                metrics=values,
                force=force,
                before_commit=sent.wait,
                rank_states=rank_states,
            )
        except OSError as exc:  # a synchronous save's own write (an async one fails on the writer thread)
            self._failures.failed(exc, step)
            ok = False
        sent.ask()  # the state is copied: send the metrics now, beside training rather than beside the copy
        ended = self._clock()
        self._outputs.heartbeat.beat(step, "train")
        return SaveResult(ok, ended - t0, ended)

    def wait(self, store: CheckpointReader, step: int) -> bool:
        """Wait for pending saves and uploads; False if one failed (each failure is reported)."""
        before = self._failures.count
        self._failures.despite(step, store.wait)
        return self._failures.count == before
