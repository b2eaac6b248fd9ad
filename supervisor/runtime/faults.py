"""Fault drill: `ROLLBACK_SUPERVISOR_FAULTS=nan@300,spike@500,kill@700,...` injects real faults.

Each fault fires once per lineage: it is recorded as fired (durably) *before* it fires, so the relaunched
segment does not fire it again. `nan` and `spike` damage the model for real through an optimizer hook.
Under torchrun a fault fires on every rank, or on one rank with a `:rankN` suffix (`kill@40:rank1` kills
rank 1 only); each rank keeps its own fired set (`faults-fired.json` on rank 0, `faults-fired.rankN.json`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from supervisor.errors import UserError

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
}
SPIKE_LR_FACTOR = 300.0
XID_LINE = "NVRM: Xid (PCI:0000:3b:00): 79, pid={pid}, name=python, GPU has fallen off the bus."


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None  # None: every rank

    @property
    def key(self) -> str:
        return f"{self.kind}@{self.step}" + ("" if self.rank is None else f":rank{self.rank}")


def parse_faults(spec: str | None) -> list[Fault]:
    """Parse `kind@step[:rankN],...`; raise UserError naming the bad item."""
    faults = []
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        head, _, target = item.partition(":")
        kind, sep, step = head.partition("@")
        rank = target.removeprefix("rank")
        if (
            not sep
            or kind not in KINDS
            or not step.isdigit()
            or int(step) < 1
            or (target and (not target.startswith("rank") or not rank.isdigit()))
        ):
            raise UserError(
                f"{FAULTS_ENV}: item {item!r}: expected KIND@STEP or KIND@STEP:rankN with KIND one of "
                f"{', '.join(KINDS)}, STEP a positive integer and N a rank"
            )
        faults.append(Fault(kind, int(step), int(rank) if target else None))
    return faults


def fired_path_for(path: Path, rank: int) -> Path:
    """Where rank `rank` records its fired faults (rank 0 keeps the single-process name)."""
    path = Path(path)
    return path if rank == 0 else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class FaultInjector:
    """Fires the configured faults at their steps, once per lineage (fired set kept in `fired_path`)."""

    def __init__(self, faults: list[Fault], fired_path: Path, rank: int = 0):
        self.faults = [f for f in faults if f.rank is None or f.rank == rank]
        self.fired_path = fired_path_for(fired_path, rank)
        self._fired: set[str] | None = None  # read on first use: no I/O when the injector is built
        self._saved_lrs: list[list[float]] | None = None

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
            if fault.step == step and fault.kind in kinds and fault.key not in self.fired:
                return fault
        return None

    def _mark(self, fault: Fault) -> None:
        self.fired.add(fault.key)
        tmp = self.fired_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(self.fired)))
        with open(tmp) as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, self.fired_path)
        print(
            f"[rollback-supervisor] fault drill: injecting {fault.key}: {KINDS[fault.kind]}",
            file=sys.stderr,
            flush=True,
        )

    def before_optimizer_step(self, step: int, optimizers: list[torch.optim.Optimizer]) -> None:
        fault = self.due(step, ("nan", "spike"))
        if fault is None:
            return
        self._mark(fault)
        if fault.kind == "nan":
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

    def after_optimizer_step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        if self._saved_lrs is not None:
            for opt, lrs in zip(optimizers, self._saved_lrs, strict=True):
                for g, lr in zip(opt.param_groups, lrs, strict=True):
                    g["lr"] = lr
            self._saved_lrs = None

    def after_step(self, step: int) -> None:
        """Process-level faults, fired after the step's metrics were logged."""
        fault = self.due(step, ("kill", "term", "hang", "hw", "oom", "exc"))
        if fault is None:
            return
        self._mark(fault)
        if fault.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif fault.kind == "hang":
            while True:  # a hang: alive, silent, no progress
                time.sleep(3600)
        elif fault.kind == "hw":
            print(XID_LINE.format(pid=os.getpid()), file=sys.stderr, flush=True)
            print("RuntimeError: CUDA error: unspecified launch failure", file=sys.stderr, flush=True)
            os._exit(1)
        elif fault.kind == "oom":
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB "
                "of which 1.12 GiB is free. (injected by the fault drill)"
            )
        elif fault.kind == "exc":
            raise RuntimeError(f"injected software error at step {step} (fault drill)")
