"""One save from the training side, against a store that records its arguments: the heartbeat says
"checkpoint" meanwhile, the commit waits for the metrics, the blocked time is returned, a failure is counted."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from supervisor.errors import BackgroundSaveError
from supervisor.runtime.registry import Registered
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.saver import Saver, SaveResult
from supervisor.runtime.seams import NullMetrics, Outputs
from supervisor.state import TrainingState


class Beats:
    def __init__(self) -> None:
        self.beats: list[tuple[int, str]] = []

    def beat(self, step: int, phase: str = "train") -> None:
        self.beats.append((step, phase))


class Store:
    def __init__(self, fail: list[BaseException] | None = None) -> None:
        self.saves: list[dict[str, Any]] = []
        self.fail = fail or []

    def save(self, step: int, **kwargs: Any) -> None:
        if self.fail:
            raise self.fail.pop(0)
        self.saves.append({"step": step, **kwargs})
        kwargs["before_commit"]()  # a synchronous save commits here

    def writing(self) -> bool:
        return False

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def _saver(tmp_path: Path, clock: list[float]) -> tuple[Saver, SaveFailures, Beats]:
    beats = Beats()
    outputs = Outputs(NullMetrics(), beats)
    failures = SaveFailures(EventReporter(tmp_path / "events.jsonl", 0), outputs)
    ticks = iter(clock)
    saver = Saver(TrainingState(), Registered(), outputs, failures, clock=lambda: next(ticks))
    return saver, failures, beats


def test_a_save_passes_the_metrics_and_times_what_it_blocked(tmp_path: Path):
    saver, failures, beats = _saver(tmp_path, [100.0, 100.5])
    store = Store()
    result = saver.save(store, 10, {"loss": 2}, force=True)  # type: ignore[arg-type]
    assert result == SaveResult(ok=True, blocked_s=0.5, ended=100.5)
    (saved,) = store.saves
    assert (saved["step"], saved["metrics"], saved["force"], saved["rank_states"]) == (
        10,
        {"loss": 2.0},
        True,
        None,
    )
    assert beats.beats == [(10, "checkpoint"), (10, "train")]
    assert failures.count == 0


def test_a_failed_save_is_reported_and_training_goes_on(tmp_path: Path):
    saver, failures, beats = _saver(tmp_path, [0.0, 0.1])
    store = Store([BackgroundSaveError("an earlier write failed"), OSError(errno.ENOSPC, "full")])
    assert not saver.save(store, 20, {}).ok  # type: ignore[arg-type]
    assert failures.count == 2 and store.saves == []
    assert beats.beats[-1] == (20, "train")  # the heartbeat is back to training either way
    assert saver.wait(store, 20)  # type: ignore[arg-type]
