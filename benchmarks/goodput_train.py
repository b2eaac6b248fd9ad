"""Training process of `bench goodput`: the example's own loop under a Session that also keeps exact counts.

Heartbeats come every 0.5 s and metrics are logged asynchronously, so after a SIGKILL neither says exactly
which step was the last one executed. This Session subclass writes a fixed 64-byte record with `pwrite`
after every step, save and restore (one syscall into the page cache, which survives SIGKILL):

    restored_step, restored_at, last_step, last_step_at, steps_run, save_s, saves, emergency_s, gap_s, gap_sq_s

save_s and saves cover the periodic checkpoints; emergency_s the whole emergency stop (save and wait).
gap_s and gap_sq_s sum the intervals between durable points (the restore, then each periodic checkpoint) and
their squares: the expected work a preemption at a random moment throws away is sum(T^2) / (2 sum(T)).

    python -m benchmarks.goodput_train [charlm args]     # with ROLLBACK_BENCH_COUNTERS=DIR
"""

from __future__ import annotations

import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

COUNTERS_ENV = "ROLLBACK_BENCH_COUNTERS"
FIELDS = (
    "restored_step",
    "restored_at",
    "last_step",
    "last_step_at",
    "steps_run",
    "save_s",
    "saves",
    "emergency_s",
    "gap_s",
    "gap_sq_s",
)
_FORMAT = "<" + "d" * len(FIELDS)


def counter_path(directory: Path, pid: int) -> Path:
    return Path(directory) / f"{pid}.bin"


def read_counter(path: Path) -> dict[str, float] | None:
    """The last record a training process wrote, or None if it died before restoring."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < struct.calcsize(_FORMAT):
        return None
    return dict(zip(FIELDS, struct.unpack_from(_FORMAT, data), strict=True))


def counting_session(base: type, directory: Path) -> type:
    """`base` (the example's Session) plus the counter record."""

    class CountingSession(base):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self._count = dict.fromkeys(FIELDS, 0.0)
            self._fd = os.open(counter_path(directory, os.getpid()), os.O_CREAT | os.O_WRONLY, 0o644)
            self._emergency = False
            self._durable_at = time.time()

        def _flush_count(self) -> None:
            os.pwrite(self._fd, struct.pack(_FORMAT, *self._count.values()), 0)

        def restore(self) -> Any:
            info = super().restore()
            self._count.update(restored_step=self.step, restored_at=time.time(), last_step=self.step)
            self._count["last_step_at"] = self._durable_at = self._count["restored_at"]
            self._flush_count()
            return info

        def _after_step(self, max_steps: int) -> None:
            c = self._count
            c["last_step"], c["last_step_at"], c["steps_run"] = self.step, time.time(), c["steps_run"] + 1
            self._flush_count()
            super()._after_step(max_steps)

        def _save(self, step: int, *, force: bool = False) -> None:
            started = time.monotonic()
            super()._save(step, force=force)
            if not self._emergency:  # the emergency checkpoint is timed whole, wait included, below
                self._count["save_s"] += time.monotonic() - started
                self._count["saves"] += 1
                now = time.time()
                gap, self._durable_at = now - self._durable_at, now
                self._count["gap_s"] += gap
                self._count["gap_sq_s"] += gap * gap
                self._flush_count()

        def _emergency_stop(self) -> None:
            started, self._emergency = time.monotonic(), True
            super()._emergency_stop()
            self._count["emergency_s"] += time.monotonic() - started
            self._flush_count()

        def close(self) -> None:
            try:
                super().close()
            finally:
                os.close(self._fd)

    return CountingSession


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import load_charlm

    charlm = load_charlm()
    charlm.Session = counting_session(charlm.Session, Path(os.environ[COUNTERS_ENV]))
    return charlm.main(argv)


if __name__ == "__main__":
    sys.exit(main())
