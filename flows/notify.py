"""`rollback-supervisor notify install`: the webhook notification Automation, installed on a Prefect server.

`deployments/notify-on-rollback.yaml` is a Prefect Automation whose `call-webhook` action needs the id of a
Webhook block, which only exists once the block is saved on the server the flows report to. This command
saves (or updates) that block with the user's URL, fills its id into the YAML's placeholder, and creates the
Automation, replacing one of the same name, so that running it again is how the URL is changed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import UUID

import typer
import yaml

from supervisor.errors import UserError

app = typer.Typer(help="Notifications through Prefect Automations.", no_args_is_help=True)

#: The automation file shipped with the project.
DEFAULT_FILE = Path(__file__).resolve().parents[1] / "deployments" / "notify-on-rollback.yaml"
#: The YAML's stand-in for the Webhook block's id.
PLACEHOLDER = UUID(int=0)
DEFAULT_BLOCK = "rollback-supervisor-notify"


class NotifySetupError(UserError):
    """The notification Automation cannot be installed as given."""


def automation_spec(path: Path, block_id: UUID) -> dict[str, Any]:
    """The Automation in `path`, with every `call-webhook` action whose block is the placeholder pointed at
    `block_id`; a located error when the file is not such an Automation."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise NotifySetupError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise NotifySetupError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(data, dict):
        raise NotifySetupError(
            f"{path}: expected a Prefect Automation (a mapping), got {type(data).__name__}"
        )
    actions = data.get("actions")
    if not isinstance(actions, list):
        raise NotifySetupError(f"{path}: key 'actions': expected a list of actions, got {actions!r}")
    filled = 0
    for i, action in enumerate(actions):
        if isinstance(action, dict) and action.get("type") == "call-webhook":
            given = str(action.get("block_document_id", ""))
            if given in ("", str(PLACEHOLDER)):
                action["block_document_id"] = str(block_id)
                filled += 1
            else:
                try:
                    UUID(given)
                except ValueError:
                    raise NotifySetupError(
                        f"{path}: key 'actions[{i}].block_document_id': expected a block id (UUID) or "
                        f"{PLACEHOLDER}, got {given!r}"
                    ) from None
    if not filled:
        raise NotifySetupError(
            f"{path}: key 'actions': expected a call-webhook action with block_document_id {PLACEHOLDER} "
            "for the installed block, found none"
        )
    return data


def install(url: str, block_name: str = DEFAULT_BLOCK, path: Path = DEFAULT_FILE) -> tuple[UUID, UUID]:
    """Save the Webhook block and (re)create the Automation; (block id, automation id)."""
    from prefect.automations import Automation
    from prefect.blocks.webhook import Webhook

    if not url.startswith(("http://", "https://")):
        raise NotifySetupError(f"--url: expected an http:// or https:// URL, got {url!r}")
    spec = automation_spec(path, PLACEHOLDER)  # check the file before anything is saved on the server
    block = Webhook(method="POST", url=url, headers={"Content-Type": "application/json"})
    block_id = block.save(block_name, overwrite=True)
    spec = automation_spec(path, block_id)
    try:
        automation = Automation.model_validate(spec)
    except ValueError as exc:
        raise NotifySetupError(f"{path}: not a Prefect Automation: {exc}") from None
    _delete_named(automation.name)
    created = automation.create()
    assert created.id is not None
    return block_id, created.id


def _delete_named(name: str) -> None:
    """Delete every automation called `name`: installing again replaces, never duplicates."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for old in client.read_automations_by_name(name=name):
            client.delete_automation(old.id)


@app.command("install")
def install_command(
    url: str = typer.Option(..., "--url", help="Where to POST each message (Slack, a chat bridge, ...)."),
    block_name: str = typer.Option(DEFAULT_BLOCK, "--block-name", help="Name of the Webhook block."),
    file: Path = typer.Option(DEFAULT_FILE, "--file", help="The Automation YAML to install."),
) -> None:
    """Save a Webhook block for URL and install the notify-on-rollback Automation on the Prefect server
    that PREFECT_API_URL names (run it again to change the URL)."""
    block_id, automation_id = install(url, block_name, file)
    typer.echo(f"webhook block {block_name!r} ({block_id}) and automation {automation_id} installed")
