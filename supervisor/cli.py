"""The `rollback-supervisor` command line. Sub-commands live next to what they drive and are mounted here."""

from __future__ import annotations

import importlib
import sys

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


def _mount(parent: typer.Typer, name: str, module: str) -> None:
    """Mount `module.app` as `name`; a sub-command whose module is not built yet is simply absent."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            return
        raise
    parent.add_typer(mod.app, name=name)


_mount(app, "policy", "policies.cli")
_mount(app, "checkpoints", "supervisor.checkpoint.cli")
_mount(bench_app, "checkpoint", "supervisor.checkpoint.bench")
_mount(bench_app, "monitor", "supervisor.monitor.bench")
_mount(bench_app, "rollback", "benchmarks.bench_rollback")
_mount(bench_app, "goodput", "benchmarks.bench_goodput")
_mount(bench_app, "chaos", "benchmarks.bench_chaos")
app.add_typer(bench_app, name="bench")
for _name, _module in (
    ("run", "flows.cli_run"),
    ("status", "flows.cli_status"),
    ("drill", "supervisor.drill"),
):
    try:
        _mod = importlib.import_module(_module)
    except ModuleNotFoundError as _exc:
        if not _exc.name or not (_module == _exc.name or _module.startswith(_exc.name + ".")):
            raise
        continue
    app.command(_name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
        _mod.command
    )


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
