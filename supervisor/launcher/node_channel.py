"""The files through which a lineage's owner and its followers talk, in a directory every node sees.

    <dir>/owner.json          the owner's beat: {owner, pid, host, beats}
    <dir>/node-<k>/order.json what node k must do: {owner, seq, action: run|stop|exit, segment, command, ...}
    <dir>/node-<k>/state.json what node k is doing: {owner, node, pid, host, beats, seq, segment, status, agent,
                              exit}; a restarted follower resumes from it
    <dir>/node-<k>/segment-<i>.log  its agent's output, one "stream: line" per line

Each JSON file has one writer and is replaced atomically (temp file, rename), so a reader sees the old or the
new content, never a torn one. Liveness is a `beats` counter, not a timestamp: a reader times how long the
counter has not moved on its own monotonic clock, so clock skew between nodes does not matter.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.smallfile import read_small_file

#: The most a channel file may hold (a state carries two output tails).
MAX_CHANNEL_BYTES = 4 << 20
#: The variable each node's agent (and so every rank) gets: its node index, 0 being the owner's.
NODE_ENV = "ROLLBACK_SUPERVISOR_NODE"


def write_json(path: Path, data: dict[str, Any], *, durable: bool = False) -> None:
    """Replace `path` with `data` atomically; `durable` also fsyncs it (orders and exits, not beats)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as fh:
        json.dump(data, fh, sort_keys=True)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The file's object, or None when it is absent or unreadable (a reader retries on its next poll)."""
    try:
        data = json.loads(read_small_file(path, MAX_CHANNEL_BYTES))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass(frozen=True)
class Channel:
    """The paths of one lineage's channel directory."""

    root: Path

    @property
    def owner(self) -> Path:
        return self.root / "owner.json"

    def node_dir(self, node: int) -> Path:
        return self.root / f"node-{node}"

    def order(self, node: int) -> Path:
        return self.node_dir(node) / "order.json"

    def state(self, node: int) -> Path:
        return self.node_dir(node) / "state.json"

    def log(self, node: int, segment: int) -> Path:
        return self.node_dir(node) / f"segment-{segment}.log"


class Beat:
    """Tracks whether a `beats` counter moved within `timeout` seconds of a monotonic clock."""

    def __init__(self, timeout: float, now: float):
        self.timeout = timeout
        self.value: Any = None
        self.moved_at = now

    def see(self, value: Any, now: float) -> None:
        if value != self.value:
            self.value, self.moved_at = value, now

    def stale(self, now: float) -> bool:
        return now - self.moved_at > self.timeout

    def silent_for(self, now: float) -> float:
        return now - self.moved_at
