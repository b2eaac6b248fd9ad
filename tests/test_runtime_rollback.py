"""The in-process rollback against a store that records what it is asked: the policy decides, the target is
protected while it is restored (from the ring when it holds it), and what came after it is abandoned."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.checkpoint import CheckpointInfo
from supervisor.errors import CheckpointNotFound
from supervisor.events import Event
from supervisor.runtime.reporter import EventReporter
from supervisor.runtime.rollback import InProcessRollback
from supervisor.runtime.save_failures import SaveFailures
from supervisor.runtime.seams import NullHeartbeat, NullMetrics, Outputs

A = CheckpointInfo("0000000010-000001", 10, 1.0, {"loss": 1.0}, seq=1, tiers=("local",))
B = CheckpointInfo("0000000020-000002", 20, 2.0, {"loss": 0.9}, seq=2, tiers=("memory",))


@dataclass
class FakeStore:
    known: list[CheckpointInfo]
    ring_has: set[str] = field(default_factory=set)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def candidates(self) -> list[CheckpointInfo]:
        return list(self.known)

    def protect(self, ids: Any) -> None:
        self.calls.append(("protect", list(ids)))

    def unprotect(self, ids: Any) -> None:
        self.calls.append(("unprotect", list(ids)))

    def restore_memory(self, which: CheckpointInfo, *, wait: bool = True) -> CheckpointInfo:
        self.calls.append(("restore_memory", which.id, wait))
        if which.id not in self.ring_has:
            raise CheckpointNotFound(f"{which.id} is not in the memory ring")
        return replace(which, tiers=("memory",))

    def restore(self, which: CheckpointInfo) -> CheckpointInfo:
        self.calls.append(("restore", which.id))
        return which

    def abandon_after(self, which: CheckpointInfo, *, wait: bool = True) -> list[CheckpointInfo]:
        self.calls.append(("abandon_after", which.id, wait))
        return []


def _policy(tmp_path: Path, rule: str) -> Any:
    from policies import load_policy

    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nname: t\ncheckpoint: {every_steps: 10}\n"
        "monitor: {detectors: [{type: non_finite, metrics: [loss]}]}\n"
        f"rules: [{rule}]\n"
    )
    return load_policy(path)


def _rollback(tmp_path: Path, rule: str) -> InProcessRollback:
    from policies import History

    reporter = EventReporter(tmp_path / "events.jsonl", 0, clock=lambda: 100.0)
    failures = SaveFailures(reporter, Outputs(NullMetrics(), NullHeartbeat()))
    ticks = iter([10.0, 10.25])
    return InProcessRollback(
        _policy(tmp_path, rule),
        History(),
        failures,
        reporter,
        clock=lambda: 100.0,
        monotonic=lambda: next(ticks),
    )


NAN = Event("non_finite", "loss is NaN", metric="loss", step=25, source="in_process")
LATEST = "{when: [non_finite], action: rollback, target: {select: latest}, skip_batches: 4, lr_scale: 0.5}"


@pytest.mark.parametrize(
    ("ring_has", "restores", "tier"),
    [
        ({B.id}, [("restore_memory", B.id, False)], "memory"),
        # Listed in the ring, then committed and dropped from it: read back from disk instead.
        (set(), [("restore_memory", B.id, False), ("restore", B.id)], "local"),
    ],
)
def test_a_rollback_restores_the_target_under_protection(tmp_path: Path, ring_has, restores, tier):
    rollback = _rollback(tmp_path, LATEST)
    store = FakeStore([A, B], ring_has)
    done = rollback.handle(store, NAN, 25)  # type: ignore[arg-type]
    assert done is not None and done.info.id == B.id
    assert (done.decision.skip_batches, done.decision.lr_scale) == (4, 0.5)
    assert store.calls == [
        ("protect", [B.id]),
        *restores,
        ("abandon_after", B.id, False),
        ("unprotect", [B.id]),
    ]
    assert rollback.count == 1 and len(rollback.history.entries) == 1
    (report,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (report["handled_in_process"], report["tier"], report["restore_s"]) == (True, tier, 0.25)


def test_the_target_is_unprotected_even_when_the_restore_fails(tmp_path: Path):
    rollback = _rollback(tmp_path, LATEST)
    store = FakeStore([A, replace(B, tiers=("local",))])

    def broken(which: Any) -> Any:
        raise CheckpointNotFound("gone")

    store.restore = broken  # type: ignore[method-assign]
    with pytest.raises(CheckpointNotFound):
        rollback.handle(store, NAN, 25)  # type: ignore[arg-type]
    assert store.calls[-1] == ("unprotect", [B.id]) and rollback.count == 0


def test_what_the_process_cannot_do_is_reported_and_left_to_the_supervisor(tmp_path: Path):
    rollback = _rollback(tmp_path, "{when: [non_finite], action: stop}")
    store = FakeStore([A, B])
    assert rollback.handle(store, NAN, 25) is None  # type: ignore[arg-type]
    assert store.calls == [] and rollback.count == 0
    (report,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert report["handled_in_process"] is False and report["decision"]["action"] == "stop"
