"""A replayed bit flip under the real SLURM launcher (issue 28): the host the replay blames is excluded, and the
relaunched job carries it in `--exclude`.

The lineage runs examples/charlm.py in the test cluster's hidden partition `pair` (localhost, and `spare`, a node
that never runs: tests/slurm_cluster.py), so excluding localhost leaves a host and is admitted. `sdc@4` is
replayed in process and differs (`hardware_fault`, evidence `replay_mismatch`, naming this machine's hostname,
which is localhost's NodeHostname); `kill@8` then ends the job, and the resume submits a job that excludes
localhost. Only the down spare could run it: it stays pending until the test cancels it, which ends the lineage.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from supervisor.launcher.slurm import launcher_from_policy, slurm
from supervisor.launcher.slurm_states import parse_job
from tests.flowkit import CHARLM
from tests.slurm_cluster import PAIR, slurm_cluster  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]

POLICY = f"""\
version: 1
name: replay-slurm
checkpoint: {{every_steps: 2, keep_last: 20, memory_slots: 4, async: false, storage: ./checkpoints}}
monitor:
  poll_seconds: 0.5
  detectors:
    - {{type: non_finite, metrics: [loss]}}
    - {{type: threshold, metric: loss, above: 100}}
  replay: {{enabled: true, max_steps: 4, when: [non_finite, threshold]}}
rules:
  - when: [non_finite, threshold]
    action: rollback
    target: {{select: latest}}
  - when: [preemption, unknown_exit]
    action: resume
    target: {{select: latest}}
limits:
  backoff: {{initial_seconds: 0.1, max_seconds: 1, multiplier: 2, jitter: false}}
launcher: {{type: slurm, slurm: {{partition: {PAIR}, poll_seconds: 0.5, warning_seconds: null}}}}
"""


def job_ids(workdir: Path) -> list[str]:
    """The SLURM jobs the lineage's segments ran as, so far."""
    path = workdir / "lineages" / "t" / "lineage.json"
    segments = json.loads(path.read_text())["segments"] if path.exists() else []
    return [seg["slurm_job_id"] for seg in segments if seg.get("slurm_job_id")]


def pending_job(workdir: Path, index: int, timeout: float = 180.0) -> str:
    """The SLURM job of segment `index` once the record names it (the runner saves it at launch)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = job_ids(workdir)
        if len(jobs) > index:
            return jobs[index]
        time.sleep(0.3)
    raise AssertionError(f"segment {index} was not launched in {timeout:.0f}s")


def test_a_replay_mismatch_excludes_its_host_from_the_relaunched_job(slurm_cluster, tmp_path: Path, capsys):  # noqa: F811
    from supervisor.cli import main
    from supervisor.orchestrator import LineageRunner, RunOptions, python_command

    policy, workdir = tmp_path / "policy.yaml", tmp_path / "wd"
    policy.write_text(POLICY)
    example = [CHARLM, "--size", "tiny", "--batch-size", "4", "--eval-every", "1000", "--threads", "1"]
    options = RunOptions(
        command=python_command(["python", *example, "--steps", "12"]),
        policy_path=str(policy),
        lineage="t",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "sdc@4,kill@8"},
        cwd=str(REPO),
        max_segments=3,
        launcher=launcher_from_policy(_launcher_config(policy), workdir),
    )
    outcome: dict = {}
    with LineageRunner(options, sleep=lambda s: None) as runner:
        thread = threading.Thread(target=lambda: outcome.update(runner.supervise().to_dict()), daemon=True)
        thread.start()
        try:
            job = pending_job(workdir, 1)
            shown = parse_job(slurm(["scontrol", "show", "job", "-o", job]).stdout)
            # Pending for good: its partition's one other node is down.
            assert (shown.fields["ExcNodeList"], shown.fields["Partition"]) == ("localhost", PAIR)
            assert shown.queued, shown.fields
        finally:  # an outside cancel of the pending job ends the lineage (stopped); any other job goes too
            for job_id in job_ids(workdir):
                slurm(["scancel", job_id], check=False)
            thread.join(60)
    assert not thread.is_alive(), "the runner did not end after the pending job was cancelled"

    assert (outcome["status"], len(outcome["segments"])) == ("stopped", 2), outcome.get("final_reason")
    killed, pending = outcome["segments"]
    (entry,) = killed["in_process"]
    assert entry["kind"] == "replay" and entry["replay"]["verdict"] == "replay_mismatch"
    evidence = entry["event"]["evidence"]
    assert entry["event"]["type"] == "hardware_fault" and evidence["evidence"] == "replay_mismatch"
    assert evidence["hosts"] == [socket.gethostname()]  # the training's hostname: localhost's NodeHostname
    assert killed["event"]["evidence"]["rule"] == "sigkill" and killed["decision"]["action"] == "resume"
    assert killed["hosts"] == ["localhost"]
    assert pending["event"]["evidence"]["kind"] == "outside_cancel" and pending["outcome"] == "stopped"
    (excluded,) = outcome["excluded_hosts"]
    assert (excluded["host"], excluded["event"], excluded["segment"]) == ("localhost", "hardware_fault", 0)
    assert "replay" in excluded["reason"] and not outcome.get("not_excluded")
    assert parse_job(slurm(["scontrol", "show", "job", "-o", pending_job(workdir, 1)]).stdout).finished

    assert main(["status", "--workdir", str(workdir), "--json"]) == 0
    (view,) = json.loads(capsys.readouterr().out)["lineages"]
    assert [(row["host"], row["event"]) for row in view["excluded_hosts"]] == [
        ("localhost", "hardware_fault")
    ]
    assert view["excluded_hosts"][0]["reason"] == excluded["reason"]


def _launcher_config(policy: Path):
    from policies import load_policy

    return load_policy(policy).launcher
