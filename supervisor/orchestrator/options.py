"""What a supervised run is given (RunOptions) and the data its steps hand each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from supervisor.events import Event
from supervisor.launcher import ExitInfo, Launcher

T = TypeVar("T")


@dataclass(frozen=True)
class RunOptions:
    """What one supervised run needs; the CLI and the flow build it from their arguments."""

    command: tuple[str, ...]
    policy_path: str
    lineage: str
    workdir: Path = Path(".rollback")
    tracking_uri: str | None = None
    experiment: str = "rollback-supervisor"
    stop_grace_seconds: float = 30.0
    lease_ttl_seconds: float = 60.0
    lease_wait_seconds: float = 0.0
    max_segments: int = 1000
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    lease_owner: str = ""  #: adopt a lease this process already took (the CLI takes it before Prefect starts)
    launcher: Launcher | None = None  #: what starts each segment; None: a local process group


@dataclass
class SegmentResult:
    """How one segment went: its exit, the event we stopped it for, and what it reported itself."""

    index: int
    exit: ExitInfo
    stopped_for: Event | None
    started: float
    ended: float
    last_step: int | None


@dataclass(frozen=True)
class Outcome:
    """How a lineage ends: its final status (finished, stopped or failed) and why."""

    status: str
    reason: str


class StepRunner(Protocol):
    """Runs one named step of `LineageRunner.supervise` (the flow runs each as a Prefect task)."""

    def __call__(self, name: str, fn: Callable[[], T], run_name: str | None = None) -> T: ...


def run_inline(name: str, fn: Callable[[], T], run_name: str | None = None) -> T:
    """Run the step here and now."""
    return fn()
