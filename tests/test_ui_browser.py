"""The Prefect artifact of a faulted lineage, opened in a real browser (headless Chromium) from a real server.

Skipped where Chromium is missing (`apt-get install -y chromium`; .ci/run installs it). The screenshot is
written to $TMPDIR/rollback-supervisor-ui/artifact.png, never into the repository; the test prints its path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from flows.supervised import artifact_key
from tests.conftest import REPO
from tests.prefect_servers import PrefectServer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# As root Chromium needs --no-sandbox; /dev/shm is small in containers; the virtual time budget lets the UI's
# JavaScript fetch the artifact from the API and render it before the DOM is dumped.
BROWSER_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--window-size=1400,1100",
    "--virtual-time-budget=30000",
]
FLOW = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.flowkit import run_flow
run_flow(Path({workdir!r}), 64, faults="spike@50,kill@60", lineage={lineage!r})
"""


def _browser(url: str, *args: str) -> str:
    proc = subprocess.run([CHROMIUM, *BROWSER_FLAGS, *args, url], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium: apt-get install -y chromium")
def test_the_lineage_artifact_renders_in_a_real_browser(tmp_path: Path):
    lineage, workdir = "ui-check", tmp_path / "rollback"
    server = PrefectServer(tmp_path / "server", ui=True)
    try:
        server.start()
        flow = subprocess.run(
            [sys.executable, "-c", FLOW.format(repo=str(REPO), workdir=str(workdir), lineage=lineage)],
            cwd=REPO, env=server.env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert flow.returncode == 0, flow.stderr[-3000:]
        # The flow versions the artifact at each decision; the newest holds the whole lineage.
        artifact = server.post(
            "/artifacts/filter",
            {"artifacts": {"key": {"any_": [artifact_key(lineage)]}}, "sort": "CREATED_DESC", "limit": 1},
        )[0]
        url = f"http://127.0.0.1:{server.port}/artifacts/artifact/{artifact['id']}"
        # Outside the repository and outside pytest's temporary directories (those are pruned).
        screenshot = Path(tempfile.gettempdir()) / "rollback-supervisor-ui" / "artifact.png"
        screenshot.parent.mkdir(exist_ok=True)
        screenshot.unlink(missing_ok=True)  # the one checked below is this run's
        # One browser run for both: headless Chromium dumps the DOM and takes the screenshot of the same page.
        dom = _browser(url, "--dump-dom", f"--screenshot={screenshot}")
    finally:
        server.stop()
    print(f"screenshot of the artifact page: {screenshot}")
    assert screenshot.stat().st_size > 10_000  # a rendered page, not a blank one

    # The markdown rendered as HTML: the heading and the tables.
    assert "Events and decisions" in dom and "<table" in dom, dom[-3000:]
    # A spike rolled back in process, then a kill resumed by a relaunch; the lineage finished.
    for text in ("spike", "rollback", "unknown_exit", "resume", "Segments", f"{lineage}: finished"):
        assert text in dom, text

    # The loss plot is reachable from the lineage's MLflow run.
    record = json.loads((workdir / "lineages" / lineage / "lineage.json").read_text())
    client = MlflowClient(tracking_uri=record["mlflow"]["tracking_uri"])
    names = {a.path for a in client.list_artifacts(record["mlflow"]["run_id"])}
    assert {"loss.png", "events.json"} <= names, names
