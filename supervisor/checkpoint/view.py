"""A read-only merged view of a lineage's checkpoint tiers (local directory and remote URL) for the supervisor.

The training side restores through `Tiers`, which merges the same two catalogs; the supervisor decides from
this view, so after a machine move both sides see one list: a checkpoint counts once it is committed in
either tier, and it is abandoned if either tier marks it so.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from supervisor.checkpoint.catalog import Catalog, best_of
from supervisor.checkpoint.options import TIERS, CheckpointInfo

log = logging.getLogger("rollback_supervisor.checkpoint")


class MergedCatalog:
    """`list`, `verify`, `latest` and `best` over several read-only catalogs. Not thread-safe.

    `latest` and `best` skip checkpoints marked unhealthy (non-finite state) unless `allow_nonfinite`.
    """

    def __init__(self, catalogs: list[Catalog], *, allow_nonfinite: bool = False):
        self.catalogs = list(catalogs)
        self.allow_nonfinite = allow_nonfinite

    def _usable(self, info: CheckpointInfo) -> bool:
        if not (info.healthy or self.allow_nonfinite):
            log.info(
                "Skipping checkpoint %s (unhealthy: non-finite %s)", info.id, ", ".join(info.nonfinite[:3])
            )
            return False
        return self.verify(info.id, "fast") is None

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints in any tier, oldest commit first; each names the tiers that hold it."""
        merged: dict[str, CheckpointInfo] = {}
        for catalog in self.catalogs:
            for info in catalog.list():
                old = merged.get(info.id)
                if old is None:
                    merged[info.id] = info
                    continue
                tiers = tuple(t for t in TIERS if t in old.tiers + info.tiers)
                merged[info.id] = replace(old, tiers=tiers, abandoned=old.abandoned or info.abandoned)
        return sorted(merged.values(), key=lambda i: i.seq)

    def verify(self, checkpoint_id: str, mode: str = "full") -> str | None:
        """None when some tier's copy passes `mode` verification; else every tier's reason."""
        reasons = []
        for catalog in self.catalogs:
            if checkpoint_id not in catalog.ids():
                continue
            reason = catalog.verify(checkpoint_id, mode)
            if reason is None:
                return None
            reasons.append(f"{catalog.tier}: {reason}")
        return "; ".join(reasons) or f"checkpoint {checkpoint_id} is held by no tier"

    def latest(self) -> CheckpointInfo | None:
        for info in reversed(self.list()):
            if not info.abandoned and self._usable(info):
                return info
        return None

    def best(self, metric: str, mode: str = "min") -> CheckpointInfo | None:
        infos = self.list()
        while (found := best_of(infos, metric, mode)) is not None:
            if self._usable(found):
                return found
            infos = [i for i in infos if i.id != found.id]
        return None
