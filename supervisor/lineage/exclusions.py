"""Hosts a lineage relaunches away from: which hosts an event blames, and whether excluding them leaves enough.

Pure: an event, the hosts its segment ran on and what the launcher can place a segment on, in; entries out.
The decision step owns the list in the lineage record (`excluded_hosts`, and `not_excluded` for the hosts it
kept); each launcher reads it from `LaunchSpec.exclude_hosts` (SLURM `--exclude`, a Kubernetes node
anti-affinity, a multi-node follower that refuses to run).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from supervisor.events import Event

#: Event types that exclude the host they blame whatever the decision is (the lineage may be resumed later).
HARDWARE_EVENTS = frozenset({"hardware_fault"})
#: Event types that exclude their host only when the decision relaunches (a straggler rule's resume/rollback).
RELAUNCH_EVENTS = frozenset({"straggler"})
#: Evidence keys that name the hosts an event blames, most specific first.
HOST_KEYS = ("hosts", "host", "k8s_node")


@dataclass(frozen=True)
class HostPool:
    """What a launcher can place a segment on: how many hosts a segment needs, and which hosts it may use."""

    needed: int = 1
    """Hosts one segment runs on (SLURM `nodes`, torchrun's nodes, pods of a Kubernetes Job)."""
    hosts: tuple[str, ...] | None = None
    """Every host the launcher may use; None when it cannot tell (then an exclusion is always taken)."""
    why: str = ""
    """Why the pool is what it is, for a refusal: "the local launcher runs on this machine only"."""
    aliases: Mapping[str, str] = field(default_factory=dict)
    """Other names of its hosts, to the name the launcher uses: a SLURM node's hostname (what a training process
    names itself by) where it differs from the node's name."""


@dataclass(frozen=True)
class Exclusion:
    """One host an event blamed: excluded from the next launches, or (`excluded` False) kept, and why."""

    host: str
    reason: str
    event: str
    segment: int | None
    time: float
    excluded: bool = True

    def to_dict(self) -> dict[str, Any]:
        """The record's entry: {host, reason, event, segment, time}."""
        out = asdict(self)
        del out["excluded"]
        return out


def blames(event: Event, relaunches: bool) -> bool:
    """Whether `event` (with a decision that relaunches or not) sends the lineage away from its host."""
    return event.type in HARDWARE_EVENTS or (event.type in RELAUNCH_EVENTS and relaunches)


def named_hosts(evidence: Mapping[str, Any]) -> list[str]:
    """The hosts an event's evidence names (a replay mismatch's `hosts`, a straggler's `host`, a lost pod's node)."""
    for key in HOST_KEYS:
        value = evidence.get(key)
        found = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        hosts = _unique(h for h in found if isinstance(h, str) and h)
        if hosts:
            return hosts
    return []


def exclusions_from(
    event: Event, segment_hosts: Sequence[str], *, segment: int | None, time: float
) -> list[Exclusion]:
    """The hosts `event` blames: those its evidence names, else the one host its segment ran on.

    A segment that ran on several hosts, for an event that names none (an Xid line in a merged log), gives one
    entry that is not excluded and says why: excluding every host would be a guess.
    """
    reason = f"{event.type}: {event.reason}"[:300]
    hosts = named_hosts(event.evidence)
    if not hosts and len(_unique(segment_hosts)) == 1:
        hosts = _unique(segment_hosts)
    if hosts:
        return [Exclusion(h, reason, event.type, segment, time) for h in hosts]
    ran_on = _unique(segment_hosts)
    if not ran_on:
        return []
    why = (
        f"not excluded: the event names no host and segment {segment} ran on {len(ran_on)} hosts "
        f"({', '.join(ran_on[:8])}{', ...' if len(ran_on) > 8 else ''})"
    )
    return [Exclusion(", ".join(ran_on[:8]), why, event.type, segment, time, excluded=False)]


def admit(candidates: Iterable[Exclusion], current: Iterable[str], pool: HostPool) -> list[Exclusion]:
    """The candidates to record: each excluded, or kept with "not excluded: <why>" where the launcher does not
    know the host or excluding it would leave fewer hosts than a segment needs. Hosts already excluded are left
    out; a full name whose short form the launcher knows (`gpu7.cluster` for `gpu7`), or a hostname it knows as
    a node's (`HostPool.aliases`), is recorded under the launcher's name."""
    excluded = set(current)
    out: list[Exclusion] = []
    for cand in candidates:
        if not cand.excluded:
            out.append(cand)
            continue
        host, why = placeable(cand.host, excluded, pool)
        if host in excluded:
            continue
        if why is not None:
            out.append(Exclusion(host, why, cand.event, cand.segment, cand.time, excluded=False))
            continue
        excluded.add(host)
        out.append(Exclusion(host, cand.reason, cand.event, cand.segment, cand.time))
    return out


def placeable(host: str, excluded: set[str], pool: HostPool) -> tuple[str, str | None]:
    """(the launcher's name for `host`, why it must stay usable: "not excluded: ..." or None when it may go)."""
    if pool.hosts is None:
        return host, None
    hosts = set(pool.hosts)
    if host not in hosts:
        short = host.split(".")[0]
        host = pool.aliases.get(host) or pool.aliases.get(short) or (short if short in hosts else host)
    said = f"; {pool.why}" if pool.why else ""
    if host not in hosts:
        known = ", ".join(sorted(hosts)[:8]) + (", ..." if len(hosts) > 8 else "")
        return host, f"not excluded: {host} is not a host this launcher places segments on ({known}){said}"
    left = len(hosts - excluded - {host})
    if left >= pool.needed:
        return host, None
    return host, (
        f"not excluded: excluding {host} would leave {left} of the {len(hosts)} host(s) this launcher can use, "
        f"and a segment needs {pool.needed}{said}"
    )


def excluded_names(entries: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The host names of the record's `excluded_hosts` entries, in order, once each."""
    return tuple(_unique(str(e.get("host")) for e in entries if isinstance(e, Mapping) and e.get("host")))


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))
