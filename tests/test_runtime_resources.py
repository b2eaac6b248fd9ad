"""A segment's resources with fakes: nothing opened when built, the store alone on first use, the rest on
`start()`, and the close order (watcher, store, metrics, leaving with the other ranks unless it failed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from supervisor import exitcodes
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.resources import FINISH_TIMEOUT_S, SegmentResources
from supervisor.runtime.seams import NullHeartbeat, NullMetrics, Outputs
from supervisor.runtime.segment_store import SegmentStore, StoreNotOpen
from supervisor.runtime.stops import StopSources
from supervisor.state import TrainingState


class Calls(list):
    pass


class Watcher:
    def __init__(self, calls: Calls):
        self._calls = calls

    def start(self) -> Watcher:
        self._calls.append("watcher.start")
        return self

    def stop(self) -> None:
        self._calls.append("watcher.stop")


class Metrics(NullMetrics):
    def __init__(self, calls: Calls):
        self._calls = calls

    def close(self, timeout: float = 30.0) -> None:
        self._calls.append("metrics.close")


class Dist:
    rank, is_writer = 1, False

    def __init__(self, calls: Calls):
        self._calls = calls

    def finish(self, timeout_s: float = 60.0) -> None:
        self._calls.append(f"finish {timeout_s:g}")


def _resources(tmp_path: Path, calls: Calls, dist: Any = None) -> SegmentResources:
    plan = LaunchPlan(
        lineage="r",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "work" / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'unused.db'}",
        policy_path=str(tmp_path / "p.yaml"),
    )
    stops = StopSources(lambda on_notice: Watcher(calls), None)  # type: ignore[arg-type,return-value]
    return SegmentResources(
        plan, SegmentStore(None, "full"), Outputs(Metrics(calls), NullHeartbeat()), stops, dist
    )


def test_nothing_opens_when_built_the_store_alone_on_first_use_and_the_rest_on_start(tmp_path: Path):
    calls = Calls()
    resources = _resources(tmp_path, calls)
    assert resources.store is None and not (tmp_path / "work").exists()
    with pytest.raises(StoreNotOpen, match="restore"):
        resources.need()
    store = resources.open_store(TrainingState())
    assert resources.open_store(TrainingState()) is store is resources.store
    assert calls == [] and isinstance(resources.outputs.heartbeat, NullHeartbeat)
    resources.start(TrainingState())
    resources.start(TrainingState())  # idempotent
    assert calls == ["watcher.start"] and not isinstance(resources.outputs.heartbeat, NullHeartbeat)


@pytest.mark.parametrize(
    ("exit_code", "leaves"),
    [(exitcodes.EXIT_OK, True), (exitcodes.EXIT_PREEMPTED, True), (exitcodes.EXIT_FAILED, False)],
)
def test_close_stops_the_watcher_first_and_leaves_with_the_ranks_unless_it_failed(
    tmp_path, exit_code, leaves
):
    calls = Calls()
    resources = _resources(tmp_path, calls, Dist(calls))
    resources.start(TrainingState())
    resources.close(exit_code, lambda store: calls.append("store.close"))
    finish = [f"finish {FINISH_TIMEOUT_S:g}"] if leaves else []
    assert calls == ["watcher.start", "watcher.stop", "store.close", "metrics.close", *finish]


def test_a_store_that_fails_to_close_still_closes_the_metrics_and_leaves(tmp_path: Path):
    calls = Calls()
    resources = _resources(tmp_path, calls, Dist(calls))
    resources.open_store(TrainingState())

    def broken(store: object) -> None:
        raise OSError("disk gone")

    with pytest.raises(OSError):
        resources.close(exitcodes.EXIT_OK, broken)
    assert calls == ["metrics.close", f"finish {FINISH_TIMEOUT_S:g}"]
