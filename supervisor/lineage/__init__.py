"""Durable lineage record and lease, stored next to the checkpoints (local path or fsspec URL).

Everything a new flow run needs to resume lives here: events, decisions, budgets spent (the policy
history), the MLflow run, the segments so far and the plan for the next one. `record` types it, `store`
reads and writes it fenced by the lease token, `lease` keeps two supervisors off one lineage.
"""

from supervisor.lineage.lease import Lease, LeaseKeeper, parse_lease
from supervisor.lineage.record import (
    LineageRecord,
    MlflowRef,
    RecordLike,
    SegmentRecord,
    as_json,
    running_seconds,
)
from supervisor.lineage.store import (
    MAX_RECORD_BYTES,
    RECORD_KEYS,
    LineageRecordError,
    LineageStore,
    decode_record,
    parse_record,
    write_json_atomic,
)

__all__ = [
    "MAX_RECORD_BYTES",
    "RECORD_KEYS",
    "Lease",
    "LeaseKeeper",
    "LineageRecord",
    "LineageRecordError",
    "LineageStore",
    "MlflowRef",
    "RecordLike",
    "SegmentRecord",
    "as_json",
    "decode_record",
    "parse_lease",
    "parse_record",
    "running_seconds",
    "write_json_atomic",
]
