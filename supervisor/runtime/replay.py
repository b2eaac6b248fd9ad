"""Replay a bad step to tell data from hardware (the policy's `monitor.replay`): on the same device, then on
another rank's.

An anomaly whose onset is the step that just ended (a non-finite value, a spike) is not decided at once. The
state goes back to the newest snapshot in the memory ring at least two steps before the onset (at most
`max_steps` back; see MIN_REPLAYED_STEPS), and the same steps run again: the snapshot holds the data position and every RNG stream, so they see the same batches
and draw the same numbers. Each replayed step's value of the metric is compared, bit for bit, with what this
rank logged the first time:

- **different** (`replay_mismatch`): the first run computed it wrongly and the second did not: a transient
  hardware fault (silent data corruption), named with the rank, host and device where the values first
  parted. Training goes on from the replayed state: skipping data would be wrong.
- **the same** (`reproducible_on_same_device`): data or optimisation, or a device that is wrong every time
  (which only another device can tell). The policy's rule applies to the original anomaly, as without replay.
- a difference where kernels may be nondeterministic (CUDA without `torch.use_deterministic_algorithms`)
  proves nothing: `inconclusive`, and the rule applies.

Under DDP and FSDP every rank replays; each compares its own values, and the first step at which any rank
differs names the ranks whose results changed (a corrupted rank's own loss parts first: the others see its
damage only through the next gradient all-reduce). When every rank parts at the same step (a wrong gradient
all-reduced, a corrupted FSDP shard all-gathered) no rank can be named: the verdict names no host.

**The second stage** (`other_device`, under DDP): the same values do not clear a device that is wrong every
time. The same snapshot is restored again on every rank, and the rank that saw the anomaly (the suspect) and
its buddy (the next rank) swap their batches and RNG streams for the same steps: the suspect's batches are now
computed on the buddy's device. Each rank compares what it computed with what the batches' owner logged the
first time:

- the suspect's batches give a **different** value on the buddy's device (`persistent_mismatch`): the
  suspect's device computes them wrongly every time: a `hardware_fault` naming its rank, host and device.
- the **same** value (`reproducible_on_other_device`): the data or the optimisation; the rule applies.

With two ranks a swap changes nothing else: the gradient all-reduce adds the same two numbers. With more, the
reduction may add them in another order; a difference on a rank outside the swapped pair then proves nothing
(`inconclusive`). Pure but for the clock: the core carries out the restores, the swaps and the reports.
"""

from __future__ import annotations

import math
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from supervisor.events import Event

#: A replay runs at least the onset and the step before it: a fault in that step's update (a flipped bit in a
#: weight) shows only at the onset, and a snapshot taken after it would hold the damage and reproduce it.
MIN_REPLAYED_STEPS = 2

#: The verdicts, in the words the event, `status` and the docs use.
MISMATCH = "replay_mismatch"
REPRODUCIBLE = "reproducible_on_same_device"
INCONCLUSIVE = "inconclusive"
PERSISTENT = "persistent_mismatch"
ELSEWHERE = "reproducible_on_other_device"
#: The verdicts that blame the hardware.
HARDWARE = frozenset({MISMATCH, PERSISTENT})


class CheckpointLike(Protocol):
    id: str
    step: int
    tiers: Any


@dataclass(frozen=True)
class ReplaySettings:
    """The policy's `monitor.replay`, as the training side uses it."""

    enabled: bool = False
    max_steps: int = 50
    when: frozenset[str] = frozenset({"non_finite", "spike"})
    budget_seconds: float = 300.0
    other_device: bool = True

    @classmethod
    def of(cls, spec: Any) -> ReplaySettings:
        """From the policy's `monitor.replay` section (any object with those attributes; None: off)."""
        if spec is None:
            return cls()
        return cls(
            bool(spec.enabled),
            int(spec.max_steps),
            frozenset(spec.when),
            float(spec.budget_seconds),
            bool(getattr(spec, "other_device", True)),
        )


def same_bits(a: float | None, b: float | None) -> bool:
    """Equal bit for bit (as float64: a float32 value converts exactly); any NaN equals any NaN."""
    if a is None or b is None:
        return a is b
    if math.isnan(a) and math.isnan(b):
        return True
    return struct.pack("<d", a) == struct.pack("<d", b)


