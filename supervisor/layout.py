"""Where a lineage keeps its files: one pure function from (workdir, storage, lineage) to paths."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import UserError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def check_lineage_name(name: str) -> str:
    if not _NAME.match(name or ""):
        raise UserError(
            f"--lineage: expected 1-100 characters of letters, digits, '.', '_' or '-' starting with a "
            f"letter or digit, got {name!r}"
        )
    return name


def is_url(storage: str) -> bool:
    return "://" in storage and not storage.startswith("file://")


@dataclass(frozen=True)
class LineageLayout:
    """Paths of one lineage.

    - `local`: this machine's lineage directory (plans, events.jsonl, heartbeat, logs, a copy of the record).
    - `durable`: where the record and the lease live: the storage URL's lineage directory when the policy's
      `checkpoint.storage` is a URL (so any machine can resume), else `local`.
    - `checkpoints`: the local checkpoint store; `remote`: the store's remote tier (a URL) or None.
    """

    lineage: str
    local: Path
    durable: str
    checkpoints: Path
    remote: str | None

    @classmethod
    def resolve(cls, workdir: Path, storage: str, lineage: str, remote: str | None = None) -> LineageLayout:
        """`storage` is the policy's checkpoint.storage; a relative path is relative to the workdir."""
        check_lineage_name(lineage)
        workdir = Path(workdir).resolve()
        local = workdir / "lineages" / lineage
        if is_url(storage):
            base = storage.rstrip("/") + "/" + lineage
            return cls(lineage, local, base, local / "checkpoints", base + "/checkpoints")
        root = Path(storage.removeprefix("file://"))
        root = root if root.is_absolute() else workdir / root
        extra = remote.rstrip("/") + "/" + lineage if remote else None
        return cls(lineage, local, str(local), root / lineage, extra)
