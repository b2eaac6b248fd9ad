"""Which tier (memory ring, local directory, remote URL) holds which checkpoint; restore from the fastest."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from supervisor.checkpoint import preload
from supervisor.checkpoint.catalog import Listing
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.memory import SnapshotRing
from supervisor.checkpoint.options import TIERS, CheckpointInfo
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.restore import restore_local, restore_snapshot
from supervisor.errors import CheckpointCorrupt, CheckpointNotFound
from supervisor.stateful import CheckpointableState

log = logging.getLogger("rollback_supervisor.checkpoint")


@dataclass(frozen=True)
class TierListing:
    """One listing of every tier: the merged infos (oldest commit first) and each store's own listing."""

    infos: list[CheckpointInfo]
    local: Listing
    remote: Listing | None
    where: str

    def get(self, checkpoint_id: str) -> CheckpointInfo:
        for info in self.infos:
            if info.id == checkpoint_id:
                return info
        raise CheckpointNotFound(f"checkpoint {checkpoint_id} not found in {self.where}")


class Tiers:
    """The merged view of the three tiers; a checkpoint counts once committed locally or remotely."""

    def __init__(self, store: LocalStore, remote: RemoteTier | None, ring: SnapshotRing):
        self.store, self.remote, self.ring = store, remote, ring

    def where(self) -> str:
        return self.store.root + (f" or {self.remote.url}" if self.remote else "")

    def listing(self) -> TierListing:
        """Committed checkpoints across tiers, each manifest read once; each info lists the tiers holding it."""
        remote = self.remote.catalog.listing() if self.remote else None
        local = self.store.catalog.listing()
        merged: dict[str, CheckpointInfo] = {}
        for info in [*(remote.infos if remote else []), *local.infos]:
            old = merged.get(info.id)
            tiers = (old.tiers if old else ()) + info.tiers
            merged[info.id] = replace(
                info, tiers=tiers, abandoned=info.abandoned or bool(old and old.abandoned)
            )
        in_ring = {s.id for s in self.ring.snapshots()}
        out = []
        for info in merged.values():
            tiers = (("memory",) if info.id in in_ring else ()) + info.tiers
            out.append(replace(info, tiers=tuple(t for t in TIERS if t in tiers)))
        return TierListing(sorted(out, key=lambda i: i.seq), local, remote, self.where())

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints across tiers, oldest commit first; each lists the tiers holding it."""
        return self.listing().infos

    def get(self, checkpoint_id: str) -> CheckpointInfo:
        return self.listing().get(checkpoint_id)

    def valid_somewhere(self, info: CheckpointInfo, listing: TierListing) -> bool:
        """True when some tier's copy passes a fast check; otherwise the reasons are logged."""
        reasons = []
        if "local" in info.tiers:
            read = listing.local.manifest(info.id)
            if (reason := self.store.catalog.verify(info.id, "fast", read=read)) is None:
                return True
            reasons.append(f"local: {reason}")
        if "remote" in info.tiers and self.remote is not None:
            read = listing.remote.manifest(info.id) if listing.remote else None
            if (reason := self.remote.catalog.verify(info.id, "fast", read=read)) is None:
                return True
            reasons.append(f"remote: {reason}")
        log.warning("Skipping checkpoint %s (%s)", info.id, "; ".join(reasons) or "held by no tier")
        return False

    def restore(
        self,
        info: CheckpointInfo,
        state: CheckpointableState,
        prefixes: list[str] | None,
        tier: str | None,
        verify: str,
        after_fetch: Callable[[], None],
        listing: TierListing,
    ) -> str:
        """Restore `info` from `tier`, or the fastest tier with a valid copy; returns the tier used.

        With no tier named, a standby's preloaded copy of `info` comes first (`supervisor/checkpoint/preload.py`).
        """
        if tier is None and preload.restore_preloaded(self.store.root, info.id, state, prefixes):
            return "preloaded"
        reasons = []
        for t in [tier] if tier else TIERS:
            snap = self.ring.get(info.id) if t == "memory" else None
            if (t == "memory" and snap is None) or (t == "local" and "local" not in info.tiers):
                continue
            if t == "remote" and ("remote" not in info.tiers or self.remote is None):
                continue
            try:
                if snap is not None:
                    restore_snapshot(snap, state, prefixes)
                    return t
                if t == "remote":
                    self._fetch(info.id)
                    after_fetch()
                    manifest = self.store.catalog.manifest(info.id)  # the copy just downloaded
                else:
                    manifest = self.store.catalog.known_manifest(info.id, listing.local.manifest(info.id))
                restore_local(self.store.catalog, manifest, state, prefixes, verify)
                return t
            except CheckpointCorrupt as exc:
                reasons.append(f"{t}: {exc.reason}")
                log.warning("Checkpoint %s in the %s tier is invalid (%s)", info.id, t, exc.reason)
        if reasons:
            raise CheckpointCorrupt(info.id, "; ".join(reasons))
        raise CheckpointNotFound(f"checkpoint {info.id} is not held by the {tier or 'any'} tier")

    def _fetch(self, checkpoint_id: str) -> None:
        assert self.remote is not None
        try:
            self.remote.download(self.store, checkpoint_id)
        except (OSError, ValueError) as exc:  # ValueError: a name that leads out of the remote store
            raise CheckpointCorrupt(checkpoint_id, f"download from {self.remote.url} failed ({exc})") from exc
