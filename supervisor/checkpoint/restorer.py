"""The restore path: which checkpoint (latest, best, a given one) and from which tier, each call listing once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from supervisor.checkpoint.catalog import best_of
from supervisor.checkpoint.memory import Snapshot
from supervisor.checkpoint.options import TIERS, CheckpointInfo, CheckpointOptions
from supervisor.checkpoint.restore import restore_snapshot
from supervisor.checkpoint.tickets import TicketBook
from supervisor.checkpoint.tiers import TierListing, Tiers
from supervisor.errors import CheckpointCorrupt, CheckpointError, CheckpointNotFound
from supervisor.stateful import CheckpointableState

log = logging.getLogger("rollback_supervisor.checkpoint")
Which = str | CheckpointInfo


class Restorer:
    """Chooses checkpoints and loads them into the state; it never waits for writes (the manager does).

    Each verb takes one listing of the tiers and passes it down, so every manifest is read at most once.
    """

    def __init__(
        self,
        options: CheckpointOptions,
        tiers: Tiers,
        tickets: TicketBook,
        after_fetch: Callable[[], None],
    ):
        self._options = options
        self._tiers = tiers
        self._tickets = tickets
        self._after_fetch = after_fetch

    def usable(self, info: CheckpointInfo, why: str) -> bool:
        """Whether `latest` may pick `info`: not abandoned, and healthy unless the options allow otherwise."""
        if info.abandoned:
            return False
        if info.healthy or self._options.allow_nonfinite:
            return True
        log.warning(
            "Not %s checkpoint %s: unhealthy (NaN or infinity in %s); set checkpoint.allow_nonfinite to allow it",
            why,
            info.id,
            ", ".join(info.nonfinite[:3]),
        )
        return False

    def latest(self) -> CheckpointInfo | None:
        """The newest usable commit (by seq) that passes a fast check in some tier."""
        listing = self._tiers.listing()
        for info in reversed(listing.infos):
            if self.usable(info, "taking as latest") and self._tiers.valid_somewhere(info, listing):
                return info
        return None

    def best(self, metric: str, mode: str = "min") -> CheckpointInfo | None:
        """The live, healthy checkpoint with the best `metric` that passes a fast check; ties go to the newest."""
        listing = self._tiers.listing()
        infos = [i for i in listing.infos if i.healthy or self._options.allow_nonfinite]
        while (found := best_of(infos, metric, mode)) is not None:
            if self._tiers.valid_somewhere(found, listing):
                return found
            infos = [i for i in infos if i.id != found.id]
        return None

    def restore(
        self, state: CheckpointableState, which: Which, prefixes: list[str] | None, tier: str | None
    ) -> CheckpointInfo:
        """Restore from the fastest tier with a valid copy; "latest" falls back to older commits."""
        if tier is not None and tier not in TIERS:
            raise CheckpointError(f"restore(): tier: expected one of {', '.join(TIERS)}, got {tier!r}")
        listing = self._tiers.listing()
        if which != "latest":
            return self._restore(state, listing.get(_id(which)), prefixes, tier, listing)
        reasons = []
        for info in reversed(listing.infos):
            if not self.usable(info, "restoring"):
                if not info.abandoned:
                    reasons.append(f"{info.id}: unhealthy (NaN or infinity in its state)")
                continue
            try:
                return self._restore(state, info, prefixes, tier, listing)
            except (CheckpointCorrupt, CheckpointNotFound) as exc:
                log.warning("Not restoring checkpoint %s (%s); trying the previous one", info.id, exc)
                reasons.append(f"{info.id}: {exc}")
        detail = "; ".join(reasons) if reasons else "the store is empty"
        raise CheckpointNotFound(f"no valid checkpoint in {self._tiers.where()} ({detail})")

    def _restore(
        self,
        state: CheckpointableState,
        info: CheckpointInfo,
        prefixes: list[str] | None,
        tier: str | None,
        listing: TierListing,
    ) -> CheckpointInfo:
        started = time.monotonic()
        used = self._tiers.restore(
            info, state, prefixes, tier, self._options.verify, self._after_fetch, listing
        )
        log.info(
            "Restored checkpoint %s from the %s tier in %.3fs", info.id, used, time.monotonic() - started
        )
        return info

    def restore_memory(
        self, state: CheckpointableState, which: Which, prefixes: list[str] | None
    ) -> CheckpointInfo:
        """Restore from the host-memory ring only; CheckpointNotFound if it does not hold `which`."""
        snaps = self._tiers.ring.snapshots()
        abandoned = self._tiers.store.catalog.abandoned_ids() | self._tickets.refused_ids()
        if which == "latest":
            live = [s for s in snaps if s.id not in abandoned and self.usable(snapshot_info(s), "restoring")]
            if not live:
                held = f"only {len(snaps)} abandoned or unhealthy one(s)" if snaps else "nothing"
                raise CheckpointNotFound(
                    f"restore_memory(): no snapshot to restore in the memory ring ({held})"
                )
            snap = live[-1]
        else:
            cid = _id(which)
            found = next((s for s in snaps if s.id == cid), None)
            if found is None:
                held = ", ".join(s.id for s in snaps) or "nothing"
                raise CheckpointNotFound(
                    f"restore_memory(): checkpoint {cid} is not in the memory ring (it holds {held})"
                )
            snap = found
        started = time.monotonic()
        restore_snapshot(snap, state, prefixes)
        log.info("Restored checkpoint %s from the memory tier in %.3fs", snap.id, time.monotonic() - started)
        return replace(snapshot_info(snap), tiers=("memory",), nbytes=snap.nbytes)


def snapshot_info(snap: Snapshot) -> CheckpointInfo:
    """The info of a snapshot held in the ring, with its health mark."""
    return replace(snap.meta["info"], nonfinite=snap.nonfinite())


def _id(which: Which) -> str:
    return which.id if isinstance(which, CheckpointInfo) else which


__all__ = ["Restorer", "Which", "snapshot_info"]
