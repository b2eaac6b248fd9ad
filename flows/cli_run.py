"""`rollback-supervisor run --policy P [--lineage NAME] [--workdir DIR] -- CMD...`"""

from __future__ import annotations

import logging
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
) -> None:
    """Run CMD (after `--`) as supervised training under POLICY until it finishes, stops or fails."""
    argv = list(ctx.args)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UserError("run: expected the training command after `--`, e.g. -- python train.py")
    if not policy.is_file():
        raise UserError(f"--policy {policy}: no such file")
    from policies import load_policy

    load_policy(policy)  # a bad policy fails here, with file:line:col, before anything starts
    from flows.prefect_env import apply_defaults

    apply_defaults(workdir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "httpcore", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    def on_term(signum, frame):
        raise Interrupted(f"received {signal.Signals(signum).name}")

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        from flows.supervised import supervised_training

        result = supervised_training(
            command=argv,
            policy=str(policy),
            lineage=lineage,
            workdir=str(workdir),
            tracking_uri=tracking_uri,
            stop_grace_seconds=stop_grace,
            lease_wait_seconds=lease_wait,
        )
    except Interrupted as exc:
        typer.echo(
            f"interrupted ({exc}); the lineage resumes from its newest checkpoint on the next run", err=True
        )
        raise typer.Exit(143) from None
    finally:
        signal.signal(signal.SIGTERM, old)
    from flows.render import print_result

    print_result(result)
    raise typer.Exit(0 if result["status"] in ("finished", "stopped") else 1)