class Trail:
    """This rank's recent metric values by step, and when each step ended: what a replay is compared with."""

    def __init__(self, keep: int):
        self.keep = max(keep, 1) + 1
        self._steps: OrderedDict[int, tuple[dict[str, float], float]] = OrderedDict()

    def record(self, step: int, metrics: Mapping[str, float], now: float) -> None:
        for later in [s for s in self._steps if s >= step]:  # after a rollback: the old branch's steps go
            del self._steps[later]
        self._steps[step] = ({k: float(v) for k, v in metrics.items()}, now)
        while len(self._steps) > self.keep:
            self._steps.popitem(last=False)

    def values(self, metric: str, after: int, upto: int) -> dict[int, float]:
        """`metric`'s values at the steps in (after, upto] this rank still holds."""
        return {s: m[metric] for s, (m, _) in self._steps.items() if after < s <= upto and metric in m}

    def step_seconds(self) -> float | None:
        """The median time between the recent steps' ends (None before two steps)."""
        ends = [t for _, t in self._steps.values()]
        gaps = sorted(b - a for a, b in zip(ends, ends[1:], strict=False) if b >= a)
        return gaps[len(gaps) // 2] if gaps else None


@dataclass
class Replay:
    """A replay under way on this rank."""

    event: Event
    metric: str
    onset: int
    from_step: int
    expected: dict[int, float]
    started: float
    first_diff: int | None = None
    original: float | None = None
    replayed: float | None = None
    #: The second stage: the rank whose batches this rank computes (None: the first stage, its own).
    batches_of: int | None = None
    #: The second stage: (suspect, buddy), the first stage's verdict, and every rank's host and device.
    pair: tuple[int, int] | None = None
    first: Verdict | None = None
    hosts: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)

    @property
    def swapped(self) -> bool:
        return self.pair is not None


@dataclass(frozen=True)
class Local:
    """One rank's result at the onset: whether (and first where) its values differed."""

    differs: bool
    first_diff: int | None
    original: float | None
    replayed: float | None


