"""`rollback-supervisor exclusions clear`: let a lineage's excluded hosts back into its next launches."""

from __future__ import annotations

from pathlib import Path

import typer

from supervisor.commands.status import StatusError, load_lineages
from supervisor.errors import LeaseHeldError, UserError
from supervisor.layout import is_url
from supervisor.lineage import Lease, LineageRecord, LineageStore
from supervisor.lineage.exclusions import excluded_names

app = typer.Typer(
    help="A lineage's excluded hosts (hardware faults, replay mismatches, stragglers); `status` lists them.",
    no_args_is_help=True,
)


class ExclusionsError(UserError):
    """The host asked for is not excluded, or the lineage is being supervised right now."""


@app.command("clear")
def clear(
    lineage: str = typer.Option(..., "--lineage", help="The lineage whose exclusions to clear."),
    host: str | None = typer.Option(None, "--host", help="Clear only this host (default: every host)."),
    workdir: Path = typer.Option(Path(".rollback"), "--workdir", help="The supervisor's work directory."),
) -> None:
    """Clear the lineage's excluded hosts (or one of them): its next launches may use them again."""
    [(directory, raw)] = load_lineages(workdir, lineage)
    storage = raw.get("storage") if isinstance(raw.get("storage"), dict) else {}
    durable = storage.get("durable")
    root = durable if isinstance(durable, str) and is_url(durable) else str(directory)
    cleared = clear_exclusions(root, str(directory), lineage, host)
    if not cleared:
        typer.echo(f"lineage {lineage}: no excluded hosts")
        return
    typer.echo(
        f"lineage {lineage}: cleared {len(cleared)} excluded host(s): {', '.join(cleared)}; "
        "the next launches may use them"
    )


def clear_exclusions(root: str, local: str, lineage: str, host: str | None) -> list[str]:
    """Under the lineage's lease, drop `host` (or every host) from `excluded_hosts`; the hosts dropped.

    The lease keeps a running supervisor's copy of the record from overwriting the change (or this change
    from overwriting its record): while one holds it, nothing is written.
    """
    lease = Lease(root, ttl_seconds=30.0)
    try:
        lease.acquire(0.0)
    except LeaseHeldError as exc:
        raise ExclusionsError(
            f"exclusions clear --lineage {lineage}: the lineage is being supervised right now ({exc}); "
            "clear its exclusions once its supervisor has stopped"
        ) from None
    try:
        stores = [LineageStore(root)] + ([LineageStore(local)] if local != root else [])
        data = next((d for d in (s.load() for s in stores) if d is not None), None)
        if data is None:
            raise StatusError(f"--lineage {lineage}: no lineage record under {root}")
        token = data.get("lease_token", 0)
        if isinstance(token, int) and not isinstance(token, bool):
            lease.advance(token)
        record = LineageRecord.from_dict(data)
        names = excluded_names(record.excluded_hosts or [])
        if host is not None and host not in names:
            raise ExclusionsError(
                f"--host {host}: not an excluded host of lineage {lineage}; expected one of: "
                f"{', '.join(names) if names else 'none (the lineage excludes no host)'}"
            )
        if not names:
            return []
        cleared = [h for h in names if host is None or h == host]
        kept = [e for e in record.excluded_hosts or [] if e.get("host") not in cleared]
        record.put(excluded_hosts=kept)
        for store in stores:
            store.save(record.to_dict(), fence=lease.token)
        return cleared
    finally:
        lease.release()
