"""A preemption whose emergency checkpoint meets a full disk (issue 14, 6.1), end to end: the real supervisor
(LineageRunner) launches a real training process whose checkpoint store is a small tmpfs mounted for the test.

The training process fills the disk at step 25 (as another process would) and is then preempted (SIGTERM):
its emergency save fails. It reports that and exits as preempted; the supervisor resumes from the newest
valid checkpoint (step 20), and once the disk has room again the lineage finishes.
"""

from __future__ import annotations

import errno
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor import exitcodes
from supervisor.checkpoint import open_store
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.conftest import REPO
from tests.faulty_fs import SmallDisk, mount_refused

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, EVERY, PREEMPT_AT = 40, 10, 25

TRAIN = f"""\
import os, signal, sys
import torch
from supervisor.runtime import Session

torch.manual_seed(0)
net = torch.nn.Linear(32, 32)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
batches = [torch.randn(4, 32) for _ in range({STEPS})]
sess = Session.attach(run_name="faults")
sess.register(model=net, optimizer=opt)
with sess:
    for step, x in sess.loop(batches, max_steps={STEPS}):
        opt.zero_grad()
        net(x).pow(2).mean().backward()
        opt.step()
        sess.log(loss=net(x).pow(2).mean().item())
        if step == {PREEMPT_AT} and sess.plan.segment == 0:
            sess.manager.wait()  # step {PREEMPT_AT - 5}'s checkpoint is committed: the disk fills up after it
            with open(os.path.join(os.environ["DISK"], "filler"), "wb") as f:
                try:
                    while True:
                        f.write(b"\\0" * 65536)
                except OSError:
                    pass
            os.kill(os.getpid(), signal.SIGTERM)  # a preemption notice
sys.exit(sess.exit_code)
"""

POLICY = """\
version: 1
name: storage-faults-e2e
checkpoint: {{every_steps: {every}, keep_last: 10, async: true, storage: {storage}}}
monitor: {{poll_seconds: 0.2, detectors: []}}
rules:
  - {{when: [preemption], action: resume, target: {{select: latest}}}}
  - {{when: [software_error, unknown_exit], action: fail}}
limits: {{max_restarts: 5, backoff: {{initial_seconds: 0.1, max_seconds: 0.1, jitter: false}}}}
"""


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    reason = mount_refused(tmp_path / "probe")
    if reason:
        pytest.skip(reason)
    small = SmallDisk(tmp_path / "disk", 2 << 20)
    try:
        yield small
    finally:
        small.unmount()


def test_a_failed_emergency_save_is_reported_and_the_supervisor_resumes_from_the_newest_valid(
    tmp_path: Path, disk: SmallDisk
):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(every=EVERY, storage=disk.path))
    options = RunOptions(
        command=(sys.executable, str(script)),
        policy_path=str(policy),
        lineage="sf",
        workdir=tmp_path / "work",
        stop_grace_seconds=20,
        env={"PYTHONPATH": str(REPO), "DISK": str(disk.path)},
    )
    runner = LineageRunner(options)
    runner.open()
    try:
        first = runner.run_segment()
        decision = runner.conclude(first)
        store = open_store(disk.path / "sf")
        newest = [i for i in store.list() if not i.abandoned]
        (disk.path / "filler").unlink()  # the disk has room again before the relaunch
        second = runner.run_segment()
        assert runner.conclude(second) is None
        record = runner.finish("finished", "training finished").to_dict()
    finally:
        runner.close()

    # The preempted segment exited as preempted although its emergency checkpoint failed, and said so.
    assert first.exit.returncode == exitcodes.EXIT_PREEMPTED
    seg0, seg1 = record["segments"]
    log0 = (runner.layout.local / "segments" / "0.log").read_text()
    assert f"emergency checkpoint at step {PREEMPT_AT} failed" in log0
    reports = seg0["save_failures"]
    assert len(reports) == 1 and reports[0]["event"]["type"] == "storage_error"
    assert reports[0]["event"]["evidence"]["errno"] == errno.ENOSPC
    assert f"checkpoint {PREEMPT_AT:010d}-" in reports[0]["event"]["reason"]
    # Nothing of the failed save was committed: the newest valid checkpoint is step 20's, and the supervisor,
    # treating the exit as the preemption it was, resumed from it.
    assert [i.step for i in newest] == [10, 20]
    assert seg0["event"]["type"] == "preemption" and decision is not None and decision.action == "resume"
    assert decision.target_id == newest[-1].id
    assert seg1["restore"]["checkpoint_id"] == newest[-1].id
    # The relaunch trained exactly the steps after it, and finished with its own checkpoints.
    spool = runner.layout.local / "metrics" / "1.jsonl"
    loss_steps = [p[3] for p in map(json.loads, spool.read_text().splitlines()) if p[0] == "loss"]
    assert loss_steps == list(range(newest[-1].step + 1, STEPS + 1))
    assert second.exit.returncode == 0 and seg1["outcome"] == "finished"
    assert [i.step for i in open_store(disk.path / "sf").list()] == [10, 20, 30, 40]
    assert record["status"] == "finished"
