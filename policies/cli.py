"""`rollback-supervisor policy ...`: validate, explain and export the schema of policy files."""

from __future__ import annotations

from pathlib import Path

import typer

from policies import json_schema_text, load_policy, reference_markdown
from policies.summary import summarize
from supervisor.errors import PolicyError

app = typer.Typer(help="Validate, explain and export the schema of rollback policies.", no_args_is_help=True)


@app.command()
def validate(
    files: list[Path] = typer.Argument(..., help="Policy YAML files to check.", show_default=False),
) -> None:
    """Check policy files; print `ok: FILE` for each valid one and every problem of the others (exit 2)."""
    invalid = 0
    for file in files:
        try:
            load_policy(file)
        except PolicyError as exc:
            invalid += 1
            typer.echo(str(exc), err=True)
        else:
            typer.echo(f"ok: {file}")
    if invalid:
        typer.echo(f"{invalid} of {len(files)} policy file(s) invalid", err=True)
        raise typer.Exit(2)


@app.command()
def schema() -> None:
    """Print the policy JSON Schema (for `# yaml-language-server: $schema=`)."""
    typer.echo(json_schema_text(), nl=False)


@app.command()
def explain(file: Path = typer.Argument(..., help="Policy YAML file.", show_default=False)) -> None:
    """Say in plain words what the policy does on each event type."""
    typer.echo(summarize(load_policy(file)), nl=False)


@app.command()
def reference() -> None:
    """Print the Markdown reference of every policy key."""
    typer.echo(reference_markdown(), nl=False)
