"""Script mode under torchrun: tests/scripts/train_mlp_ddp.py, nanoGPT's shape under DDP (rank 0 saves `ckpt.pt`
and prints the `iter` lines, every rank resumes from the file), two gloo ranks started by the torchrun launcher.

One lineage is SIGKILLed at iteration 45 (the drill's external fault: the whole group goes) and resumed from
rank 0's newest versioned `ckpt.pt`, then diverges at its learning rate of 2.0: the supervisor reads rank 0's
printed loss, stops the group, puts back the version chosen by the policy and relaunches every rank with the
template's arguments (`--init_from=resume --learning_rate=0.5`), which both ranks print. Another lineage runs a
script whose every rank prints its `iter` lines: each step reaches the lineage's MLflow run once. A third runs
on two torchrun nodes and loses one whole: both resume from the same version.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from supervisor.launcher import TorchrunLauncher, TorchrunOptions
from supervisor.orchestrator import LineageRunner, RunOptions
from supervisor.runtime.faults import FAULTS_ENV
from tests.conftest import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = str(REPO / "tests" / "scripts" / "train_mlp_ddp.py")
POLICY = REPO / "tests" / "data" / "policies" / "script.yaml"
DIVERGING = [
    "--backend=gloo",
    "--learning_rate=2.0",
    "--max_iters=240",
    "--warmup_iters=300",
    "--iter_time=0.01",
]
STABLE = ["--backend=gloo", "--learning_rate=0.3", "--max_iters=60", "--warmup_iters=100", "--iter_time=0.01"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("script-torchrun")


def supervise(workdir: Path, lineage: str, args: list[str], policy: Path = POLICY, faults: str = ""):
    cwd = workdir / lineage
    cwd.mkdir()
    env = {"OMP_NUM_THREADS": "1", **({FAULTS_ENV: faults} if faults else {})}
    options = RunOptions(
        command=(sys.executable, SCRIPT, *args),
        policy_path=str(policy),
        lineage=lineage,
        workdir=workdir,
        cwd=str(cwd),
        stop_grace_seconds=5,
        env=env,
        launcher=TorchrunLauncher(TorchrunOptions(nproc_per_node=2)),
        max_segments=5,
    )
    lines: list[str] = []
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_line=lambda stream, line: lines.append(line))
    return record, lines


def segment_log(workdir: Path, lineage: str, index: int) -> str:
    return (workdir / "lineages" / lineage / "segments" / f"{index}.log").read_text()


def test_a_killed_group_resumes_and_a_divergence_relaunches_every_rank_with_the_template(workdir):
    record, lines = supervise(workdir, "diverge", DIVERGING, faults="kill@45")
    assert record.status == "finished", record.segments[-1].event
    killed, diverged, last = record.segments
    assert killed.event["type"] == "unknown_exit" and killed.outcome == "resume"
    # Resumed from rank 0's newest ckpt.pt, which both ranks read back.
    resumed = sorted(
        set(
            re.findall(
                r"rank (\d): resuming from out/ckpt.pt at iter (\d+)", segment_log(workdir, "diverge", 1)
            )
        )
    )
    assert [rank for rank, _ in resumed] == ["0", "1"] and len({it for _, it in resumed}) == 1
    assert 30 <= int(resumed[0][1]) <= 45
    # Then the printed loss diverged: rolled back and relaunched with the template, on every rank.
    assert diverged.event["type"] in ("divergence", "non_finite") and diverged.outcome == "rollback"
    assert diverged.decision["action"] == "rollback" and diverged.decision["lr_scale"] == 0.25
    assert last.extra["command"][-2:] == ["--init_from=resume", "--learning_rate=0.5"]
    relaunched = segment_log(workdir, "diverge", 2)
    assert sorted(re.findall(r"rank (\d): peak learning rate 0.5", relaunched)) == ["0", "1"]
    rolled_back_to = {
        int(it) for it in re.findall(r"rank \d: resuming from out/ckpt.pt at iter (\d+)", relaunched)
    }
    assert len(rolled_back_to) == 1 and rolled_back_to.pop() <= diverged.event["onset_step"] - 50
    assert last.outcome == "finished" and last.returncode == 0


def test_a_step_printed_by_every_rank_is_logged_once(workdir, tmp_path):
    policy = tmp_path / "stable.yaml"
    policy.write_text(POLICY.read_text().replace("lr: 2.0", "lr: 0.3"))
    record, lines = supervise(workdir, "every-rank", [*STABLE, "--print_all_ranks=True"], policy)
    assert record.status == "finished" and len(record.segments) == 1, record.segments[-1].event
    # Both ranks printed every step (on one shared pipe, so a line may hold the ends of two prints).
    printed = [int(m) for m in re.findall(r"iter (\d+):", segment_log(workdir, "every-rank", 0))]
    assert sorted(printed) == sorted(list(range(60)) * 2)
    client = MlflowClient(tracking_uri=record.mlflow.tracking_uri)
    steps = [m.step for m in client.get_metric_history(record.mlflow.run_id, "loss")]
    assert sorted(steps) == list(range(60))  # ... and each step was logged once


def test_on_two_nodes_a_lost_node_resumes_both_from_rank_0s_newest_version(workdir, tmp_path):
    """Two torchrun nodes of one rank each (c10d on 127.0.0.1): the drill's external `kill` at iteration 35
    takes node 0 whole (its agent and rank 0, where the script's output is read); one event (a lost node, a
    `hardware_fault` this policy resumes from), one decision, and both nodes relaunched with
    `--init_from=resume` from the same version of rank 0's ckpt.pt."""
    from policies import load_policy
    from supervisor.launcher.slurm import launcher_from_policy
    from tests.nodekit import two_nodes

    policy = tmp_path / "nodes.yaml"
    text = POLICY.read_text().replace("lr: 2.0", "lr: 0.3")
    text = text.replace(
        "[preemption, unknown_exit, hang]", "[preemption, unknown_exit, hang, hardware_fault]"
    )
    text = text.replace("[software_error, hardware_fault, oom,", "[software_error, oom,")
    policy.write_text(text + two_nodes())
    cwd = workdir / "nodes"
    cwd.mkdir()
    options = RunOptions(
        command=(sys.executable, SCRIPT, *STABLE),
        policy_path=str(policy),
        lineage="nodes",
        workdir=workdir,
        cwd=str(cwd),
        stop_grace_seconds=5,
        env={"OMP_NUM_THREADS": "1", FAULTS_ENV: "kill@35"},
        launcher=launcher_from_policy(load_policy(policy).launcher, workdir / "nodes-wd"),
        max_segments=4,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise()
    assert record.status == "finished", record.segments[-1].event
    lost, last = record.segments
    assert lost.event["type"] == "hardware_fault" and lost.event["evidence"]["kind"] == "node_lost", (
        lost.event
    )
    assert lost.decision["action"] == "resume" and not last.event
    resumed = re.findall(
        r"rank (\d): resuming from out/ckpt.pt at iter (\d+)", segment_log(workdir, "nodes", 1)
    )
    assert sorted(rank for rank, _ in resumed) == ["0", "1"] and len({it for _, it in resumed}) == 1
    assert 20 <= int(resumed[0][1]) <= 35  # rank 0's newest version (it saves every 10) before the kill
