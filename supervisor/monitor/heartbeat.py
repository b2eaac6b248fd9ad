"""A heartbeat file: the training side writes step and phase atomically; the monitor reads it."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from supervisor.errors import UserError

log = logging.getLogger("rollback_supervisor.monitor")

#: Phases the training side reports; every phase but "train" gets the hang detector's longer grace.
PHASES = ("train", "checkpoint", "eval")


class HeartbeatError(UserError):
    """A heartbeat was given a bad phase or step."""


@dataclass(frozen=True)
class Heartbeat:
    """One heartbeat: the last step, the writer's wall clock, what it is doing, and who it is."""

    step: int
    wall_time: float
    phase: str
    pid: int


class HeartbeatWriter:
    """Writes the heartbeat file with write-to-temp + rename, so a reader never sees half a file."""

    def __init__(self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._pid = os.getpid()

    def beat(self, step: int, phase: str = "train") -> Heartbeat:
        if phase not in PHASES:
            raise HeartbeatError(f"heartbeat phase: expected one of {', '.join(PHASES)}, got {phase!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise HeartbeatError(f"heartbeat step: expected an integer >= 0, got {step!r}")
        beat = Heartbeat(step=step, wall_time=self._clock(), phase=phase, pid=self._pid)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(asdict(beat), f)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return beat


class HeartbeatReader:
    """Reads the heartbeat file; a missing or unreadable file reads as no heartbeat."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._last: Heartbeat | None = None

    def read(self) -> Heartbeat | None:
        try:
            data = json.loads(self.path.read_text())
            return Heartbeat(
                step=int(data["step"]),
                wall_time=float(data["wall_time"]),
                phase=str(data["phase"]),
                pid=int(data["pid"]),
            )
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("heartbeat %s is unreadable (%s); treating it as absent", self.path, exc)
            return None

    def changed(self) -> Heartbeat | None:
        """The heartbeat if it differs from the one this reader returned last time, else None."""
        beat = self.read()
        if beat is None or beat == self._last:
            return None
        self._last = beat
        return beat
