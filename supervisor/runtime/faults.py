"""Fault drill: `ROLLBACK_SUPERVISOR_FAULTS=nan@300,spike@500,kill@700,...` injects real faults.

Each fault fires once per lineage: it is recorded as fired (durably) *before* it fires, so the relaunched
segment does not fire it again. The exceptions are `sdc_persistent`, a device that is wrong every time, and
`bad_batch`, a batch that is bad wherever it is computed: never recorded, they fire on every run of their step
(a replay or a relaunch included), the first on its rank's process, the second on the process that computes
its rank's batch (the replay's second stage moves batches between ranks).
`nan`, `spike` and `sdc` damage the model for real through optimizer hooks. Under torchrun a fault fires on
every rank, or on one rank with a `:rankN` suffix (`kill@40:rank1` kills rank 1 only); each rank keeps its own
fired set (`faults-fired.json` on rank 0, `faults-fired.rankN.json`). `slow` takes its sleep as a last
qualifier (`slow@40:rank1:0.5s`; 0.2 s by default).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.errors import UserError

if TYPE_CHECKING:  # torch is imported where a fault fires: parsing a drill (the supervisor's side) needs none
    import torch

FAULTS_ENV = "ROLLBACK_SUPERVISOR_FAULTS"

#: kind -> what it does
KINDS = {
    "nan": "poisons the gradients with NaN before the optimizer step (weights become NaN)",
    "spike": "runs one optimizer step at a huge learning rate (a real loss spike)",
    "kill": "SIGKILLs the training process (a node vanishing)",
    "term": "SIGTERMs the training process (a preemption notice)",
    "hang": "stops making progress (sleeps) without exiting",
    "hw": "writes an NVIDIA Xid line to stderr and exits (a GPU falling off the bus)",
    "oom": "raises torch.OutOfMemoryError with CUDA's message",
    "exc": "raises a RuntimeError from user code (a software bug)",
    "sdc": "flips the top exponent bit of one parameter element after the optimizer step, once (silent data "
    "corruption: a replay of the step gives a different value)",
    "sdc_persistent": "flips that same bit on every run of the step on this rank, never recorded as fired "
    "(a persistently faulty device: a replay here reproduces it, another rank's does not)",
    "bad_batch": "poisons with NaN the gradients of whichever rank computes rank N's batch of the step, on "
    "every run, never recorded as fired (a bad batch: a replay anywhere reproduces it)",
    "slow": "sleeps after every step from this one until the segment ends, 0.2 s or :SECONDSs (a straggler)",
    "stuck": "blocks this rank before the step's agreement all_reduce, inside which the other ranks wait "
    "(a stuck collective; alone, a hang)",
}
#: Kinds fired on every run of their step, never recorded as fired.
PERSISTENT = frozenset({"sdc_persistent", "bad_batch"})
SDC_KINDS = ("sdc", "sdc_persistent")
#: Kinds that follow the data, not the process: `:rankN` names the rank whose batch it is (see `data_rank`).
DATA_KINDS = frozenset({"bad_batch"})
#: Faults fired after the step's metrics were logged.
PROCESS_KINDS = ("kill", "term", "hang", "hw", "oom", "exc", "stuck")
#: The sleep per step of a `slow` fault that names none.
SLOW_SECONDS = 0.2
_SECONDS = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)s")
GRAMMAR = "KIND@STEP, KIND@STEP:rankN, or for slow KIND@STEP[:rankN][:SECONDSs] (e.g. slow@40:rank1:0.5s)"
SPIKE_LR_FACTOR = 300.0
XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python, GPU has fallen off the bus."


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank
    seconds: float | None = None  # slow only: the sleep per step (None: SLOW_SECONDS)

    @property
    def key(self) -> str:
        rank = "" if self.rank is None else f":rank{self.rank}"
        return f"{self.kind}@{self.step}{rank}" + ("" if self.seconds is None else f":{self.seconds:g}s")

    @property
    def persistent(self) -> bool:
        """Fires on every run of its step (never recorded as fired)."""
        return self.kind in PERSISTENT


def parse_faults(spec: str | None) -> list[Fault]:
    """Parse `kind@step[:rankN][:SECONDSs],...`; raise UserError naming the bad item and what was wrong."""
    return [_parse_item(item.strip()) for item in (spec or "").split(",") if item.strip()]


def _parse_item(item: str) -> Fault:
    def bad(found: str) -> UserError:
        return UserError(
            f"{FAULTS_ENV}: item {item!r}: {found}; expected {GRAMMAR}, with KIND one of {', '.join(KINDS)}, "
            "STEP a positive integer and N a rank"
        )

    head, *qualifiers = item.split(":")
    kind, sep, step = head.partition("@")
    if not sep:
        raise bad("no @STEP")
    if kind not in KINDS:
        raise bad(f"unknown kind {kind!r}")
    if not step.isdigit() or int(step) < 1:
        raise bad(f"step {step!r} is not a positive integer")
    rank: int | None = None
    seconds: float | None = None
    for qualifier in qualifiers:
        if qualifier.startswith("rank"):
            if not qualifier[4:].isdigit():
                raise bad(f"{qualifier!r} is not rankN")
            if rank is not None or seconds is not None:
                raise bad(f"{qualifier!r} comes too late: one rankN, right after the step")
            rank = int(qualifier[4:])
        elif _SECONDS.fullmatch(qualifier):
            if kind != "slow":
                raise bad(f"only slow takes a sleep, and {kind} got {qualifier!r}")
            if seconds is not None:
                raise bad(f"a second sleep {qualifier!r}")
            seconds = float(qualifier[:-1])
            if seconds <= 0:
                raise bad(f"the sleep {qualifier!r} is not a positive number of seconds")
        else:
            sleep = " or a sleep such as 0.5s" if kind == "slow" else ""
            raise bad(f"{qualifier!r} is not rankN{sleep}")
    return Fault(kind, int(step), rank, seconds)


def fired_path_for(path: Path, rank: int) -> Path:
    """Where rank `rank` records its fired faults (rank 0 keeps the single-process name)."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class FaultInjector:
    """Fires the configured faults at their steps, once per lineage (fired set kept in `fired_path`).

    `sleep` is how `slow`, `hang` and `stuck` wait (tests inject one). Not thread-safe: the training thread
    calls it, from the step's end and the optimizers' step hooks.
    """

    def __init__(
        self,
        faults: list[Fault],
        fired_path: Path,
        rank: int = 0,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.faults = [f for f in faults if f.rank is None or f.rank == rank or f.kind in DATA_KINDS]
        self.fired_path = fired_path_for(fired_path, rank)
        self.rank = rank
        #: The rank whose batches this process computes (its own but in a replay's second stage).
        self.data_rank = rank
        self._sleep = sleep
        self._fired: set[str] | None = None  # read on first use: no I/O when the injector is built
        self._saved_lrs: list[list[float]] | None = None
        self._flip: tuple[torch.Tensor, int] | None = None  # an sdc's element, flipped after the update
        self._sdc_step: int | None = None  # the step whose sdc already fired (one flip per run of a step)
        self._slow_s: float | None = None  # a `slow` fault's sleep per step, once it started

    @property
    def fired(self) -> set[str]:
        """The faults of this lineage that already fired (on this rank)."""
        if self._fired is None:
            path = self.fired_path
            self._fired = set(json.loads(path.read_text())) if path.exists() else set()
        return self._fired

    @classmethod
    def from_env(cls, fired_path: Path, rank: int = 0) -> FaultInjector:
        return cls(parse_faults(os.environ.get(FAULTS_ENV)), fired_path, rank)

    def due(self, step: int, kinds: tuple[str, ...]) -> Fault | None:
        for fault in self.faults:
            if (
                fault.step == step
                and fault.kind in kinds
                and (fault.persistent or fault.key not in self.fired)
                and (fault.kind not in DATA_KINDS or fault.rank is None or fault.rank == self.data_rank)
            ):
                return fault
        return None

    def _mark(self, fault: Fault) -> None:
        """Record `fault` as fired (durably, before it fires; a persistent one never) and say so."""
        if not fault.persistent:
            self.fired.add(fault.key)
            tmp = self.fired_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(sorted(self.fired)))
            with open(tmp) as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, self.fired_path)
        print(
            f"[rollback-supervisor] fault drill: injecting {fault.key} on rank {self.rank}: {KINDS[fault.kind]}",
            file=sys.stderr,
            flush=True,
        )

    def before_optimizer_step(self, step: int, optimizers: list[torch.optim.Optimizer]) -> None:
        self._arm_sdc(step, optimizers)
        fault = self.due(step, ("nan", "spike", "bad_batch"))
        if fault is None:
            return
        self._mark(fault)
        if fault.kind in ("nan", "bad_batch"):
            for opt in optimizers:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            p.grad.fill_(float("nan"))
        else:
            self._saved_lrs = [[g["lr"] for g in opt.param_groups] for opt in optimizers]
            for opt in optimizers:
                for g in opt.param_groups:
                    g["lr"] = g["lr"] * SPIKE_LR_FACTOR

    def _arm_sdc(self, step: int, optimizers: list[torch.optim.Optimizer]) -> None:
        """Pick the element an sdc fault flips once the update is applied (`_largest_gradient`)."""
        if self._sdc_step == step:
            return  # a second optimizer of the same step
        fault = self.due(step, SDC_KINDS)
        target = _largest_gradient(optimizers) if fault is not None else None
        if fault is None or target is None:
            return
        self._mark(fault)
        self._sdc_step, self._flip = step, target

    def after_optimizer_step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._flip is not None:
            flip_top_exponent_bit(*self._flip)
            self._flip = None
        if self._saved_lrs is not None:
            for opt, lrs in zip(optimizers, self._saved_lrs, strict=True):
                for g, lr in zip(opt.param_groups, lrs, strict=True):
                    g["lr"] = lr
            self._saved_lrs = None

    def after_step(self, step: int) -> None:
        """Process-level faults, fired after the step's metrics were logged (under DDP, before the step's
        agreement all_reduce: a rank that sleeps here keeps the others waiting inside it)."""
        self._sdc_step = None  # the next run of any step may flip again (a replay of a persistent fault)
        slow = self.due(step, ("slow",))
        if slow is not None:
            self._mark(slow)
            self._slow_s = slow.seconds if slow.seconds is not None else SLOW_SECONDS
        if self._slow_s is not None:
            self._sleep(self._slow_s)
        fault = self.due(step, PROCESS_KINDS)
        if fault is None:
            return
        self._mark(fault)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind in ("hang", "stuck"):
            while True:  # alive, silent, no progress; under DDP every other rank waits in the next collective
                self._sleep(3600)
        elif fault.kind == "hw":
            print(XID_LINE.format(pid=os.getpid()), file=sys.stderr, flush=True)
            print("RuntimeError: CUDA error: unspecified launch failure", file=sys.stderr, flush=True)
            os._exit(1)
        elif fault.kind == "oom":
            import torch

            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
                "of which 1.12 GiB is free. (injected by the fault drill)"
            )
        elif fault.kind == "exc":
            raise RuntimeError(f"injected software error at step {step} (fault drill)")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _largest_gradient(optimizers: list[torch.optim.Optimizer]) -> tuple[torch.Tensor, int] | None:
    """The parameter element with the largest gradient, preferring parameters whose every element has one.

    A dense gradient means every element took part in this step (an embedding's unused rows have none), so
    the next step's loss depends on the element too.
    """
    import torch

    best: tuple[tuple[bool, float], torch.Tensor, int] | None = None
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None or not p.is_floating_point() or _local(p).numel() == 0:
                    continue
                size = _local(p.grad).detach().abs().flatten()
                largest, index = torch.max(size, 0)
                key = (bool(size.min() > 0), float(largest))
                if best is None or key > best[0]:
                    best = (key, _local(p.detach()), int(index))
    return None if best is None else best[1:]


def flip_top_exponent_bit(tensor: torch.Tensor, index: int) -> None:
    """Flip the highest exponent bit of element `index` (flat) of a floating `tensor`, in place.

    For a value below 2 in magnitude that multiplies it by 2**128 (float32): one bit, a loud result.
    """
    import torch

    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), tensor.shape))
    element = tensor[where]  # a view: integer indices, not a tensor index (which would copy)
    word = element.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])
    word.bitwise_xor_(1 << (8 * tensor.element_size() - 2))
