"""Retention: small pure policies composed with `|`; each deletion comes with its reason."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from supervisor.checkpoint.options import CheckpointInfo


class RetentionPolicy:
    """Decides which checkpoints to keep; combine with `|` (keep what any policy keeps)."""

    def keeps(self, infos: Sequence[CheckpointInfo], *, abandoned: bool = False) -> set[str]:
        """Ids this policy keeps among `infos` (sorted by seq; all abandoned when `abandoned`)."""
        raise NotImplementedError

    def why_not(self, info: CheckpointInfo) -> str:
        """Why this policy does not keep `info` (empty when it has nothing to say)."""
        return ""

    def __or__(self, other: RetentionPolicy) -> AnyOf:
        return AnyOf(self, other)


@dataclass(frozen=True)
class KeepLast(RetentionPolicy):
    """Keep the newest `k` commits, and the newest `k` healthy ones.

    Unhealthy checkpoints (non-finite state) never count toward the `k` healthy ones, so a run that keeps
    saving NaN weights can never push its last good checkpoints out.
    """

    k: int

    def keeps(self, infos: Sequence[CheckpointInfo], *, abandoned: bool = False) -> set[str]:
        if abandoned:
            return set()
        ordered = sorted(infos, key=lambda i: i.seq)
        healthy = [i for i in ordered if i.healthy]
        return {i.id for i in ordered[-self.k :]} | {i.id for i in healthy[-self.k :]}

    def why_not(self, info: CheckpointInfo) -> str:
        return f"not among the last {self.k}" + ("" if info.healthy else " (and unhealthy)")


@dataclass(frozen=True)
class KeepBest(RetentionPolicy):
    """Keep the `k` best by `metric` ("min" or "max"), and always the newest commit."""

    metric: str
    mode: Literal["min", "max"] = "min"
    k: int = 1

    def keeps(self, infos: Sequence[CheckpointInfo], *, abandoned: bool = False) -> set[str]:
        if abandoned or not infos:
            return set()
        sign = 1.0 if self.mode == "min" else -1.0
        scored = [i for i in infos if _finite(i.metrics.get(self.metric))]
        best = sorted(scored, key=lambda i: (sign * i.metrics[self.metric], -i.seq))[: self.k]
        return {i.id for i in best} | {max(infos, key=lambda i: i.seq).id}

    def why_not(self, info: CheckpointInfo) -> str:
        value = info.metrics.get(self.metric)
        if not _finite(value):
            return f"no finite {self.metric}"
        return f"{self.metric}={value:.6g} not among the best {self.k} ({self.mode})"


@dataclass(frozen=True)
class KeepEvery(RetentionPolicy):
    """Keep every checkpoint whose step is a multiple of `n` (milestones)."""

    n: int

    def keeps(self, infos: Sequence[CheckpointInfo], *, abandoned: bool = False) -> set[str]:
        return set() if abandoned else {i.id for i in infos if i.step % self.n == 0}

    def why_not(self, info: CheckpointInfo) -> str:
        return f"step {info.step} is not a multiple of {self.n}"


@dataclass(frozen=True)
class KeepProtected(RetentionPolicy):
    """Keep the listed ids, abandoned or not (targets of a pending rollback)."""

    ids: frozenset[str]

    def __init__(self, ids: Iterable[str]):
        object.__setattr__(self, "ids", frozenset(ids))

    def keeps(self, infos: Sequence[CheckpointInfo], *, abandoned: bool = False) -> set[str]:
        return {i.id for i in infos if i.id in self.ids}


@dataclass(frozen=True)
class AnyOf(RetentionPolicy):
    """Keep what any of `policies` keeps."""

    policies: tuple[RetentionPolicy, ...]

    def __init__(self, *policies: RetentionPolicy):
        flat: list[RetentionPolicy] = []
        for p in policies:
            flat.extend(p.policies if isinstance(p, AnyOf) else (p,))
        object.__setattr__(self, "policies", tuple(flat))

    def keeps(self, infos: Sequence[CheckpointInfo], *, abandoned: bool = False) -> set[str]:
        return set().union(*(p.keeps(infos, abandoned=abandoned) for p in self.policies))

    def why_not(self, info: CheckpointInfo) -> str:
        return "; ".join(r for p in self.policies if (r := p.why_not(info)))


@dataclass(frozen=True)
class RetentionResult:
    """What to keep and, for each deletion, why; deletions list abandoned checkpoints first."""

    keep: tuple[CheckpointInfo, ...]
    delete: tuple[tuple[CheckpointInfo, str], ...]


def apply_retention(policy: RetentionPolicy | None, infos: Iterable[CheckpointInfo]) -> RetentionResult:
    """Apply `policy` to `infos`; the newest live commit is always kept, None keeps everything."""
    ordered = sorted(infos, key=lambda i: i.seq)
    if policy is None:
        return RetentionResult(tuple(ordered), ())
    live = [i for i in ordered if not i.abandoned]
    gone = [i for i in ordered if i.abandoned]
    kept = policy.keeps(live) | policy.keeps(gone, abandoned=True)
    if live:
        kept.add(live[-1].id)
    delete = [(i, "abandoned: on a branch that was rolled back") for i in gone if i.id not in kept]
    delete += [(i, policy.why_not(i) or "no policy keeps it") for i in live if i.id not in kept]
    return RetentionResult(tuple(i for i in ordered if i.id in kept), tuple(delete))


def policy_from_settings(
    keep_last: int | None = None,
    keep_best: Any = None,
    keep_every_steps: int | None = None,
    protected: Iterable[str] = (),
) -> RetentionPolicy | None:
    """Compose the policy a `checkpoint:` section asks for; None when it asks for none."""
    parts: list[RetentionPolicy] = []
    if keep_last:
        parts.append(KeepLast(keep_last))
    if keep_best is not None:
        if isinstance(keep_best, tuple | list):
            metric, mode, count = keep_best
        else:
            metric, mode, count = keep_best.metric, keep_best.mode, keep_best.count
        parts.append(KeepBest(metric, mode, count))
    if keep_every_steps:
        parts.append(KeepEvery(keep_every_steps))
    if not parts:
        return None
    protected = frozenset(protected)
    if protected:
        parts.append(KeepProtected(protected))
    return AnyOf(*parts)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)
