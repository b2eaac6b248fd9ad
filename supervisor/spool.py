"""The metric spool: a supervised training process appends its metric points to a local JSONL file, and
the supervisor ships them to MLflow.

Why: importing MLflow and opening its store cost ~2 s of CPU (`bench rollback`, 2 cores). A relaunched
process that did it on its logger thread took its first resumed step ~0.7 s slower than a plain restart,
because the import competed with the step for the cores and the GIL. The supervisor already has MLflow
open, so under it the training process never imports MLflow: it writes lines here, and a checkpoint's
commit waits only for those lines to reach the file: lines in the file survive a SIGKILL of the training
process, while the old in-process queue lost what it had not yet sent to MLflow.

Format: one JSON array per line, `[key, value, timestamp_ms, step]`; NaN and infinities are written as
JSON's `NaN`/`Infinity` extensions, which Python reads back. A writer appends whole lines with one
`write()` per batch; a reader consumes up to the last newline only, so a line cut by a kill is never read
half. What has been shipped is a byte offset in `<spool>.shipped`, written (atomically) after each batch
MLflow accepted: shipping resumes there after a supervisor crash, and a batch sent twice is harmless
(MLflow drops a metric row identical to one it has).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger("rollback_supervisor.spool")

#: (key, value, timestamp in ms, step): one metric point, as the metric logger queues it.
Point = tuple[str, float, int, int]


class SpoolWriter:
    """Appends metric points to the spool file; `send()` returns once they are in the file (the OS cache).

    Not thread-safe: the metric logger's one thread writes.
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def send(self, points: list[Point]) -> None:
        data = memoryview("".join(json.dumps([k, v, ts, s]) + "\n" for k, v, ts, s in points).encode())
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SpoolReader:
    """Reads the points appended since what was marked shipped. Not thread-safe: one shipper reads."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.mark_path = self.path.with_name(self.path.name + ".shipped")

    def shipped(self) -> int:
        """The byte offset up to which the points were shipped (0 if none)."""
        try:
            return int(self.mark_path.read_text().strip() or 0)
        except FileNotFoundError:
            return 0
        except ValueError:
            log.warning(
                "%s: unreadable offset; shipping the spool again (MLflow drops repeats)", self.mark_path
            )
            return 0

    def pending(self, limit: int, max_bytes: int = 1 << 22) -> tuple[list[Point], int]:
        """Up to `limit` complete points after the shipped offset, and the offset just after the last one.

        Reads at most `max_bytes` (more only for a single longer line), so a large backlog is read once.
        """
        start = self.shipped()
        try:
            with self.path.open("rb") as f:
                f.seek(start)
                data = f.read(max_bytes)
                while data and b"\n" not in data and len(chunk := f.read(max_bytes)) > 0:
                    data += chunk
        except FileNotFoundError:
            return [], start
        points: list[Point] = []
        end = start
        for line in data.split(b"\n")[:-1]:  # the last piece has no newline yet: read once it is whole
            if len(points) >= limit:
                break
            end += len(line) + 1
            point = _parse(line, self.path)
            if point is not None:
                points.append(point)
        return points, end

    def mark(self, offset: int) -> None:
        """Record that everything before `offset` reached MLflow (temp file + rename)."""
        tmp = self.mark_path.with_name(self.mark_path.name + ".tmp")
        tmp.write_text(str(offset))
        os.replace(tmp, self.mark_path)

    def unshipped_bytes(self) -> int:
        try:
            return max(0, self.path.stat().st_size - self.shipped())
        except FileNotFoundError:
            return 0


def _parse(line: bytes, path: Path) -> Point | None:
    try:
        key, value, ts, step = json.loads(line)
        point = (str(key), float(value), int(ts), int(step))
    except (ValueError, TypeError) as exc:
        log.warning("%s: skipping a malformed line (%s): %r", path, exc, line[:200])
        return None
    return point
