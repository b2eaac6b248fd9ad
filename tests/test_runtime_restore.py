"""Which checkpoint a segment starts from, per its plan; and what a restore applies to the registered parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from supervisor.errors import CheckpointNotFound
from supervisor.runtime.plan import RestoreSpec
from supervisor.runtime.registry import Registered
from supervisor.runtime.restore import PlanRestore, choose_and_restore
from supervisor.runtime.seams import NullHeartbeat, NullMetrics, Outputs
from supervisor.state import TrainingState


@dataclass
class Info:
    id: str
    step: int


@dataclass
class FakeStore:
    """The writer's store: `valid` are the restorable checkpoints, `invalid` the listed but unusable ones."""

    valid: list[Info] = field(default_factory=list)
    invalid: list[Info] = field(default_factory=list)
    calls: list[tuple[str, Any]] = field(default_factory=list)

    def latest(self) -> Info | None:
        return self.valid[-1] if self.valid else None

    def list(self) -> list[Info]:
        return self.valid + self.invalid

    def restore(self, which: Any = "latest") -> Info:
        self.calls.append(("restore", which))
        return self.latest() if which == "latest" else next(i for i in self.list() if i.id == which)

    def abandon_after(self, which: Any, *, wait: bool = True) -> list[Info]:
        self.calls.append(("abandon_after", which.id))
        return []


A, B = Info("0000000010-000001", 10), Info("0000000020-000002", 20)


@pytest.mark.parametrize(
    ("store", "spec", "restored", "calls"),
    [
        (FakeStore(), RestoreSpec(), None, []),  # nothing saved yet: from scratch
        (FakeStore([A, B]), RestoreSpec(), B, [("restore", "latest")]),
        (FakeStore([A, B]), RestoreSpec(A.id), A, [("restore", A.id)]),
        (FakeStore([A, B]), RestoreSpec(from_scratch=True), None, []),
        (
            FakeStore([A, B]),
            RestoreSpec(A.id, rollback=True),
            A,
            [("restore", A.id), ("abandon_after", A.id)],
        ),
    ],
)
def test_the_plan_picks_the_checkpoint(store, spec, restored, calls):
    assert choose_and_restore(store, spec, where="ckpts") == restored  # type: ignore[arg-type]
    assert store.calls == calls


def test_checkpoints_that_all_fail_to_verify_are_never_silently_ignored():
    with pytest.raises(
        CheckpointNotFound, match=r"no valid checkpoint among 2 in /ckpts.*checkpoints verify"
    ):
        choose_and_restore(FakeStore(invalid=[A, B]), RestoreSpec(), where="/ckpts")  # type: ignore[arg-type]


class Recorded(NullMetrics):
    def __init__(self) -> None:
        self.points: dict[str, float] = {}

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.points.update(metrics)


class Loader:
    def __init__(self) -> None:
        self.batches_skipped = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches_skipped": self.batches_skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches_skipped = state["batches_skipped"]

    def skip_batches(self, n: int) -> None:
        self.batches_skipped += n


def test_a_restore_skips_batches_scales_the_lr_and_says_so():
    state, registered = TrainingState(), Registered()
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    registered.add(state, "optimizer", opt)
    registered.add(state, "data", Loader())
    metrics = Recorded()
    restorer = PlanRestore(registered, Outputs(metrics, NullHeartbeat()), "ckpts")
    restorer.apply(7, 0.5)
    restorer.report(20, 7, 0.5, None, "plan")
    assert registered.applied() == (pytest.approx(0.05), 7.0)
    assert registered.rank_parts == ["data"]
    assert metrics.points == {
        "rollback.restored_step": 20,
        "rollback.skip_batches": 7,
        "rollback.lr_scale": 0.5,
    }


def test_skipping_without_a_resumable_loader_says_what_to_register():
    with pytest.raises(TypeError, match="register a supervisor.data.ResumableLoader"):
        Registered().skip_batches(3)


class Dist:
    """Rank `rank`'s view of the collective: rank 0's broadcasts return what it sends; another rank's return
    rank 0's scripted names, in order."""

    def __init__(self, rank: int, names: list[str | None] | None = None):
        self.rank, self.names, self.sent = rank, list(names or []), []

    def broadcast_outcome(self, value: str | None, error: BaseException | None = None) -> str | None:
        self.sent.append(value if error is None else f"error: {error}")
        return value if self.rank == 0 else self.names.pop(0)

    def gather_values(self, values: Any) -> list[list[float]]:
        return [list(values)]


@dataclass
class Reader:
    """A non-zero rank's read-only store: `corrupt` ids fail to verify."""

    known: list[Info]
    corrupt: set[str] = field(default_factory=set)
    reads: list[str] = field(default_factory=list)

    def restore(self, which: str) -> Info:
        from supervisor.errors import CheckpointCorrupt

        self.reads.append(which)
        if which in self.corrupt:
            raise CheckpointCorrupt(which, "checksum mismatch")
        return next(i for i in self.known if i.id == which)


def _restorer(dist: Dist) -> PlanRestore:
    return PlanRestore(Registered(), Outputs(NullMetrics(), NullHeartbeat()), "ckpts", dist)  # type: ignore[arg-type]


def test_rank_0_names_its_choice_before_reading_it_so_every_rank_reads_at_once():
    rank0, store = Dist(0), FakeStore([A, B])
    assert _restorer(rank0).restore(store, Reader([]), RestoreSpec()) == B  # type: ignore[arg-type]
    assert rank0.sent == [B.id, B.id]  # the candidate (the newest valid), then what was restored
    assert store.calls == [("restore", "latest")]  # rank 0 still falls back past a corrupt newest one

    rank1, reader = Dist(1, [B.id, B.id]), Reader([A, B])
    assert _restorer(rank1).restore(None, reader, RestoreSpec()) == B  # type: ignore[arg-type]
    assert reader.reads == [B.id]  # read once, while rank 0 read it too


def test_a_rank_reads_again_when_rank_0_fell_back_to_an_older_commit():
    rank1, reader = Dist(1, [B.id, A.id]), Reader([A, B], corrupt={B.id})
    assert _restorer(rank1).restore(None, reader, RestoreSpec()) == A  # type: ignore[arg-type]
    assert reader.reads == [B.id, A.id]

    rank1, reader = Dist(1, [B.id, A.id]), Reader([A, B])  # read fine here, but rank 0 found it corrupt
    assert _restorer(rank1).restore(None, reader, RestoreSpec()) == A  # type: ignore[arg-type]
    assert reader.reads == [B.id, A.id]


def test_a_start_from_scratch_and_a_failure_on_rank_0_are_named_to_every_rank():
    rank0 = Dist(0)
    assert _restorer(rank0).restore(FakeStore(), Reader([]), RestoreSpec()) is None  # type: ignore[arg-type]
    assert rank0.sent == [None, None]

    rank0 = Dist(0)
    with pytest.raises(CheckpointNotFound):
        _restorer(rank0).restore(FakeStore(invalid=[A]), Reader([]), RestoreSpec())  # type: ignore[arg-type]
    assert len(rank0.sent) == 1 and rank0.sent[0].startswith("error: no valid checkpoint among 1")
