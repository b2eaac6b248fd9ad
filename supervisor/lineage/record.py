"""The lineage record as typed data: `LineageRecord` and its `SegmentRecord`s, one-to-one with lineage.json.

`from_dict(d).to_dict() == d` for every record this supervisor (or an older one) wrote: a key the source
did not have is left out again unless it was given a value since, and keys this version does not know are
kept in `extra` and written back as they were. Nested JSON the policy engine and the training side own
(events, decisions, restore specs, the history) stays plain JSON here; they are parsed where they are used.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from supervisor.lineage.exclusions import excluded_names

JsonDict = dict[str, Any]
_R = TypeVar("_R", bound="_JsonRecord")
_BOOKKEEPING = ("extra", "absent")


@dataclass
class _JsonRecord:
    """Known keys as fields, unknown keys in `extra`, and which known keys the source lacked in `absent`."""

    #: Keys written only once they hold a value (None means "never happened", not null).
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def _known(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls) if f.name not in _BOOKKEEPING}

    @classmethod
    def _decode(cls, key: str, value: Any) -> Any:
        return copy.deepcopy(value)

    @classmethod
    def from_dict(cls: type[_R], data: Mapping[str, Any]) -> _R:
        known = cls._known()
        values = {k: cls._decode(k, v) for k, v in data.items() if k in known}
        extra = {k: copy.deepcopy(v) for k, v in data.items() if k not in known}
        absent = frozenset(k for k in known if k not in data)
        for name in absent:
            f = known[name]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                values[name] = None  # a required key missing from an old or foreign record: left out again
        return cls(**values, extra=extra, absent=absent)

    def put(self, **values: Any) -> None:
        """Set fields, and write them from now on even where the source lacked them."""
        for name, value in values.items():
            setattr(self, name, value)
        self.absent = self.absent - values.keys()

    def to_dict(self) -> JsonDict:
        out: JsonDict = {}
        for name, f in self._known().items():
            value = getattr(self, name)
            if name in self.absent and value == _default(f):
                continue
            if name in self.OPTIONAL and value is None:
                continue
            out[name] = _encode(value)
        out.update(copy.deepcopy(self.extra))
        return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _encode(value: Any) -> Any:
    if isinstance(value, _JsonRecord):
        return value.to_dict()
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return copy.deepcopy(value)


@dataclass
class SegmentRecord(_JsonRecord):
    """One launch of the training command: where and how it ran, how it ended, and what was decided."""

    OPTIONAL: ClassVar[frozenset[str]] = frozenset({"save_failures", "stacks", "hosts", "warnings"})

    index: int
    started: float
    host: str = ""
    ended: float | None = None
    pid: int | None = None  #: the local launcher's process group (a detail of that launcher)
    pid_started: float | None = None  #: its start time: identifies it across PID reuse
    returncode: int | None = None
    signal_sent: int | None = None  #: the signal the supervisor sent to stop it
    restore: JsonDict = field(default_factory=dict)  #: the RestoreSpec it was launched with
    start_step: int | None = None  #: the heartbeat's step at launch
    last_step: int | None = None  #: the heartbeat's step at exit
    outcome: str | None = None  #: finished, stopped, interrupted, or the decision's action
    event: JsonDict | None = None  #: the Event that ended it
    decision: JsonDict | None = None  #: the Decision taken about that event
    in_process: list[JsonDict] = field(default_factory=list)  #: events.jsonl records handled in process
    save_failures: list[JsonDict] | None = None  #: checkpoint saves that failed while it ran
    stacks: JsonDict | None = None  #: every rank's Python stacks when it hung (`HangStacks.to_dict()`)
    hosts: list[str] | None = (
        None  #: the hosts it ran on, as its launcher saw them (SLURM's nodelist, pods' nodes)
    )
    #: {time, event, decision} of each event the supervisor's monitor saw and the policy only warned about
    warnings: list[JsonDict] | None = None
    extra: JsonDict = field(default_factory=dict, repr=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @property
    def running(self) -> bool:
        return self.ended is None

    def note_launch(self, details: Mapping[str, Any]) -> None:
        """Keep what the launcher says identifies the running segment (local: pid and its start time)."""
        known = self._known()
        for key, value in details.items():
            if key in known:
                setattr(self, key, value)
            else:
                self.extra[key] = value

    def launch_details(self) -> dict[str, Any]:
        """What the launcher recorded at launch (`note_launch`), with the segment's host and index."""
        return {
            **self.extra,
            "pid": self.pid,
            "pid_started": self.pid_started,
            "host": self.host,
            "index": self.index,
        }


