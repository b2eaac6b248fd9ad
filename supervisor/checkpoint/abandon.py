"""After a rollback: mark every later checkpoint abandoned, in every tier, and refuse later saves in flight."""

from __future__ import annotations

import logging
from dataclasses import replace

from supervisor.checkpoint.options import CheckpointInfo
from supervisor.checkpoint.restorer import Which
from supervisor.checkpoint.tickets import TicketBook
from supervisor.checkpoint.tiers import TierListing, Tiers
from supervisor.errors import CheckpointError, CheckpointNotFound

log = logging.getLogger("rollback_supervisor.checkpoint")


def abandon_after(
    which: Which, *, tickets: TicketBook, tiers: Tiers, waited: bool
) -> tuple[CheckpointInfo, list[CheckpointInfo]]:
    """Abandon what came after `which`: (the target, the checkpoints abandoned, flagged so).

    Later saves still pending are refused their commit; later ones already committing are waited for and
    marked. `waited` says whether the caller waited for every write first (then nothing is in flight).
    """
    commits = tickets.commits()
    listing: TierListing | None = None
    target = _in_flight(which, tickets)
    if target is None:
        listing = tiers.listing()
        target = _committed(which, listing)
    if target.abandoned:
        raise CheckpointError(f"abandon_after(): checkpoint {target.id} is itself abandoned")
    landing, refused = tickets.refuse_after(target.seq)
    for write in landing:
        write.exception()  # its commit is under way: let it land, then mark it below
    for info in refused:
        log.info("Abandoned checkpoint %s before its commit (rolled back to %s)", info.id, target.id)
    if listing is None or landing or tickets.commits() != commits:
        # A save committed since the listing above (it may be one to mark), or one we waited for ran its
        # retention (it may have deleted a listed checkpoint): list again.
        listing = tiers.listing()
    gone = [i for i in listing.infos if i.seq > target.seq and not i.abandoned]
    reason = f"rolled back to {target.id}"
    for info in gone:
        if "local" in info.tiers:
            tiers.store.mark_abandoned(info.id, reason)
        if "remote" in info.tiers and tiers.remote is not None:
            tiers.remote.mark_abandoned(info.id, reason)
        tiers.ring.drop(info.id)
        log.info("Abandoned checkpoint %s (%s)", info.id, reason)
    if not waited and tiers.remote is not None:
        # An upload still running may have committed remotely after the listing above; one committing
        # later sees the local mark (the uploader checks after its commit).
        unmarked = {i.id for i in gone if "remote" not in i.tiers}
        for info in tiers.remote.catalog.list():
            if info.id in unmarked and not info.abandoned:
                tiers.remote.mark_abandoned(info.id, reason)
    return target, [replace(i, abandoned=True) for i in [*gone, *refused]]


def _in_flight(which: Which, tickets: TicketBook) -> CheckpointInfo | None:
    """The info of `which` while it is still being written (a write commits before its ticket closes)."""
    ticket = tickets.get(which.id if isinstance(which, CheckpointInfo) else which)
    return None if ticket is None else ticket.info


def _committed(which: Which, listing: TierListing) -> CheckpointInfo:
    """A committed checkpoint's current info.

    An info whose checkpoint is gone from disk (retention deleted it after it was restored from the ring)
    is taken as it is: the rollback to it happened, and what came after it must still be abandoned.
    """
    try:
        return listing.get(which.id if isinstance(which, CheckpointInfo) else which)
    except CheckpointNotFound:
        if isinstance(which, CheckpointInfo):
            return which
        raise


__all__ = ["abandon_after"]
