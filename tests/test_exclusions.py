"""Relaunching away from a bad host (issue 28, item 4), without processes: which host an event blames, whether
excluding it leaves enough, the decision step that owns the list, each launcher's rendering of it (the sbatch
command line, the multi-node exit, the follower that refuses), and `status` / `exclusions clear` on a record."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

from policies import History, parse_policy
from supervisor.cli import main
from supervisor.events import Event
from supervisor.launcher import ExitInfo
from supervisor.launcher.follower import EXIT_EXCLUDED, Follower
from supervisor.launcher.multinode import NodeExit, combine_exits
from supervisor.launcher.node_channel import Channel, read_json, write_json
from supervisor.launcher.slurm_script import sbatch_command
from supervisor.lineage import LineageRecord, LineageStore, MlflowRef, SegmentRecord
from supervisor.lineage.exclusions import Exclusion, HostPool, admit, exclusions_from
from supervisor.orchestrator import SegmentResult
from supervisor.orchestrator.decision_step import DecisionStep
from supervisor.orchestrator.events_log import EventsLog

POLICY = parse_policy(
    """
version: 1
name: t
rules:
  - {when: [hardware_fault, preemption], action: resume, target: {select: latest}, allow_scratch: true}
  - {when: [straggler], action: resume, target: {select: latest}, allow_scratch: true}
  - {when: [spike], action: stop}
