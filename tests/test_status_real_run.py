"""`rollback-supervisor status` on a lineage a real supervised run wrote: its store where the policy put it,
segment steps from the record and checkpoints, and in-process decisions that say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from supervisor.checkpoint import open_store
from supervisor.cli import main
from supervisor.layout import LineageLayout
from supervisor.orchestrator import LineageRunner, RunOptions, python_command

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, NAN_AT, KILL_AT = 60, 25, 47
#: A real, small supervised training: a linear model on a shuffled resumable loader (steps take milliseconds).
TRAIN = """\
import sys

import torch

from supervisor.data import ResumableLoader
from supervisor.runtime import Session

torch.manual_seed(0)
torch.set_num_threads(1)
xs = torch.randn(256, 8)
loader = ResumableLoader(torch.utils.data.TensorDataset(xs, xs.sum(1, keepdim=True)), batch_size=8, shuffle=True, seed=0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sess = Session.attach(run_name="tiny")
sess.register(model=model, optimizer=opt, data=loader)
with sess:
    for step, (x, y) in sess.loop(loader, max_steps=int(sys.argv[1])):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sess.log(loss=loss.item())
sys.exit(sess.exit_code)
"""
#: Every preset's storage (the default): the store is <workdir>/checkpoints/<lineage>, not under lineages/.
POLICY = """\
version: 1
name: status-real-run
checkpoint: {every_steps: 10, keep_last: 20, async: false, storage: ./checkpoints}
monitor:
  poll_seconds: 0.5
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
  - when: [preemption, unknown_exit]
    action: resume
    target: {select: latest}
limits:
  backoff: {initial_seconds: 0.1, max_seconds: 1, multiplier: 2, jitter: false}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """NaN at step 25 (rolled back in process), SIGKILL after step 47, resumed to the end: two segments."""
    tmp = tmp_path_factory.mktemp("status-run")
    policy, script = tmp / "policy.yaml", tmp / "train.py"
    policy.write_text(POLICY)
    script.write_text(TRAIN)
    workdir = tmp / "wd"
    options = RunOptions(
        command=python_command(["python", str(script), str(STEPS)]),
        policy_path=str(policy),
        lineage="demo",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": f"nan@{NAN_AT},kill@{KILL_AT}"},
        max_segments=4,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise().to_dict()
    return {"workdir": workdir, "record": record}


def _status(capsys, workdir: Path) -> dict:
    assert main(["status", "--workdir", str(workdir), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["lineages"][0]


def test_the_run_went_as_planned(run):
    segments = run["record"]["segments"]
    assert [s["outcome"] for s in segments] == ["resume", "finished"]
    assert segments[0]["returncode"] == -9
    assert [e["decision"]["action"] for e in segments[0]["in_process"]] == ["rollback"]


def test_status_lists_the_store_the_policy_put_under_the_workdir(run, capsys):
    workdir = run["workdir"]
    store = LineageLayout.resolve(workdir, "./checkpoints", "demo").checkpoints
    assert store == workdir.resolve() / "checkpoints" / "demo"
    assert not (workdir / "lineages" / "demo" / "checkpoints").exists()
    view = _status(capsys, workdir)
    assert view["checkpoint_store"] == str(store)
    assert [c["id"] for c in view["checkpoints"]] == [i.id for i in open_store(store).list()]
    assert view["final_checkpoint"] == view["checkpoints"][-1]["id"]
    assert view["checkpoints"][-1]["step"] == STEPS
    assert main(["status", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "no checkpoints" not in out and view["final_checkpoint"] in out


def test_segment_steps_come_from_the_restored_checkpoint_and_the_segments_progress(run, capsys):
    first, second = _status(capsys, run["workdir"])["segments"]
    restored = second["restore"]["checkpoint_id"]
    restored_step = int(restored.split("-")[0])
    assert restored_step == 40  # the newest checkpoint the killed segment committed
    assert (first["start_step"], second["start_step"]) == (0, restored_step)
    assert second["last_step"] == STEPS
    # SIGKILL after step 47: it got at least as far as its last checkpoint, never past the kill, and the
    # heartbeat (written every 0.5 s) is only a lower bound.
    assert 40 <= first["last_step"] <= KILL_AT
    assert first["heartbeat_step"] is None or first["heartbeat_step"] <= first["last_step"]


def test_an_in_process_rollback_says_in_process_not_relaunch(run, capsys):
    rows = _status(capsys, run["workdir"])["timeline"]
    inner = [r for r in rows if r["in_process"]]
    assert len(inner) == 1 and inner[0]["action"] == "rollback"
    assert "in process" in inner[0]["reason"] and "relaunch in" not in inner[0]["reason"]
    relaunched = [r for r in rows if not r["in_process"]]
    assert [r["action"] for r in relaunched] == ["resume"]
    assert "relaunch in" in relaunched[0]["reason"]
