"""The lineage's durable record and the lease that guards it: take, read, write fenced, give back.

From `open` to `close` a LeaseKeeper thread renews the lease, so every wait of the supervisor holds it;
each launch and each record write first checks that it still does, and every write is fenced by the lease
token (see supervisor.lineage.store). Also the record's lifecycle: a new record, and a resumed one whose
interrupted segments are recovered. Not thread-safe apart from the keeper's own thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from supervisor.errors import LeaseHeldError
from supervisor.events import Event
from supervisor.layout import LineageLayout
from supervisor.lineage import Lease, LeaseKeeper, LineageRecord, LineageStore, MlflowRef, SegmentRecord
from supervisor.orchestrator.events_log import line_offset
from supervisor.runtime.plan import RestoreSpec

log = logging.getLogger("rollback_supervisor.orchestrator")


class LineageBook:
    """One lineage's record and lease (`record` is None until `open` has read or `adopt` has been given one)."""

    def __init__(
        self, layout: LineageLayout, *, ttl_seconds: float, owner: str = "", clock: Callable[[], float]
    ):
        self.layout = layout
        self.ttl_seconds = ttl_seconds
        self.owner = owner
        self.clock = clock
        self.lease: Lease | None = None
        self.keeper: LeaseKeeper | None = None
        self.stores: list[LineageStore] = []
        self.record: LineageRecord | None = None

    def open(self, wait_seconds: float = 0.0) -> LineageRecord | None:
        """Take the lease (a keeper renews it from now on) and read the record; None for a new lineage.

        On a failure after the lease is taken the caller must `close()`, which releases it.
        """
        self.layout.local.mkdir(parents=True, exist_ok=True)
        (self.layout.local / "segments").mkdir(exist_ok=True)
        self.stores = [LineageStore(self.layout.durable)]
        if self.layout.durable != str(self.layout.local):
            self.stores.append(LineageStore(str(self.layout.local)))  # a copy next to this machine's logs
        self.lease = Lease(
            self.layout.durable, ttl_seconds=self.ttl_seconds, owner=self.owner, clock=self.clock
        )
        self.lease.acquire(wait_seconds)
        self.keeper = LeaseKeeper(self.lease).start()
        raw = self._load()
        if raw is None:
            return None
        recorded = raw.get("lease_token", 0)
        if isinstance(recorded, int) and not isinstance(recorded, bool):
            self.lease.advance(recorded)  # a lease file lost meanwhile restarted its tokens low
        return LineageRecord.from_dict(raw)

    def _load(self) -> dict[str, Any] | None:
        for store in self.stores:
            raw = store.load()
            if raw is not None:
                return raw
        return None

    def adopt(self, record: LineageRecord) -> None:
        """Make `record` the one `save` writes."""
        self.record = record

    def save(self) -> None:
        """Write the record, fenced by the lease: a supervisor that lost its lease writes nothing."""
        self.check()
        if self.record is None or self.lease is None:
            raise LeaseHeldError(
                f"lineage {self.layout.lineage}: no record to save; open() the lineage and adopt() its record first"
            )
        self.record.put(updated=self.clock())
        data = self.record.to_dict()
        for store in self.stores:
            store.save(data, fence=self.lease.token)
        self.record.put(lease_token=self.lease.token)

    def check(self) -> None:
        """Raise LeaseHeldError if the lease was lost or never taken (the keeper thread renews it)."""
        if self.keeper is None:
            raise LeaseHeldError(f"lineage {self.layout.lineage}: the lease is not held; call open() first")
        self.keeper.check()

    def renew_now(self) -> None:
        """Renew the lease now (a launch gets a whole TTL ahead); raise LeaseHeldError if it was lost."""
        self.check()
        if self.keeper is None:  # check() raised already; this keeps the type checker informed
            raise LeaseHeldError(f"lineage {self.layout.lineage}: the lease is not held; call open() first")
        self.keeper.renew_now()

    @property
    def holding(self) -> bool:
        return self.keeper is not None

    def close(self) -> None:
        """Stop renewing and give the lease up (the record stays as last written)."""
        if self.keeper is not None:
            self.keeper.stop()
            self.keeper = None
        if self.lease is not None:
            self.lease.release()


def new_record(lineage: str, mlflow: MlflowRef, storage: dict[str, Any], now: float) -> LineageRecord:
    """The record of a lineage that has not run yet."""
    return LineageRecord(
        lineage=lineage,
        status="running",
        mlflow=mlflow,
        created=now,
        updated=now,
        storage=storage,
        next_restore=RestoreSpec().__dict__,
    )


def recover_interrupted(record: LineageRecord, now: float, reclaim: Callable[[SegmentRecord], None]) -> None:
    """A segment with no end belongs to a supervisor that died (spot loss): end it, resume from the newest valid."""
    for seg in record.segments:
        if seg.ended is None:
            reclaim(seg)  # its launcher stops it if it still runs
            seg.put(
                ended=now,
                outcome="interrupted",
                event=Event(
                    type="preemption",
                    reason="the previous supervisor of this lineage vanished mid-segment (machine lost)",
                    source="lineage",
                    evidence={"segment": seg.index},
                ).to_dict(),
            )
            record.put(next_restore=RestoreSpec().__dict__)


def resume(record: LineageRecord, storage: dict[str, Any]) -> None:
    """A finished or interrupted lineage runs again, with this machine's paths (it may have moved here)."""
    record.put(storage=storage, status="running", final_reason=None)


def stamp(record: LineageRecord, command: tuple[str, ...], policy_path: str, policy_name: str) -> None:
    """What this run launches, under which policy."""
    record.put(command=list(command), policy={"path": policy_path, "name": policy_name})


def align_events_offset(record: LineageRecord, layout: LineageLayout) -> None:
    """Point the record's events offset into this machine's events.jsonl."""
    path = layout.local / "events.jsonl"
    if not path.exists():
        # The offset indexes this machine's events.jsonl; a lineage that moved here starts a new file.
        record.put(events_consumed=0, events_offset=0)
    elif "events_offset" in record.absent:  # a record from before byte offsets counted lines
        record.put(events_offset=line_offset(path, record.events_consumed))