limits: {backoff: {initial_seconds: 0, jitter: false}}
"""
)


def hw(**evidence) -> Event:
    return Event(type="hardware_fault", reason="Xid 79", source="exit", evidence=evidence)


# -- which hosts an event blames -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event, ran_on, expected",
    [
        # a replay mismatch names the hosts of the ranks whose values parted
        (hw(evidence="replay_mismatch", hosts=["n2", "n2", "n5"], ranks=[3, 9]), ["n1", "n2"], [("n2", True), ("n5", True)]),
        # a straggler names its slow rank's host
        (Event(type="straggler", reason="slow", evidence={"rank": 1, "host": "n4"}), ["n1", "n4"], [("n4", True)]),
        # a lost pod's node
        (hw(kind="node_lost", k8s_node="node-a"), ["node-a", "node-b"], [("node-a", True)]),
        # the classifier names none: the one host the segment ran on
        (hw(pattern="xid"), ["n7"], [("n7", True)]),
        # several hosts and nothing naming one: a guess would exclude the whole job, so none, saying why
        (hw(pattern="xid"), ["n1", "n2"], [("n1, n2", False)]),
        # where it ran is unknown (a job that never started): nothing
        (hw(pattern="xid"), [], []),
    ],
)  # fmt: skip
def test_exclusions_from_names_the_blamed_hosts(event, ran_on, expected):
    found = exclusions_from(event, ran_on, segment=3, time=50.0)
    assert [(e.host, e.excluded) for e in found] == expected
    assert all(e.segment == 3 and e.time == 50.0 and e.event == event.type for e in found)
    if found and not found[0].excluded:
        assert (
            found[0].reason == "not excluded: the event names no host and segment 3 ran on 2 hosts (n1, n2)"
        )


def cand(host: str) -> Exclusion:
    return Exclusion(host, "hardware_fault: Xid 79", "hardware_fault", 1, 9.0)


@pytest.mark.parametrize(
    "hosts, current, pool, expected",
    [
        # a cluster of 4, a job of 2: two may go, the third would leave 1
        (["a", "b", "c"], [], HostPool(2, ("a", "b", "c", "d")), ["a", "b", "c: not excluded: excluding c would leave 1 of the 4 host(s) this launcher can use, and a segment needs 2"]),
        # already excluded: left out, and it counts against what is left
        (["a", "b"], ["a"], HostPool(2, ("a", "b", "c")), ["b: not excluded: excluding b would leave 1 of the 3 host(s) this launcher can use, and a segment needs 2"]),
        # this machine alone
        (["me"], [], HostPool(1, ("me",), "the segments run on this machine only"), ["me: not excluded: excluding me would leave 0 of the 1 host(s) this launcher can use, and a segment needs 1; the segments run on this machine only"]),
        # a pool the launcher cannot list: taken as named
        (["x", "y"], [], HostPool(8, None), ["x", "y"]),
        # a full name whose short form is the node's name is recorded short; an unknown name is kept
        (["gpu7.cluster", "laptop"], [], HostPool(1, ("gpu7", "gpu8")), ["gpu7", "laptop: not excluded: laptop is not a host this launcher places segments on (gpu7, gpu8)"]),
        (["a", "a"], [], HostPool(1, None), ["a"]),
        # a SLURM node's hostname (a replay names the machine it ran on) is recorded as the node's name
        (["vm", "vm.lan"], [], HostPool(1, ("node1", "spare"), aliases={"vm": "node1"}), ["node1"]),
    ],
)  # fmt: skip
def test_admit_never_leaves_fewer_hosts_than_a_segment_needs(hosts, current, pool, expected):
    found = admit([cand(h) for h in hosts], current, pool)
    shown = [e.host if e.excluded else f"{e.host}: {e.reason}" for e in found]
    assert shown == expected


# -- the decision step owns the list -------------------------------------------------------------------------


def _step(tmp_path: Path, pool: HostPool | None) -> DecisionStep:
    return DecisionStep(
        POLICY,
        history=History(),
        events=EventsLog(tmp_path / "events.jsonl"),
        catalog=lambda: None,
        run=_Run(),
        save=lambda: None,
        clock=lambda: 1000.0,
        host_pool=(lambda: pool) if pool is not None else None,
    )


class _Run:
    def tag(self, key: str, text: str) -> None:
        pass

    def terminate(self, status: str) -> None:
        pass


def _record(*segments: SegmentRecord) -> LineageRecord:
    return LineageRecord(
        lineage="L", status="running", mlflow=MlflowRef("u", "e", "r"), segments=list(segments)
    )


def test_a_hardware_fault_on_a_slurm_node_excludes_it_and_a_second_one_is_refused(tmp_path):
    step = _step(tmp_path, HostPool(1, ("n1", "n2"), "the cluster has 2 node(s)"))
    seg0 = SegmentRecord(index=0, started=0.0, host="login")
    record = _record(seg0)
    exit0 = ExitInfo(
        1, "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus", "", None, "17", 1.0, hosts=("n1",)
    )
    decision = step.conclude(record, SegmentResult(0, exit0, None, 0.0, 1.0, 5))
    assert decision.action == "resume" and seg0.hosts == ["n1"]
    assert record.excluded_hosts == [
        {
            "host": "n1",
            "reason": record.excluded_hosts[0]["reason"],
            "event": "hardware_fault",
            "segment": 0,
            "time": 1000.0,
        }
    ] and record.excluded_hosts[0]["reason"].startswith("hardware_fault: ")
    assert record.exclusions() == ("n1",)
    seg1 = SegmentRecord(index=1, started=2.0, host="login")
    record.segments.append(seg1)
    step.conclude(
        record,
        SegmentResult(
            1, ExitInfo(1, exit0.stderr_tail, "", None, "18", 1.0, hosts=("n2",)), None, 2.0, 3.0, 6
        ),
    )
    assert record.exclusions() == ("n1",)  # n2 is the last node left
    assert record.not_excluded[0]["host"] == "n2"
    assert record.not_excluded[0]["reason"] == (
        "not excluded: excluding n2 would leave 0 of the 2 host(s) this launcher can use, and a segment needs 1; "
        "the cluster has 2 node(s)"
    )  # fmt: skip


def test_on_the_local_launcher_this_machine_is_never_excluded(tmp_path):
    step = _step(tmp_path, None)  # the default pool: this machine
    seg = SegmentRecord(index=0, started=0.0, host=socket.gethostname())
    record = _record(seg)
    step.apply(record, seg, hw(pattern="xid"))
    assert record.excluded_hosts is None and record.exclusions() == ()
    assert record.not_excluded[0]["host"] == socket.gethostname()
    assert record.not_excluded[0]["reason"].endswith("the segments run on this machine only")


@pytest.mark.parametrize("action, excluded", [("resume, allow_scratch: true", ["n4"]), ("stop", [])])
def test_a_straggler_excludes_its_host_only_when_the_rule_relaunches(tmp_path, action, excluded):
    step = _step(tmp_path, HostPool(1, None))
    step.policy = parse_policy(f"version: 1\nname: t\nrules: [{{when: [straggler], action: {action}}}]\n")
    seg = SegmentRecord(index=0, started=0.0, host="login")
    record = _record(seg)
    step.apply(record, seg, Event(type="straggler", reason="rank 1 slow", evidence={"rank": 1, "host": "n4"}))
    assert [e["host"] for e in record.excluded_hosts or []] == excluded


def test_a_replay_mismatch_in_events_jsonl_excludes_the_hosts_it_names(tmp_path):
    step = _step(tmp_path, HostPool(2, None))
    mismatch = hw(evidence="replay_mismatch", hosts=["n3"], ranks=[1], device="cuda:1").to_dict()
    anomaly = Event(type="spike", reason="loss spiked", metric="loss", onset_step=13, step=13).to_dict()
    line = {
        "kind": "replay",
        "event": mismatch,
        "anomaly": anomaly,
        "replay": {"reason": "parted"},
        "time": 5.0,
    }
    (tmp_path / "events.jsonl").write_text(json.dumps(line) + "\n")
    seg = SegmentRecord(index=0, started=0.0, host="login")
    record = _record(seg)
    assert (
        step.conclude(record, SegmentResult(0, ExitInfo(0, "", "", None, "1", 1.0), None, 0.0, 1.0, 20))
        is None
    )
    assert [e["host"] for e in record.excluded_hosts] == ["n3"] and seg.outcome == "finished"


def test_the_record_round_trips_its_lists_and_an_old_record_gains_none():
    old = _record(SegmentRecord(index=0, started=0.0)).to_dict()
    assert "excluded_hosts" not in old and "hosts" not in old["segments"][0]
    record = LineageRecord.from_dict(old)
    record.put(
        excluded_hosts=[{"host": "a", "reason": "r", "event": "hardware_fault", "segment": 0, "time": 1.0}]
    )
    record.segments[0].put(hosts=["a"])
    again = LineageRecord.from_dict(record.to_dict())
    assert again.to_dict() == record.to_dict() and again.exclusions() == ("a",)


# -- the launchers ---------------------------------------------------------------------------------------------


def test_sbatch_command_excludes_the_hosts(tmp_path):
    script = tmp_path / "j.sbatch"
    assert sbatch_command(script, inherit_env=True) == ["sbatch", "--parsable", "--export=ALL", str(script)]
    assert sbatch_command(script, inherit_env=False, exclude_hosts=("n1", "n7")) == [
        "sbatch", "--parsable", "--export=NONE", "--exclude=n1,n7", str(script),
    ]  # fmt: skip
    with pytest.raises(Exception, match="excluded host names must be SLURM node names"):
        sbatch_command(script, inherit_env=True, exclude_hosts=("a,b",))


def test_a_lost_node_names_its_host_and_the_exit_every_host():
    nodes = [
        NodeExit(0, 1, agent_returncode=1, host="h0"),
        NodeExit(1, None, lost="its follower stopped beating", host="h1"),
    ]
    info = combine_exits(nodes, signal_sent=None, handle_id="r", hosts=("h0", "h1"))
    assert (info.cause, info.cause_evidence["host"], info.hosts) == ("hardware_fault", "h1", ("h0", "h1"))
    assert [(e.host, e.excluded) for e in exclusions_from(Event("hardware_fault", "lost", evidence=dict(info.cause_evidence)), info.hosts, segment=0, time=0.0)] == [("h1", True)]  # fmt: skip


def test_a_follower_on_an_excluded_host_refuses_its_run_order_and_leaves(tmp_path, caplog):
    channel = Channel(tmp_path / "chan")
    channel.node_dir(1).mkdir(parents=True)
    write_json(channel.owner, {"owner": "o", "pid": 1, "host": "x", "beats": 1})
    order = {"owner": "o", "seq": 1, "action": "run", "segment": 2, "command": ["false"], "env": {}, "cwd": None,
             "exclude_hosts": ["elsewhere", socket.gethostname()]}  # fmt: skip
    write_json(channel.order(1), order)
    follower = Follower(channel, 1, "o", beat_seconds=0.01, owner_timeout=30.0)
    with caplog.at_level("ERROR", logger="rollback_supervisor.follower"):
        assert follower.run() == EXIT_EXCLUDED
    state = read_json(channel.state(1))
    assert state["status"] == "exited" and state["segment"] == 2 and follower.agent is None
    assert f"host {socket.gethostname()} is excluded from this lineage" in state["exit"]["refused"]
    assert "node 1: refusing segment 2" in caplog.text
    # not excluded: the order is obeyed (the agent starts)
    order["exclude_hosts"] = ["elsewhere"]
    order["command"] = [sys.executable, "-c", "import time; time.sleep(60)"]
    write_json(channel.order(1), {**order, "seq": 2})
    other = Follower(Channel(tmp_path / "chan"), 1, "o", beat_seconds=0.01)
    other.seq = 1
    other._step(time.monotonic())
    assert other.refused is None and other.agent is not None
    other._end_agent(0.0, 9)


# -- status and `exclusions clear` -------------------------------------------------------------------------------


def _write(workdir: Path, lineage: str = "L", excluded: tuple[str, ...] = ("n1", "n2")) -> Path:
    record = _record(SegmentRecord(index=0, started=1.0, ended=2.0, hosts=["n1"]))
    record.put(
        excluded_hosts=[
            {"host": h, "reason": "hardware_fault: Xid 79", "event": "hardware_fault", "segment": 0, "time": 2.0}
            for h in excluded
        ],
        not_excluded=[{"host": "n9", "reason": "not excluded: the last node", "event": "straggler", "segment": 0, "time": 2.0}],
    )  # fmt: skip
    directory = workdir / "lineages" / lineage
    LineageStore(str(directory)).save(record.to_dict())
    return directory


def test_status_shows_the_lists_and_clear_empties_them(tmp_path, capsys):
    directory = _write(tmp_path)
    assert main(["status", "--workdir", str(tmp_path), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)["lineages"][0]
    assert [e["host"] for e in view["excluded_hosts"]] == ["n1", "n2"]
    assert view["not_excluded"][0] == {"host": "n9", "reason": "not excluded: the last node", "event": "straggler", "segment": 0, "time": 2.0}  # fmt: skip
    assert main(["status", "--workdir", str(tmp_path), "--width", "160"]) == 0
    out = capsys.readouterr().out
    assert "excluded hosts (the next launches avoid them" in out and "  n2: [segment 0, " in out
    assert "hosts blamed but kept:" in out and "n9: " in out
    assert main(["exclusions", "clear", "--workdir", str(tmp_path), "--lineage", "L", "--host", "n2"]) == 0
    assert "cleared 1 excluded host(s): n2" in capsys.readouterr().out
    assert LineageRecord.from_dict(LineageStore(str(directory)).load()).exclusions() == ("n1",)
    assert main(["exclusions", "clear", "--workdir", str(tmp_path), "--lineage", "L"]) == 0
    assert "cleared 1 excluded host(s): n1" in capsys.readouterr().out
    assert LineageStore(str(directory)).load()["excluded_hosts"] == []
    assert (
        not (directory / "lease.json").exists()
        or json.loads((directory / "lease.json").read_text())["owner"] == ""
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lineage", "nope"], "error: --lineage nope: no "),
        (["--lineage", "L", "--host", "n5"], "error: --host n5: not an excluded host of lineage L; expected one of: n1, n2\n"),
    ],
)  # fmt: skip
def test_clear_refuses_an_unknown_lineage_or_host(tmp_path, capsys, args, message):
    _write(tmp_path)
    assert main(["exclusions", "clear", "--workdir", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err and err.count("\n") == 1
    if "nope" in args:
        assert "expected one of: L" in err


def test_clear_waits_for_the_running_supervisor(tmp_path, capsys):
    from supervisor.lineage import Lease

    directory = _write(tmp_path)
    lease = Lease(str(directory), ttl_seconds=60.0, owner="other-host:1:abc")
    lease.acquire()
    try:
        assert main(["exclusions", "clear", "--workdir", str(tmp_path), "--lineage", "L"]) == 2
    finally:
        lease.release()
    err = capsys.readouterr().err
    assert err.startswith("error: exclusions clear --lineage L: the lineage is being supervised right now")
    assert LineageRecord.from_dict(LineageStore(str(directory)).load()).exclusions() == ("n1", "n2")


def test_the_kubernetes_job_keeps_its_pods_off_the_excluded_hosts():
    pytest.importorskip("kubernetes", reason="the Kubernetes launcher needs `pip install '.[kubernetes]'`")
    from policies.launcher_schema import KubernetesSpec
    from supervisor.launcher.base import LaunchSpec
    from supervisor.launcher.kubernetes_manifests import job_manifest
    from tests.test_kubernetes_manifests import round_trip

    options = KubernetesSpec(image="rs:1", nodes=2, node_selector={"pool": "gpu"})
    spec = LaunchSpec(("python", "train.py"), name="L-3")
    assert (
        "affinity"
        not in round_trip(job_manifest(options, spec, "l-3-abc"), "V1Job")["spec"]["template"]["spec"]
    )
    excluded = LaunchSpec(("python", "train.py"), name="L-3", exclude_hosts=("gpu-7", "gpu-9"))
    pod = round_trip(job_manifest(options, excluded, "l-3-abc"), "V1Job")["spec"]["template"]["spec"]
    assert pod["affinity"] == {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {
                                "key": "kubernetes.io/hostname",
                                "operator": "NotIn",
                                "values": ["gpu-7", "gpu-9"],
                            }
                        ],
                        "matchFields": [
                            {"key": "metadata.name", "operator": "NotIn", "values": ["gpu-7", "gpu-9"]}
                        ],
                    }
                ]
            }
        }
    }
    assert pod["nodeSelector"] == {"pool": "gpu"}  # the policy's own placement stays
