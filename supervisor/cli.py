"""The `rollback-supervisor` command line. Sub-commands live next to what they drive and are mounted here."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

import typer

from supervisor import __version__
from supervisor.errors import SupervisorError, UserError

app = typer.Typer(
    name="rollback-supervisor",
    help="Supervise long training runs: detect divergence, preemption and hardware faults, "
    "roll back to the right checkpoint and relaunch with full state.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Performance measurements; each writes JSON.", no_args_is_help=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"rollback-supervisor {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Supervise training runs and roll back with full state."""


def _import(module: str) -> ModuleType | None:
    """The module, or None when it is not built yet (then its sub-command is simply absent)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            return None
        raise


def _mount(parent: typer.Typer, name: str, module: str) -> None:
    """Mount `module.app` as the sub-command group `name`."""
    mod = _import(module)
    if mod is not None:
        parent.add_typer(mod.app, name=name)


def _command(name: str, module: str) -> None:
    """Mount `module.command` as the command `name`; it parses its own arguments."""
    mod = _import(module)
    if mod is not None:
        settings = {"allow_extra_args": True, "ignore_unknown_options": True}
        app.command(name, context_settings=settings)(mod.command)


_mount(app, "policy", "policies.cli")
_mount(app, "checkpoints", "supervisor.checkpoint.cli")
_mount(bench_app, "checkpoint", "benchmarks.bench_checkpoint")
_mount(bench_app, "monitor", "benchmarks.bench_monitor")
_mount(bench_app, "rollback", "benchmarks.bench_rollback")
_mount(bench_app, "goodput", "benchmarks.bench_goodput")
_mount(bench_app, "chaos", "benchmarks.bench_chaos")
app.add_typer(bench_app, name="bench")
_command("run", "supervisor.commands.run")
_command("status", "supervisor.commands.status")
_command("drill", "supervisor.drill")
_command("follow", "supervisor.commands.follow")
_mount(app, "exclusions", "supervisor.commands.exclusions")
_mount(app, "notify", "flows.notify")


def main(argv: list[str] | None = None) -> int:
    """Entry point: user errors print one clear message and exit 2, never a traceback."""
    try:
        rv = app(args=argv, standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except SupervisorError as exc:
        typer.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except typer.Exit as exc:
        return exc.exit_code
    except (typer.Abort, KeyboardInterrupt):
        typer.echo("aborted", err=True)
        return 130
    except typer.exceptions.TyperException as exc:  # usage errors arrive here in non-standalone mode
        if hasattr(exc, "show"):
            exc.show()
        return getattr(exc, "exit_code", 2)
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
