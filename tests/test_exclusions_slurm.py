"""Excluded hosts against the real test SLURM cluster (one node, `localhost`): the partition is the pool, a
hardware fault on its only node keeps the node (a segment needs one), and an exclusion reaches the job."""

from __future__ import annotations

import dataclasses
import socket
import sys
from pathlib import Path

from policies import History, parse_policy
from supervisor.launcher.base import LaunchSpec
from supervisor.launcher.slurm import SlurmLauncher, slurm
from supervisor.launcher.slurm_script import SlurmOptions
from supervisor.launcher.slurm_states import parse_job
from supervisor.lineage import LineageRecord, MlflowRef, SegmentRecord
from supervisor.orchestrator import SegmentResult
from supervisor.orchestrator.decision_step import DecisionStep
from supervisor.orchestrator.events_log import EventsLog
from tests.slurm_cluster import slurm_cluster  # noqa: F401 (the fixture)

#: A task whose GPU "falls off the bus": the drill's Xid line on stderr, exit 1.
XID = "import sys; print('NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.', file=sys.stderr); sys.exit(1)"  # noqa: E501
POLICY = parse_policy(
    "version: 1\nname: t\nrules: [{when: [hardware_fault], action: resume, allow_scratch: true}]\n"
)


class _Run:
    def tag(self, key: str, text: str) -> None:
        pass

    def terminate(self, status: str) -> None:
        pass


def test_a_fault_on_the_only_node_keeps_it_and_an_exclusion_reaches_the_job(slurm_cluster, tmp_path: Path):  # noqa: F811
    launcher = SlurmLauncher(SlurmOptions(job_dir=tmp_path / "jobs", poll_seconds=0.2, warning_seconds=None))
    pool = launcher.host_pool()
    assert (pool.needed, pool.hosts) == (1, ("localhost",))
    info = launcher.start(LaunchSpec((sys.executable, "-c", XID), name="ex-0")).wait(120)
    assert (info.returncode, info.hosts) == (
        1,
        ("localhost",),
    )  # the job's nodelist, not the supervisor's host

    step = DecisionStep(
        POLICY,
        history=History(),
        events=EventsLog(tmp_path / "events.jsonl"),
        catalog=lambda: None,
        run=_Run(),
        save=lambda: None,
        clock=lambda: 100.0,
        host_pool=launcher.host_pool,
    )
    seg = SegmentRecord(index=0, started=0.0, host=socket.gethostname())
    record = LineageRecord(lineage="L", status="running", mlflow=MlflowRef("u", "e", "r"), segments=[seg])
    decision = step.conclude(record, SegmentResult(0, info, None, 0.0, 1.0, None))
    assert (
        decision.action == "resume" and seg.event["type"] == "hardware_fault" and seg.hosts == ["localhost"]
    )
    assert record.exclusions() == ()
    assert record.not_excluded == [
        {
            "host": "localhost",
            "reason": "not excluded: excluding localhost would leave 0 of the 1 host(s) this launcher can use, "
            "and a segment needs 1; partition debug (the default) has 1 node(s)",
            "event": "hardware_fault",
            "segment": 0,
            "time": 100.0,
        }
    ]

    # Where the pool allows it, the next job goes out with --exclude: held, so it never runs on this one node.
    held = SlurmLauncher(
        SlurmOptions(
            job_dir=tmp_path / "jobs", poll_seconds=0.2, warning_seconds=None, extra_sbatch=("--hold",)
        )
    )
    job = held.start(LaunchSpec((sys.executable, "-c", "pass"), name="ex-1", exclude_hosts=("localhost",)))
    try:
        shown = parse_job(slurm(["scontrol", "show", "job", "-o", job.job_id]).stdout)
        assert shown.fields["ExcNodeList"] == "localhost"
    finally:
        job.stop(30)
        job.wait(30)


def test_a_requeue_lineage_submits_a_new_job_when_its_exclusions_change(slurm_cluster, tmp_path: Path):  # noqa: F811
    options = SlurmOptions(
        job_dir=tmp_path / "jobs", poll_seconds=0.2, warning_seconds=None, relaunch="requeue"
    )
    launcher = SlurmLauncher(options)
    first = launcher.start(LaunchSpec((sys.executable, "-c", "pass"), name="rq-0"))
    assert first.wait(120).returncode == 0  # done: `scontrol requeue` could run it again
    # Its one node is now excluded: held, since SLURM refuses a job that no node could run (the supervisor never
    # excludes that much); a requeue would keep the first job's id, and its constraints.
    launcher.options = dataclasses.replace(options, extra_sbatch=("--hold",))
    second = launcher.start(
        LaunchSpec((sys.executable, "-c", "pass"), name="rq-1", exclude_hosts=("localhost",))
    )
    try:
        assert second.job_id != first.job_id and second.relaunch == "sbatch"
        shown = parse_job(slurm(["scontrol", "show", "job", "-o", second.job_id]).stdout)
        assert shown.fields["ExcNodeList"] == "localhost" and shown.queued
    finally:
        second.stop(30)
        second.wait(30)