@dataclass
class MlflowRef(_JsonRecord):
    """The MLflow run a lineage logs to."""

    tracking_uri: str
    experiment: str
    run_id: str
    extra: JsonDict = field(default_factory=dict, repr=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)


@dataclass
class LineageRecord(_JsonRecord):
    """Everything a supervisor needs to resume a lineage: its segments, budgets spent, run and next restore.

    Written by one lease holder at a time (see supervisor.lineage.store for the fencing); not thread-safe.
    """

    OPTIONAL: ClassVar[frozenset[str]] = frozenset(
        {"lease_token", "mlflow_previous", "excluded_hosts", "not_excluded"}
    )

    lineage: str
    status: str
    mlflow: MlflowRef
    version: int = 1
    created: float = 0.0
    updated: float = 0.0
    final_reason: str | None = None
    final_checkpoint: str | None = None
    command: list[str] = field(default_factory=list)
    policy: JsonDict = field(default_factory=dict)  #: {"path", "name"} of the policy last run
    storage: JsonDict = field(default_factory=dict)  #: {"checkpoints", "remote", "durable"} on this machine
    history: JsonDict = field(default_factory=dict)  #: the policy History (budgets spent), as JSON
    events_consumed: int = 0  #: events.jsonl records folded into the history so far
    events_offset: int = 0  #: the byte offset in this machine's events.jsonl after them
    next_restore: JsonDict = field(default_factory=dict)  #: the RestoreSpec of the next launch
    segments: list[SegmentRecord] = field(default_factory=list)
    lease_token: int | None = None  #: the fencing token of the last write
    mlflow_previous: list[JsonDict] | None = None  #: runs the lineage logged to before it moved
    #: Hosts the next launches avoid, each {host, reason, event, segment, time} (`lineage.exclusions`).
    excluded_hosts: list[JsonDict] | None = None
    #: Hosts an event blamed but that were kept, each as above with reason "not excluded: <why>".
    not_excluded: list[JsonDict] | None = None
    extra: JsonDict = field(default_factory=dict, repr=False)
    absent: frozenset[str] = field(default=frozenset(), repr=False, compare=False)

    @classmethod
    def _decode(cls, key: str, value: Any) -> Any:
        if key == "segments":
            return [SegmentRecord.from_dict(s) for s in value]
        if key == "mlflow":
            return MlflowRef.from_dict(value)
        return copy.deepcopy(value)

    def running_seconds(self) -> float:
        """How long its finished segments ran: the lineage's age for the failure rate, idle time left out."""
        return running_seconds(self.segments)

    def exclusions(self) -> tuple[str, ...]:
        """The hosts the next launches avoid (`excluded_hosts`), once each."""
        return excluded_names(self.excluded_hosts or [])


def running_seconds(segments: list[SegmentRecord] | list[JsonDict]) -> float:
    """How long the finished segments ran (typed or as JSON): the lineage's age, idle time left out."""
    total = 0.0
    for seg in segments:
        if isinstance(seg, SegmentRecord):
            ended, started = seg.ended, seg.started
        else:
            ended, started = seg.get("ended"), seg.get("started")
        if ended is not None:
            total += max(0.0, ended - started)
    return total


#: What the report views accept: the typed record, or its JSON (status shows records this version did not write).
RecordLike = LineageRecord | Mapping[str, Any]


def as_json(record: RecordLike) -> Mapping[str, Any]:
    """A record as its JSON: the views in supervisor.report read either a typed record or a dict."""
    return record.to_dict() if isinstance(record, LineageRecord) else record
