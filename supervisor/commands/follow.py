"""`rollback-supervisor follow`: run this node's torchrun agent for each segment a multi-node lineage's owner
announces (see supervisor/launcher/follower.py). The owner starts it; a cluster starts it on each node."""

from __future__ import annotations

import typer

from supervisor.launcher.follower import main


def command(ctx: typer.Context) -> None:
    """Follow a multi-node lineage's owner on this node: --dir DIR --node K --owner ID."""
    raise typer.Exit(main(list(ctx.args)))