@dataclass(frozen=True)
class Verdict:
    """What the replay showed, for every rank alike."""

    verdict: str
    metric: str
    onset_step: int
    from_step: int
    steps: int
    seconds: float
    original: float | None
    replayed: float | None
    first_diff_step: int | None = None
    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    device: str | None = None
    reason: str = ""
    #: 1: on the same device; 2: the suspect's batches on another rank's device.
    stage: int = 1
    #: The second stage: the rank whose device computed the suspect's batches, and the ranks whose computed
    #: values differed from what their batches' owners logged.
    other_rank: int | None = None
    differed: list[int] = field(default_factory=list)

    @property
    def hardware(self) -> bool:
        return self.verdict in HARDWARE

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Replayer:
    """Decides when to replay, remembers what to compare with, and judges the replay. One per rank."""

    def __init__(
        self,
        settings: ReplaySettings,
        *,
        rank: int = 0,
        host: str = "",
        device: str = "cpu",
        deterministic: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        swaps_batches: bool = False,
    ):
        self.settings, self.rank, self.host, self.device = settings, rank, host, device
        self._deterministic, self._clock = deterministic, clock
        #: Whether the driver hands a rank another rank's batch (`TrainingCore.batch_for_step`): the Session
        #: loop does; a framework's own loop does not, so it gets no second stage.
        self.swaps_batches = swaps_batches
        self.trail = Trail(settings.max_steps if settings.enabled else 1)
        self.active: Replay | None = None
        #: Rank 0: the first stage's snapshot (a second stage restores it again).
        self.snapshot: CheckpointLike | None = None
        self._done: set[tuple[str | None, int | None]] = set()

    def record(self, step: int, metrics: Mapping[str, float]) -> None:
        """Every step's metrics, on every rank (cheap: a few floats, `max_steps` steps kept); not the second
        stage's, which are another rank's batches."""
        if self.settings.enabled and not (self.active is not None and self.active.swapped):
            self.trail.record(step, metrics, self._clock())

    def wants(self, event: Event, step: int) -> str | None:
        """Why this anomaly is not replayed (None: it is, if a snapshot is near enough)."""
        s = self.settings
        if not s.enabled:
            return "replay is off"
        if event.type not in s.when:
            return f"monitor.replay.when does not list {event.type}"
        if event.metric is None or event.onset_step != step:
            return "its onset is not the step that just ended"
        if (event.metric, event.onset_step) in self._done:
            return "this onset was replayed already"
        return None

    def target(self, candidates: Iterable[CheckpointLike], onset: int) -> tuple[CheckpointLike | None, str]:
        """The newest snapshot in the memory ring at least MIN_REPLAYED_STEPS before `onset`, within `max_steps`
        and the time budget."""
        ring = [c for c in candidates if "memory" in c.tiers and c.step <= onset - MIN_REPLAYED_STEPS]
        near = [c for c in ring if onset - c.step <= self.settings.max_steps]
        if not near:
            held = f" (the newest is at step {max(c.step for c in ring)})" if ring else ""
            return None, f"no snapshot in the memory ring within {self.settings.max_steps} steps{held}"
        best = max(near, key=lambda c: (c.step, c.id))
        per_step = self.trail.step_seconds()
        if per_step is not None and per_step * (onset - best.step) > self.settings.budget_seconds:
            return None, (
                f"replaying {onset - best.step} steps would take about {per_step * (onset - best.step):.0f} s, "
                f"over monitor.replay.budget_seconds ({self.settings.budget_seconds:g})"
            )
        return best, ""

    def now(self) -> float:
        """This replayer's clock: pass its reading before the restore to `begin`, so a verdict's `seconds`
        counts the restore too."""
        return self._clock()

    def begin(self, event: Event, from_step: int, started: float | None = None) -> None:
        """The state is back at `from_step` (since `started`): replay up to the event's onset (this rank's own
        values)."""
        assert event.metric is not None and event.onset_step is not None
        self._done.add((event.metric, event.onset_step))
        expected = self.trail.values(event.metric, from_step, event.onset_step)
        began = self._clock() if started is None else started
        self.active = Replay(event, event.metric, event.onset_step, from_step, expected, began)

    def begin_named(
        self, metric: str, onset: int, from_step: int, event: Event, started: float | None = None
    ) -> None:
        """`begin` on a rank that did not see the event (under DDP rank 0 names metric and onset)."""
        self.begin(Event(**{**asdict(event), "metric": metric, "onset_step": onset}), from_step, started)

    # -- the second stage: the suspect's batches on another rank's device --------------------------

    def pair_for(self, event: Event, world_size: int, first: Verdict) -> tuple[tuple[int, int] | None, str]:
        """(suspect, buddy) for the second stage: the one rank that saw `event` and the next one; else None and
        why not (the policy asks for none, no other rank, several ranks saw it, the driver cannot swap batches,
        or the first stage alone took the whole time budget)."""
        seen = event.evidence.get("seen_by") or [event.evidence.get("seen_on_rank", 0)]
        if not self.settings.other_device:
            return None, "monitor.replay.other_device is off"
        if world_size < 2:
            return None, "there is no other rank's device"
        if not self.swaps_batches:
            return None, "this training loop cannot hand a rank another rank's batches (the Session loop can)"
        if len(seen) > 1:
            return None, (
                f"ranks {sorted(seen)} all saw it at the onset: the damage had reached them through a collective, "
                "so no one rank's batches can be moved away from it"
            )
        if first.seconds > self.settings.budget_seconds:
            return None, (
                f"the first stage took {first.seconds:.0f} s, over monitor.replay.budget_seconds "
                f"({self.settings.budget_seconds:g}), and the second would take as long"
            )
        suspect = int(seen[0]) % world_size
        return (suspect, (suspect + 1) % world_size), ""

    def window(self, metric: str, from_step: int, onset: int) -> list[float]:
        """This rank's logged values of steps (from_step, onset], as (present, value) pairs: what another
        rank computing this rank's batches is compared with (a gather of floats carries them)."""
        held = self.trail.values(metric, from_step, onset)
        return [
            x for s in range(from_step + 1, onset + 1) for x in ((1.0, held[s]) if s in held else (0.0, 0.0))
        ]

    def begin_elsewhere(
        self,
        first: Verdict,
        event: Event,
        pair: tuple[int, int],
        windows: Sequence[Sequence[float]],
        hosts: Sequence[str] = (),
        devices: Sequence[str] = (),
        started: float | None = None,
    ) -> int:
        """The state is back at the first stage's snapshot: replay its steps with the pair's batches swapped.
        `windows`: every rank's `window`; `hosts`, `devices`: every rank's, by rank. Returns the rank whose
        batches this rank computes."""
        suspect, buddy = pair
        batches_of = {suspect: buddy, buddy: suspect}.get(self.rank, self.rank)
        steps = range(first.from_step + 1, first.onset_step + 1)
        row = windows[batches_of]
        expected = {s: row[2 * i + 1] for i, s in enumerate(steps) if row[2 * i] == 1.0}
        began = self._clock() if started is None else started
        self.active = Replay(
            event,
            first.metric,
            first.onset_step,
            first.from_step,
            expected,
            began,
            batches_of=batches_of,
            pair=pair,
            first=first,
            hosts=list(hosts),
            devices=list(devices),
        )
        return batches_of

    def observe(self, step: int, metrics: Mapping[str, float]) -> Local | None:
        """A replayed step ended: compare; at the onset, this rank's result (None before)."""
        r = self.active
        if r is None:
            return None
        value = metrics.get(r.metric)
        value = None if value is None else float(value)
        if step in r.expected and not same_bits(r.expected[step], value) and r.first_diff is None:
            r.first_diff = step
        if step < r.onset:
            return None
        r.original, r.replayed = r.expected.get(r.onset), value
        return Local(r.first_diff is not None, r.first_diff, r.original, r.replayed)

    def abandon(self) -> None:
        """Another anomaly (or a stop) came first: no verdict."""
        self.active = None

    def conclude_elsewhere(self, rows: Sequence[Local]) -> Verdict:
        """The second stage's verdict from every rank's result (rank i compared the values it computed for
        the batches of the rank it swapped with, or its own), the same on every rank."""
        r = self.active
        assert r is not None and r.pair is not None and r.first is not None
        self.active = None
        suspect, buddy = r.pair
        hosts, devices = r.hosts, r.devices
        differed = [i for i, row in enumerate(rows) if row.differs]
        moved = rows[buddy]  # the suspect's batches, computed on the buddy's device
        common = {
            "metric": r.metric,
            "onset_step": r.onset,
            "from_step": r.from_step,
            "steps": r.onset - r.from_step,
            "seconds": self._clock() - r.started,
            "original": moved.original,
            "replayed": moved.replayed,
            "first_diff_step": moved.first_diff,
            "ranks": [suspect],
            "hosts": [hosts[suspect]] if suspect < len(hosts) else [],
            "device": devices[suspect] if suspect < len(devices) else None,
            "stage": 2,
            "other_rank": buddy,
            "differed": differed,
        }
        on = lambda i: f"rank {i}" + (f" on {hosts[i]}" if i < len(hosts) else "")  # noqa: E731
        span = (
            f"steps {r.from_step + 1}-{r.onset} replayed again with the batches of {on(suspect)} computed on "
            f"{on(buddy)}'s device ({devices[buddy] if buddy < len(devices) else '?'})"
        )
        outside = [i for i in differed if i not in r.pair]
        cuda = any(d.startswith("cuda") for d in devices)
        if moved.differs and (outside or (cuda and not self._deterministic())):
            why = (
                f"ranks {outside} outside the swapped pair differed too: the gradient reduction added the "
                "same numbers in another order"
                if outside
                else "CUDA kernels may be nondeterministic (torch.use_deterministic_algorithms is off)"
            )
            return Verdict(
                INCONCLUSIVE,
                reason=f"{span}: {r.metric} differed, but {why}; so the policy's rule applies",
                **common,
            )
        if not moved.differs and rows[suspect].differs:
            return Verdict(
                INCONCLUSIVE,
                reason=f"{span}: {r.metric} came out the same for the batches of {on(suspect)} elsewhere, but its "
                f"device computed those of {on(buddy)} differently: neither the data nor the device alone; so "
                "the policy's rule applies",
                **common,
            )
        if moved.differs:
            return Verdict(
                PERSISTENT,
                reason=f"{span}: {r.metric} differed first at step {moved.first_diff} ({moved.original!r} logged, "
                f"{moved.replayed!r} elsewhere): {on(suspect)}'s device ({common['device']}) computes them "
                "wrongly every time, a faulty device; every rank stops for the supervisor to relaunch away "
                "from it",
                **common,
            )
        return Verdict(
            ELSEWHERE,
            reason=f"{span}: {r.metric} came out the same, bit for bit: the data or the optimisation, not the "
            "device, so the policy's rule applies",
            **common,
        )

    def conclude(self, rows: Sequence[Local], hosts: Sequence[str] | None = None) -> Verdict:
        """Every rank's result (alone: this rank's) -> the verdict, the same on every rank."""
        r = self.active
        assert r is not None
        self.active = None
        differing = [(i, row) for i, row in enumerate(rows) if row.differs]
        first = min((row.first_diff for _, row in differing if row.first_diff is not None), default=None)
        ranks = [i for i, row in differing if row.first_diff == first]
        shown = rows[ranks[0]] if ranks else rows[0]  # the first rank that parted, else rank 0
        # Every rank parting at once: the damage reached them all through a collective (a gradient all-reduce,
        # FSDP's all-gather of a shard) before any value showed it; no rank, so no host, can be blamed.
        everyone = len(rows) > 1 and len(ranks) == len(rows)
        common = {
            "metric": r.metric,
            "onset_step": r.onset,
            "from_step": r.from_step,
            "steps": r.onset - r.from_step,
            "seconds": self._clock() - r.started,  # the restore and the replayed steps
            "original": shown.original,
            "replayed": shown.replayed,
            "first_diff_step": first,
            "ranks": ranks,
            "hosts": [] if everyone else [hosts[i] for i in ranks if hosts is not None and i < len(hosts)],
            "device": self.device,
        }
        span = f"steps {r.from_step + 1}-{r.onset} replayed from the snapshot at step {r.from_step}"
        if not differing:
            return Verdict(
                REPRODUCIBLE,
                reason=f"{span}: {r.metric} came out the same, bit for bit: data or optimisation (or a device "
                "wrong every time), so the policy's rule applies",
                **common,
            )
        where = ", ".join(
            f"rank {i}" + (f" on {hosts[i]}" if hosts is not None and i < len(hosts) else "") for i in ranks
        )
        if everyone:
            where = (
                "every rank at once: the damage reached them all through a collective before any value showed "
                "it, so no rank or host is named"
            )
        if self.device.startswith("cuda") and not self._deterministic():
            return Verdict(
                INCONCLUSIVE,
                reason=f"{span}: {r.metric} differed first at step {first} ({where}), but CUDA kernels may be "
                "nondeterministic (torch.use_deterministic_algorithms is off), so the policy's rule applies",
                **common,
            )
        return Verdict(
            MISMATCH,
            reason=f"{span}: {r.metric} differed first at step {first} ({where}; {self.device}): the first run "
            "computed it wrongly, a transient hardware fault; training goes on from the replayed state",
            **common,
        )


