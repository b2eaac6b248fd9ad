"""What the training-side core needs from its collaborators, as Protocols, and the null outputs of ranks > 0.

The core never names a concrete class at these seams: rank 0 gets a `CheckpointManager`, an
`AsyncMetricLogger` and a `HeartbeatWriter`; the other ranks of a DDP job get `ReadOnlyCheckpoints`,
`NullMetrics` and `NullHeartbeat`; tests pass their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from supervisor.checkpoint import CheckpointInfo
from supervisor.checkpoint.restorer import Which


class CheckpointReader(Protocol):
    """The store as every rank sees it: restore what rank 0 names, take part in saves, close."""

    def restore(self, which: str) -> CheckpointInfo: ...

    def save(
        self,
        step: int,
        *,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        before_commit: Callable[[], Any] | None = None,
        rank_states: dict[str, Any] | None = None,
    ) -> CheckpointInfo | None: ...

    def writing(self) -> bool: ...

    def wait(self) -> None: ...

    def close(self) -> None: ...


class CheckpointStore(CheckpointReader, Protocol):
    """The store as the writer rank sees it (a `CheckpointManager`): choose, restore, roll back, protect."""

    def list(self) -> list[CheckpointInfo]: ...

    def latest(self) -> CheckpointInfo | None: ...

    def candidates(self) -> list[CheckpointInfo]: ...

    def restore(self, which: Which = "latest") -> CheckpointInfo: ...  # an id, "latest" or an info

    def restore_memory(self, which: Which = "latest", *, wait: bool = True) -> CheckpointInfo: ...

    def abandon_after(self, which: Which, *, wait: bool = True) -> list[CheckpointInfo]: ...

    def protect(self, ids: Iterable[str]) -> None: ...

    def unprotect(self, ids: Iterable[str]) -> None: ...


class Collective(Protocol):
    """The collectives the core needs under DDP (`Distributed`; tests simulate ranks with their own)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_writer(self) -> bool: ...

    def agree(self, *flags: int) -> tuple[int, ...]: ...

    def broadcast_outcome(self, value: str | None, error: BaseException | None = None) -> str | None: ...

    def gather_values(self, values: Sequence[float]) -> list[list[float]]: ...

    def gather_bytes(self, data: bytes) -> list[bytes] | None: ...

    def all_gather_bytes(self, data: bytes) -> list[bytes]: ...

    def exchange_bytes(self, data: bytes, peer: int) -> bytes: ...

    def gather_state(self, nested: dict[str, Any]) -> dict[str, Any] | None: ...

    def finish(self, timeout_s: float = 60.0) -> None: ...


class Heartbeat(Protocol):
    """Tells the supervisor this process is alive, at which step and in which phase."""

    def beat(self, step: int, phase: str = "train") -> object: ...


class MetricsLogger(Protocol):
    """Where `Session.log()` points go (`AsyncMetricLogger` on rank 0); never blocks training."""

    def start(self) -> None: ...

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self, timeout: float = 30.0) -> bool: ...

    def barrier(self) -> threading.Event: ...

    def close(self, timeout: float = 30.0) -> None: ...

    def connection(self, timeout: float = 120.0) -> tuple[Any, str | None]: ...


@dataclass
class Outputs:
    """Where the segment reports to; the parts read it at call time, so a test may swap the metric logger."""

    metrics: MetricsLogger
    heartbeat: Heartbeat


class NullMetrics:
    """The metric logger of a rank that does not log (only rank 0 talks to MLflow)."""

    def start(self) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def flush(self, timeout: float = 30.0) -> bool:
        return True

    def barrier(self) -> threading.Event:
        done = threading.Event()
        done.set()
        return done

    def close(self, timeout: float = 30.0) -> None:
        pass

    def connection(self, timeout: float = 0.0) -> tuple[None, None]:
        return None, None


class NullHeartbeat:
    """The heartbeat of a rank that does not beat (rank 0's stops when any rank stalls a collective)."""

    def beat(self, step: int, phase: str = "train") -> None:
        pass
