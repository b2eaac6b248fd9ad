"""`rollback-supervisor run --policy P [--lineage NAME] [--workdir DIR] -- CMD...`"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import typer

from supervisor.errors import UserError


class Interrupted(Exception):
    """SIGTERM reached the supervisor (its machine is going away)."""


def command(
    ctx: typer.Context,
    policy: Path = typer.Option(
        ..., "--policy", help="Policy YAML (see `rollback-supervisor policy explain`)."
    ),
    lineage: str = typer.Option(None, "--lineage", help="Lineage name; re-using one resumes it."),
    workdir: Path = typer.Option(
        Path(".rollback"), "--workdir", help="Lineages, logs and the default MLflow store."
    ),
    tracking_uri: str = typer.Option(
        None, "--tracking-uri", help="MLflow tracking URI (default: sqlite in --workdir)."
    ),
    stop_grace: float = typer.Option(
        30.0, "--stop-grace", help="Seconds a stopped segment gets before SIGKILL."
    ),
    lease_wait: float = typer.Option(
        0.0, "--lease-wait", help="Seconds to wait for another supervisor's lease."
    ),
    lease_ttl: float = typer.Option(
        60.0,
        "--lease-ttl",
        min=1.0,
        help="Seconds a lease outlives its supervisor (renewed every third of it while this run lives).",
    ),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show MLflow's, Prefect's and httpx's INFO logs."
    ),
    progress_every: float = typer.Option(
        30.0, "--progress-every", min=0.0, help="Seconds between progress log lines off a terminal (0: none)."
    ),
) -> None:
    """Run CMD (after `--`) as supervised training under POLICY until it finishes, stops or fails."""
    argv = list(ctx.args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UserError("run: expected the training command after `--`, e.g. -- python train.py")
    if not policy.is_file():
        raise UserError(f"--policy {policy}: no such file")
    lease, keeper = preflight(argv, policy, lineage, workdir, lease_wait, lease_ttl)
    try:
        _run(
            argv,
            policy,
            lineage or lease_lineage(argv),
            workdir,
            tracking_uri,
            stop_grace,
            lease,
            verbose,
            progress_every,
        )
    finally:
        keeper.stop()
        lease.release()


def lease_lineage(argv: list[str]) -> str:
    from supervisor.command import default_lineage, python_command

    return default_lineage(python_command(argv))


def preflight(
    argv: list[str], policy: Path, lineage: str | None, workdir: Path, lease_wait: float, lease_ttl: float
):
    """Refuse bad input and a held lineage before Prefect or MLflow start (seconds, not a server start-up).

    Takes the lineage lease here, with a keeper renewing it; the flow adopts it (same owner), so a second
    `run` of the lineage fails at once with the holder's name, and two runs on a fresh workdir never race
    to create its stores.
    """
    from policies import load_policy
    from supervisor.layout import LineageLayout
    from supervisor.lineage import Lease, LeaseKeeper

    loaded = load_policy(policy)  # a bad policy fails here, with file:line:col, before anything starts
    if loaded.script is not None:  # a command the relaunch would change is refused before Prefect starts
        from supervisor.command import python_command
        from supervisor.script.mode import check_command

        check_command(loaded, policy, python_command(argv))
    name = lineage or lease_lineage(argv)
    ck = loaded.checkpoint
    layout = LineageLayout.resolve(workdir, ck.storage, name, ck.remote)  # checks the lineage name
    try:
        layout.local.mkdir(parents=True, exist_ok=True)
        probe = layout.local / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(
            f"--workdir {workdir}: cannot write to {layout.local} ({exc.strerror or exc}); "
            "pass a writable --workdir"
        ) from None
    lease = Lease(layout.durable, ttl_seconds=lease_ttl)
    lease.acquire(lease_wait)
    return lease, LeaseKeeper(lease).start()


def _run(
    argv, policy, lineage, workdir, tracking_uri, stop_grace, lease, verbose=False, progress_every=30.0
) -> None:
    from flows.prefect_env import apply_defaults
    from supervisor.commands.logs import configure_logging

    configure_logging(verbose)  # first: --verbose sets Prefect's level before the defaults do
    apply_defaults(workdir)

    def on_term(signum, frame):
        raise Interrupted(f"received {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, on_term)
    from supervisor.commands.progress import for_run

    progress = for_run(argv, policy, lineage, workdir, every=progress_every).start()
    try:
        from flows.supervised import supervised_training

        result = supervised_training(
            command=argv,
            policy=str(policy),
            lineage=lineage,
            workdir=str(workdir),
            tracking_uri=tracking_uri,
            stop_grace_seconds=stop_grace,
            lease_ttl_seconds=lease.ttl_seconds,
            lease_owner=lease.owner,
            progress_seconds=0,  # this command shows the line itself
        )
    except Interrupted as exc:
        typer.echo(
            f"interrupted ({exc}); the lineage resumes from its newest checkpoint on the next run", err=True
        )
        raise typer.Exit(143) from None
    finally:
        signal.signal(signal.SIGTERM, old)
        progress.stop()
    from supervisor.commands.render import print_result

    print_result(result)
    raise typer.Exit(0 if result["status"] in ("finished", "stopped") else 1)
