"""deployments/notify-on-rollback.yaml and `rollback-supervisor notify install`: the file and its errors.

The Automation firing on a real server, with the webhook's payload checked, is in test_deployment_e2e.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest
import yaml

from flows.notify import DEFAULT_FILE, PLACEHOLDER, NotifySetupError, automation_spec
from tests.conftest import REPO


def test_the_shipped_file_is_a_prefect_automation_once_its_block_is_filled_in():
    from prefect.automations import Automation

    block = UUID("12345678-1234-5678-1234-567812345678")
    automation = Automation.model_validate(automation_spec(DEFAULT_FILE, block))
    assert automation.trigger.expect == {"rollback-supervisor.rollback", "rollback-supervisor.fail"}
    (action,) = automation.actions
    assert action.type == "call-webhook" and action.block_document_id == block
    for key in ("lineage", "action", "event", "step", "target_step", "reason", "flow_run_id", "flow_run_url"):
        assert f'"{key}":' in action.payload
    # The file as shipped carries the placeholder, so `prefect automation create --from-file` cannot point
    # at a block by accident.
    raw = yaml.safe_load(DEFAULT_FILE.read_text())
    assert raw["actions"][0]["block_document_id"] == str(PLACEHOLDER)


@pytest.mark.parametrize(
    "text, words",
    [
        ("name: x\nactions: [\n", ":3: not valid YAML"),
        ("- a\n- b\n", "expected a Prefect Automation (a mapping), got list"),
        ("name: x\nactions: {type: call-webhook}\n", "key 'actions': expected a list of actions"),
        (
            "name: x\nactions:\n  - {type: do-nothing}\n",
            "expected a call-webhook action with block_document_id",
        ),
        (
            "name: x\nactions:\n  - {type: call-webhook, block_document_id: nope}\n",
            "key 'actions[0].block_document_id': expected a block id (UUID)",
        ),
    ],
)
def test_a_bad_automation_file_names_the_file_and_key(tmp_path: Path, text: str, words: str):
    path = tmp_path / "notify.yaml"
    path.write_text(text)
    with pytest.raises(NotifySetupError) as err:
        automation_spec(path, UUID(int=1))
    assert str(err.value).startswith(str(path)) and words in str(err.value)


def test_install_refuses_a_bad_url_in_one_line_with_exit_2_before_touching_a_server(tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "supervisor.cli", "notify", "install", "--url", "hooks.example.com/x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PREFECT_API_URL": "http://127.0.0.1:9/api", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --url: expected an http:// or https:// URL, got 'hooks.example.com/x'"
    ]
