"""Under DDP, what every rank does after a step is agreed by one all_reduce(MAX): no rank is left behind.

Each rank brings its own view (an anomaly seen, a stop requested, a save due, its write in flight: rank 0's
alone, or with sharded checkpoints each rank's own writer); every rank gets the same merged answer (the maximum
of each flag), so all of them stop, save or go on together.

The same all_reduce carries each rank's step time (for the straggler detector): the time since it left the
previous agreement, which is its own work, while a rank that waits for a slower one waits inside this
collective. The first one also carries each rank's host name. Under DDP the gradient all_reduce inside the
backward makes the ranks wait for each other too, so a rank slowed before its backward slows everyone's time
alike; what this time shows is the work after it (optimizer step, metrics, host-side stalls, the drill's
`slow`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.runtime.stops import StopMode

#: The element-wise maximum of the flags over every rank (`Distributed.agree`).
Reduce = Callable[..., tuple[int, ...]]


@dataclass(frozen=True)
class StepView:
    """One rank's view of the step that ended (or, from `agree`, every rank's merged)."""

    anomaly: bool = False
    stop: StopMode | None = None
    save_due: bool = False
    writing: bool = False

    def flags(self) -> tuple[int, int, int, int]:
        stop = 0 if self.stop is None else int(self.stop)
        return int(self.anomaly), stop, int(self.save_due), int(self.writing)

    @classmethod
    def from_flags(cls, anomaly: int, stop: int, save_due: int, writing: int) -> StepView:
        return cls(bool(anomaly), StopMode(stop) if stop else None, bool(save_due), bool(writing))

    @property
    def save(self) -> bool:
        """Whether the ranks save now: one wants to, no rank is still writing, and nobody stops."""
        return self.save_due and not self.writing and self.stop is None and not self.anomaly


#: Bytes of each rank's host name the first agreement carries, 7 to an int64 (so that no slot is negative).
HOST_BYTES = 63
_SLOT_BYTES = 7


@dataclass(frozen=True)
class RankSteps:
    """Every rank's time for one step (seconds outside the agreement), and the host each rank runs on."""

    step_s: tuple[float, ...]
    hosts: tuple[str, ...]


class Agreement:
    """The one collective per step; `stopped` once the ranks agreed to stop (they leave the loop together).

    With `world_size`, it also carries every rank's step time: `ranks` holds the last agreed step's (None for
    the first one, which has no previous agreement to count from).
    """

    def __init__(
        self,
        reduce: Reduce,
        *,
        rank: int = 0,
        world_size: int | None = None,
        host: str = "",
        clock: Callable[[], float] = time.monotonic,
    ):
        self._reduce = reduce
        self._rank, self._world, self._host, self._clock = rank, world_size, host, clock
        self._left: float | None = None  # when this rank left the previous agreement
        self._hosts: tuple[str, ...] | None = None
        self.ranks: RankSteps | None = None
        self.stopped = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def hosts(self) -> tuple[str, ...] | None:
        """Every rank's host name, by rank, once the first agreement carried them (with `world_size`)."""
        return self._hosts

    def agree(self, mine: StepView) -> StepView:
        flags = mine.flags()
        out = self._reduce(*flags, *self._times()) if self._world else self._reduce(*flags)
        self._left = self._clock()
        merged = StepView.from_flags(*out[: len(flags)])
        if self._world:
            self._read(out[len(flags) :])
        if merged.anomaly or merged.stop is not None:
            self.stopped = True
        return merged

    def _times(self) -> list[int]:
        """This rank's step time in its own slot (microseconds + 1: 0 is "not known"), and the first time
        its host name in its own slots; zeros elsewhere, so the maximum over the ranks holds every rank's."""
        assert self._world
        times = [0] * self._world
        if self._left is not None:
            times[self._rank] = 1 + round(max(0.0, self._clock() - self._left) * 1e6)
        if self._hosts is not None:
            return times
        per_rank = HOST_BYTES // _SLOT_BYTES
        hosts = [0] * (self._world * per_rank)
        name = self._host.encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
        for i in range(per_rank):
            chunk = name[i * _SLOT_BYTES : (i + 1) * _SLOT_BYTES]
            hosts[self._rank * per_rank + i] = int.from_bytes(chunk, "big")
        return times + hosts

    def _read(self, rest: tuple[int, ...]) -> None:
        assert self._world
        times, slots = rest[: self._world], rest[self._world :]
        if self._hosts is None:
            per_rank = HOST_BYTES // _SLOT_BYTES
            names = [
                b"".join(v.to_bytes(_SLOT_BYTES, "big") for v in slots[r * per_rank : (r + 1) * per_rank])
                for r in range(self._world)
            ]
            self._hosts = tuple(n.rstrip(b"\0").decode(errors="replace") for n in names)
        known = all(t > 0 for t in times)
        self.ranks = RankSteps(tuple((t - 1) / 1e6 for t in times), self._hosts) if known else None