def hardware_event(
    verdict: Verdict, original: Event, wall_time: float, earlier: Sequence[Verdict] = ()
) -> Event:
    """The `hardware_fault` a mismatch is: evidence `replay_mismatch` (or `persistent_mismatch`), naming the
    ranks, hosts and device; `stages` holds every stage's verdict and cost, `earlier` ones first."""
    return Event(
        type="hardware_fault",
        reason=verdict.reason,
        metric=verdict.metric,
        onset_step=verdict.first_diff_step or verdict.onset_step,
        step=verdict.onset_step,
        value=verdict.original,
        wall_time=wall_time,
        source="in_process",
        evidence={
            "evidence": verdict.verdict,
            "ranks": verdict.ranks,
            "hosts": verdict.hosts,
            "device": verdict.device,
            "anomaly": original.type,
            "replay": verdict.to_dict(),
            "stages": [v.to_dict() for v in (*earlier, verdict)],
        },
    )


def with_verdict(event: Event, verdict: Verdict, earlier: Sequence[Verdict] = ()) -> Event:
    """The original anomaly with the replay's verdict (and every stage's) in its evidence (the rule then
    applies to it)."""
    stages = [v.to_dict() for v in (*earlier, verdict)]
    return Event(
        **{**asdict(event), "evidence": {**event.evidence, "replay": verdict.to_dict(), "stages": stages}}
    )
