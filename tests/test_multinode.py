"""A lineage across nodes (issue 17, item 5), simulated on this machine: two torchrun agents with a c10d
rendezvous on 127.0.0.1, node 0's run by the supervisor (the owner), node 1's by a follower the owner started.

The end-to-end test runs the real `LineageRunner` with the launcher a policy's `launcher: {type: torchrun,
torchrun: {nodes: 2, nproc_per_node: 2}}` builds, on the FSDP2 Session child over 4 ranks. It
SIGKILLs node 1 (its agent's process group and each rank's, which torchrun starts in sessions of their own)
after the step-20 checkpoint: node 0's ranks fail in their next collective, the owner records one event (a lost
node) and one decision (resume), relaunches both nodes from step 20, and the finish is bit-identical to an
uninterrupted two-node run. The pure parts (merging the nodes' exits, the policy section) are table tests.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from policies import load_policy
from policies.launcher_schema import LauncherConfig
from policies.loader import parse_policy
from supervisor.errors import PolicyError, UserError
from supervisor.launcher.base import LaunchSpec
from supervisor.launcher.multinode import MultinodeLauncher, MultinodeOptions, NodeExit, combine_exits
from supervisor.launcher.node_channel import read_json
from supervisor.launcher.slurm import launcher_from_policy
from supervisor.lineage.record import LineageRecord
from tests.flowkit import FAST_POLICY

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "sharded_workers" / "multinode_child.py"
STEPS = 30  # the fast policy checkpoints every 20 steps
WORLD = 4  # 2 nodes of 2 ranks
PAUSE = 25  # node 1 stops here (after the step-20 checkpoint) and is killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- merging the nodes' exits (pure) --------------------------------------------------------------


def _exit(node: int, code: int | None, seen: int, **kw: Any) -> NodeExit:
    return NodeExit(node, code, stderr_tail=f"tail of node {node}", seen=seen, **kw)


@pytest.mark.parametrize(
    ("nodes", "ours", "code", "cause", "lost_node"),
    [
        # node 1's agent SIGKILLed by someone else: a lost node, whatever node 0 then says
        ([_exit(0, 1, 1), _exit(1, -9, 0, agent_returncode=-9)], None, -9, "hardware_fault", 1),
        ([_exit(0, 1, 0), _exit(1, 137, 1, agent_returncode=137)], None, 137, "hardware_fault", 1),
        # a rank SIGKILLed (the OOM killer) under node 1's live agent, which exits 1: a failed rank, as on one node
        ([_exit(0, 1, 1, agent_returncode=1), _exit(1, -9, 0, agent_returncode=1)], None, -9, None, None),
        # node 1's follower stopped beating: lost, its code unknown; the first known failure's code is kept
        (
            [_exit(0, 1, 0), _exit(1, None, 1, lost="its follower stopped beating (31s)")],
            None,
            1,
            "hardware_fault",
            1,
        ),
        # every node SIGKILLed by our own stop: no verdict, the classifier sees a stop of ours
        (
            [_exit(0, -9, 0, signal_sent=9), _exit(1, -9, 1, signal_sent=9, agent_returncode=-9)],
            9,
            -9,
            None,
            None,
        ),
        # a node lost before our stop was sent: the stop does not hide it; lost after it: the stop explains it
        (
            [_exit(0, -15, 1, signal_sent=15), _exit(1, None, 0, lost="its follower exited")],
            15,
            -15,
            "hardware_fault",
            1,
        ),
        (
            [
                _exit(0, -15, 1, signal_sent=15),
                _exit(1, None, 0, lost="its follower exited", lost_after_stop=True),
            ],
            15,
            -15,
            None,
            None,
        ),
        # node 1 stopped before its follower read the run order: ended, not failed
        (
            [_exit(0, -15, 0, signal_sent=15), _exit(1, None, 1, signal_sent=15, never_started=True)],
            15,
            -15,
            None,
            None,
        ),
        # killed by us because a peer had failed: not lost; the first failure (a rank's exit 75) speaks
        ([_exit(0, 75, 0), _exit(1, -9, 1, signal_sent=9, killed_after_peer=True)], None, 75, None, None),
        # an anomaly reported on every rank: both nodes exit 76
        ([_exit(0, 76, 1), _exit(1, 76, 0)], None, 76, None, None),
        ([_exit(0, 0, 0), _exit(1, 0, 1)], None, 0, None, None),
    ],
)
def test_combine_exits(nodes, ours, code, cause, lost_node):
    info = combine_exits(nodes, signal_sent=ours, handle_id="rdzv")
    assert (info.returncode, info.cause) == (code, cause)
    assert info.signal_sent == ours and info.handle_id == "rdzv"
    if lost_node is not None:
        assert info.cause_evidence["kind"] == "node_lost" and info.cause_evidence["node"] == lost_node
        assert info.stderr_tail.startswith(f"--- node {lost_node} ")  # the lost node's tail comes first
    else:
        assert info.cause_evidence == {}
    assert "tail of node 0" in info.stderr_tail and "tail of node 1" in info.stderr_tail


def test_policy_section_asks_for_nodes_and_is_checked(tmp_path: Path):
    config = LauncherConfig(type="torchrun", torchrun={"nodes": 2, "rdzv_endpoint": "10.0.0.1:29400"})
    launcher = launcher_from_policy(config, tmp_path)
    assert isinstance(launcher, MultinodeLauncher)
    assert launcher.channel.root.parent == tmp_path / "multinode"
    cmd = launcher.options.torchrun(1)
    assert (cmd.nnodes, cmd.rdzv_endpoint) == ("2", "10.0.0.1:29400")
    assert (
        "is_host=false" in cmd.extra_args[1] and "is_host=true" in launcher.options.torchrun(0).extra_args[1]
    )
    base = FAST_POLICY.read_text()
    for section, message in (
        ("type: torchrun\n  torchrun: {nodes: 2}", "launcher.torchrun.rdzv_endpoint: expected host:port"),
        (
            "type: torchrun\n  torchrun: {nodes: 2, rdzv_endpoint: 'h:0'}",
            "rdzv_endpoint: expected a fixed port",
        ),
        ("type: torchrun\n  torchrun: {nodes: 2, rdzv_endpoint: head}", "rdzv_endpoint: expected host:port"),
        ("type: torchrun\n  torchrun: {nproc_per_node: 0}", "launcher.torchrun.nproc_per_node"),
        ("type: local\n  torchrun: {nodes: 1}", "launcher.type: expected torchrun"),
    ):
        with pytest.raises(PolicyError, match=message):
            parse_policy(f"{base}launcher:\n  {section}\n", "p.yaml")
    with pytest.raises(UserError, match="nodes"):
        MultinodeOptions(nodes=1, rdzv_endpoint="h:1", channel_dir=tmp_path)


# -- two nodes on this machine, end to end -------------------------------------------------------


def write_policy(path: Path, port: int) -> Path:
    """The fast test policy, with every segment on 2 nodes of 2 ranks each (4 ranks on the 2 cores)."""
    text = FAST_POLICY.read_text() + (
        "launcher:\n"
        "  type: torchrun\n"
        "  torchrun:\n"
        "    nodes: 2\n"
        "    nproc_per_node: 2\n"
        f"    rdzv_endpoint: 127.0.0.1:{port}\n"
        "    node_timeout_seconds: 10\n"
        "    peer_exit_grace_seconds: 10\n"
        "    rdzv_join_timeout_seconds: 30\n"
    )
    path.write_text(text)
    return path


def kill_node(launcher: MultinodeLauncher, out: Path, workdir: Path, killed: dict[str, Any]) -> None:
    """Once node 1 paused after the step-20 commit: SIGKILL its agent's process group and each rank's."""
    deadline = time.monotonic() + 60
    manifests: list[Path] = []
    while time.monotonic() < deadline:
        manifests = list(workdir.rglob("ckpt-0000000020-*/manifest.json"))
        if (out / "paused.json").exists() and manifests:
            break
        time.sleep(0.1)
    else:
        killed["error"] = (
            f"node 1 never paused after a step-20 commit (paused: {(out / 'paused.json').exists()})"
        )
        return
    state = read_json(launcher.channel.state(1)) or {}
    agent = psutil.Process(state["agent"]["pid"])
    ranks = agent.children(recursive=True)
    groups = {agent.pid, *(os.getpgid(p.pid) for p in ranks)}
    for group in groups:  # the whole node: its agent's group and every rank's own session
        os.killpg(group, signal.SIGKILL)
    killed.update(agent=agent.pid, ranks=[p.pid for p in ranks], groups=sorted(groups))


def supervise(
    workdir: Path, *, kill: bool, tracking_uri: str | None = None
) -> tuple[LineageRecord, Path, dict[str, Any]]:
    from supervisor.orchestrator import LineageRunner, RunOptions

    out = workdir / "out"
    out.mkdir(parents=True)
    policy = write_policy(workdir / "policy.yaml", free_port())
    launcher = launcher_from_policy(load_policy(policy).launcher, workdir / "wd")
    assert isinstance(launcher, MultinodeLauncher)
    env = {
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONFAULTHANDLER": "1",
    }
    pause = PAUSE if kill else STEPS + 1
    options = RunOptions(
        command=(sys.executable, str(CHILD), str(STEPS), str(out), str(pause)),
        policy_path=str(policy),
        lineage="nodes",
        workdir=workdir / "wd",
        tracking_uri=tracking_uri,
        stop_grace_seconds=10,
        env=env,
        launcher=launcher,
    )
    killed: dict[str, Any] = {}
    killer = threading.Thread(target=kill_node, args=(launcher, out, workdir / "wd", killed), daemon=True)
    if kill:
        killer.start()
    lines: list[str] = []
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_line=lambda s, line: lines.append(line))
    (out / "segments.log").write_text("\n".join(lines))
    if kill:
        killer.join(5)
    killed["followers"] = launcher.follower_exits
    killed["lines"] = lines
    return record, out, killed


def finished(out: Path) -> dict[str, Any]:
    return {
        "tensors": load_file(out / "final.safetensors"),
        "ranks": [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)],
    }


def teardown_crash(segments: list[Any], lines: list[str]) -> Any | None:
    """The segment that ended on a fatal signal after committing the final step, if that is all that differs.

    One clean-clone CI run (of many) saw the relaunched segment's rank 0 end with SIGSEGV after its step-30
    commit, in the run's teardown (full state dict, barrier, destroy_process_group, interpreter exit); the
    supervisor rightly relaunched it, and a third segment restored step 30 and finished. It did not reproduce
    in 36 runs here, two at a time. The test accepts it only in that exact shape, and reports it as a warning
    with the faulthandler trace (PYTHONFAULTHANDLER=1 in the children) so that it can be diagnosed.
    """
    if len(segments) != 3:
        return None
    crashed, after = segments[1], segments[2]
    fatal = crashed.returncode is not None and -crashed.returncode in (signal.SIGSEGV, signal.SIGABRT)
    restored = (after.restore or {}).get("checkpoint_id", "")
    if not (fatal and restored.startswith(f"{STEPS:010d}-") and after.outcome == "finished"):
        return None
    start = next((i for i, line in enumerate(lines) if "Fatal Python error" in line), None)
    trace = "\n".join(lines[start : start + 40]) if start is not None else "(no faulthandler trace)"
    warnings.warn(f"a rank ended with {crashed.returncode} after the final commit:\n{trace}", stacklevel=2)
    return crashed


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_of_a_whole_node_relaunches_every_node_from_the_last_commit_bit_identically(tmp_path: Path):
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"  # one store for both lineages: created once
    clean, clean_out, _ = supervise(tmp_path / "clean", kill=False, tracking_uri=tracking)
    assert clean.status == "finished", clean.segments[-1].event
    assert [s.outcome for s in clean.segments] == ["finished"]

    record, out, killed = supervise(tmp_path / "killed", kill=True, tracking_uri=tracking)
    assert "error" not in killed, killed.get("error")
    assert record.status == "finished", record.segments[-1].event
    crashed = teardown_crash(record.segments, killed["lines"])
    assert len(record.segments) == (3 if crashed else 2), [(s.outcome, s.returncode) for s in record.segments]
    lost, last = record.segments[:2]

    # One event, one decision: the segment end is a lost node (node 1, SIGKILLed), resumed from step 20.
    counted = [s for s in record.segments if s is not crashed]
    events = [s.event for s in counted if s.event] + [r for s in record.segments for r in s.in_process]
    decisions = [s.decision for s in counted if s.decision]
    assert len(events) == 1 and len(decisions) == 1, (events, decisions)
    event = lost.event
    assert event["type"] == "hardware_fault" and event["source"] == "launcher", event
    assert event["evidence"]["kind"] == "node_lost" and event["evidence"]["node"] == 1, event
    assert event["evidence"]["nodes"]["1"]["returncode"] == -signal.SIGKILL
    assert event["evidence"]["nodes"]["0"]["returncode"] != 0  # node 0's rank failed in its collective
    assert lost.decision["action"] == "resume"
    assert last.restore["checkpoint_id"].startswith("0000000020-")
    assert last.outcome == "finished" or last is crashed
    # Node 0's rank did not hang: its collective failed on the closed connection (gloo), within seconds.
    assert lost.ended - lost.started < 60
    assert any(
        "Connection reset by peer" in line or "Connection closed by peer" in line for line in killed["lines"]
    )

    # Nothing is left running: the killed node, the relaunched agents, the followers (closed with the runner).
    assert len(killed["ranks"]) == WORLD // 2  # the whole node: its agent and both its ranks
    assert not any(alive_pid(pid) for pid in [killed["agent"], *killed["ranks"]])
    assert killed["followers"] == {1: 0}  # each told to exit, and it did

    # Both nodes restored their own shards: the finish equals the uninterrupted run's, bit for bit.
    a, b = finished(clean_out), finished(out)
    assert b["tensors"].keys() == a["tensors"].keys() and len(a["tensors"]) > 10
    assert [k for k in a["tensors"] if not torch.equal(a["tensors"][k], b["tensors"][k])] == []
    for rank in range(WORLD):
        for key in ("step", "next_batch", "draw"):
            assert b["ranks"][rank][key] == a["ranks"][rank][key], (rank, key)


# -- the channel's failure modes, with real processes ----------------------------------------------


def test_a_follower_whose_owner_went_silent_kills_its_agent_and_leaves(tmp_path: Path):
    from supervisor.launcher.follower import EXIT_OWNER_LOST, Follower
    from supervisor.launcher.node_channel import Channel, write_json

    channel = Channel(tmp_path)
    write_json(channel.owner, {"owner": "o1", "beats": 1})  # an owner that beat once, then died
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    write_json(channel.order(1), {"owner": "o1", "seq": 1, "action": "run", "segment": 0, "command": sleeper})
    follower = Follower(channel, 1, "o1", beat_seconds=0.05, owner_timeout=1.0)
    started = time.monotonic()
    assert follower.run() == EXIT_OWNER_LOST
    assert 1.0 <= time.monotonic() - started < 10
    state = read_json(channel.state(1))
    assert state is not None and state["status"] == "exited" and state["segment"] == 0
    assert state["exit"]["returncode"] == -signal.SIGKILL and state["exit"]["signal_sent"] == signal.SIGKILL
    assert not psutil.pid_exists(int(state["exit"]["handle_id"]))


def sleepers(tmp_path: Path, **options: Any) -> tuple[MultinodeLauncher, LaunchSpec]:
    """A launcher for two nodes of one rank each, and a segment whose ranks print `up` and sleep."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(120)\n")
    defaults: dict[str, Any] = {"node_timeout_seconds": 30, "peer_exit_grace_seconds": 1}
    launcher = MultinodeLauncher(
        MultinodeOptions(
            nodes=2,
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            channel_dir=tmp_path / "channel",
            rdzv_join_timeout_seconds=30,
            **{**defaults, **options},
        )
    )
    return launcher, LaunchSpec((sys.executable, str(script)), name="t-0")


def start_sleepers(
    tmp_path: Path, started: Any = None, **options: Any
) -> tuple[MultinodeLauncher, Any, list[str]]:
    """Start `sleepers`; returns once node 1's line reached the owner (`started()` runs before the wait)."""
    launcher, spec = sleepers(tmp_path, **options)
    lines: list[str] = []
    try:
        handle = launcher.start(spec, lambda s, line: lines.append(line))
        if started is not None:
            started(launcher)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "[node 1] up" not in lines:
            assert handle.wait_exit(0.2) is None
        assert "[node 1] up" in lines  # node 1's output reached the owner's sink, marked with its node
    except BaseException:
        launcher.close()
        raise
    return launcher, handle, lines


@pytest.mark.e2e
def test_the_supervisors_stop_reaches_every_node_and_is_no_fault(tmp_path: Path):
    launcher, handle, _ = start_sleepers(tmp_path)
    try:
        handle.stop(10, signal.SIGTERM)
        info = handle.wait(30)
    finally:
        launcher.close()
    assert info.signal_sent == signal.SIGTERM and info.cause is None
    order = read_json(launcher.channel.order(1))
    assert order is not None and order["action"] == "exit"  # the stop, then close's exit
    state = read_json(launcher.channel.state(1))
    assert state is not None and state["exit"]["signal_sent"] == signal.SIGTERM
    assert launcher.follower_exits == {1: 0}


@pytest.mark.e2e
def test_a_follower_that_dies_is_a_lost_node_and_every_agent_is_ended(tmp_path: Path):
    """The follower itself SIGKILLed (its node gone with it): the owner sees it at once, not after a timeout."""
    launcher, handle, _ = start_sleepers(tmp_path)
    try:
        remote_agent = psutil.Process((read_json(launcher.channel.state(1)) or {})["agent"]["pid"])
        remote = [remote_agent, *remote_agent.children(recursive=True)]
        assert len(remote) == 2  # node 1's agent and its rank
        follower = launcher.followers[1]
        os.killpg(follower.pid, signal.SIGKILL)
        info = handle.wait(60)
    finally:
        launcher.close()
    assert info.cause == "hardware_fault" and info.cause_evidence["kind"] == "node_lost"
    assert info.cause_evidence["node"] == 1 and "its follower exited with -9" in info.cause_evidence["why"]
    assert info.cause_evidence["nodes"]["0"] == {"returncode": -9, "killed_after_peer": True}
    assert not any(alive(p) for p in remote)  # node 1's agent and rank: reclaimed by the owner (same host)


def alive_pid(pid: int) -> bool:
    try:
        return alive(psutil.Process(pid))
    except psutil.NoSuchProcess:
        return False


def alive(proc: psutil.Process) -> bool:
    """Running (a killed child of a dead follower stays a zombie until init reaps it)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def settle(procs: list[psutil.Process], timeout: float = 5.0) -> list[psutil.Process]:
    """`procs`, once those that were sent a SIGKILL have died (or `timeout` passed)."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs


def node_processes(launcher: MultinodeLauncher, node: int) -> list[psutil.Process]:
    """Node `node`'s agent (as its follower's state names it) and its ranks."""
    agent = psutil.Process((read_json(launcher.channel.state(node)) or {})["agent"]["pid"])
    return [agent, *agent.children(recursive=True)]


def running(rdzv_id: str) -> list[psutil.Process]:
    """Every live process of a segment (its agents and ranks carry its rendezvous id or are their children)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if rdzv_id in " ".join(proc.info["cmdline"] or ()) and alive(proc):
            found += [proc, *(p for p in proc.children(recursive=True) if alive(p))]
    return found


@pytest.mark.e2e
def test_a_node_lost_before_our_stop_stays_a_lost_node(tmp_path: Path):
    """The follower dies, the owner sees it, then the supervisor stops the segment: the loss is not hidden."""
    launcher, handle, _ = start_sleepers(tmp_path, peer_exit_grace_seconds=30)
    try:
        os.killpg(launcher.followers[1].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while 1 not in handle.exits and time.monotonic() < deadline:
            assert handle.wait_exit(0.1) is None  # node 0 sleeps on: only node 1 has ended
        handle.stop(5, signal.SIGTERM)
        info = handle.wait(1)
    finally:
        launcher.close()
    assert info.signal_sent == signal.SIGTERM
    assert info.cause == "hardware_fault" and info.cause_evidence["node"] == 1, info.cause_evidence
    assert "its follower exited with -9" in info.cause_evidence["why"]
    assert running(handle.rdzv_id) == []


@pytest.mark.e2e
def test_a_rank_sigkilled_under_a_live_agent_is_a_failed_rank_not_a_lost_node(tmp_path: Path):
    """The OOM killer's way: one rank of node 1 SIGKILLed, its agent alive; classified as on one node."""
    from supervisor.monitor.classifier import classify_exit

    launcher, handle, _ = start_sleepers(tmp_path)
    try:
        agent, rank = node_processes(launcher, 1)
        rank.kill()
        info = handle.wait(30)
    finally:
        launcher.close()
    assert handle.exits[1].agent_returncode == 1  # the agent lived to report its rank's death
    assert info.cause is None and info.returncode == -signal.SIGKILL, info.cause_evidence
    assert info.stderr_tail.startswith("--- node 1 (exit -9) ---")
    event = classify_exit(info.returncode, info.stderr_tail, signal_sent_by_us=info.signal_sent)
    assert event is not None and event.evidence["rule"] == "torchrun_child_sigkill", event
    assert not alive(agent) and running(handle.rdzv_id) == []


@pytest.mark.e2e
def test_a_stop_before_a_follower_read_its_run_order_ends_that_node_at_once(tmp_path: Path):
    """The stop overwrites the run order before the (just started) follower read it: no wait for a report."""
    launcher, spec = sleepers(tmp_path, node_timeout_seconds=10)
    try:
        handle = launcher.start(spec)
        started = time.monotonic()
        handle.stop(5, signal.SIGTERM)
        stopped_in = time.monotonic() - started
        info = handle.wait(1)
    finally:
        launcher.close()
    assert handle.exits[1].never_started and handle.exits[1].returncode is None
    assert stopped_in < 8, stopped_in  # not the node timeout's 10 s, nor more
    assert info.signal_sent == signal.SIGTERM and info.cause is None
    assert info.cause_evidence == {} and running(handle.rdzv_id) == []
    assert launcher.follower_exits == {1: 0}


@pytest.mark.e2e
def test_a_follower_started_again_neither_repeats_the_order_nor_leaves_the_old_agent(tmp_path: Path):
    """An external follower SIGKILLed mid-segment (its agent, in a session of its own, lives on), then started
    again by its scheduler: it resumes after the last order, kills the orphaned agent and reports the node lost."""
    log = open(tmp_path / "followers.log", "a")  # noqa: SIM115
    followers: list[subprocess.Popen] = []

    def follow(launcher: MultinodeLauncher) -> None:
        followers.append(
            subprocess.Popen(launcher.follower_command(1), stdout=log, stderr=log, start_new_session=True)
        )

    with log:
        launcher, handle, lines = start_sleepers(tmp_path, started=follow, followers="external")
        try:
            orphans = node_processes(launcher, 1)
            followers[0].kill()
            followers[0].wait(5)
            assert all(alive(p) for p in orphans)  # the leak: the agent outlives its follower
            follow(launcher)
            info = handle.wait(20)
        finally:
            launcher.close()
            codes = [f.wait(10) for f in followers]
            leaked = running(handle.rdzv_id)
            for proc in leaked:  # asserted below; never left behind
                proc.kill()
    assert info.cause == "hardware_fault" and info.cause_evidence["node"] == 1, info.cause_evidence
    assert "follower was restarted" in info.cause_evidence["why"]
    assert not any(alive(p) for p in settle(orphans))
    assert lines.count("[node 1] up") == 1  # no second agent for the same order
    assert leaked == []
    assert codes == [-signal.SIGKILL, 0]


@pytest.mark.e2e
def test_a_follower_killed_by_close_does_not_leave_its_agent(tmp_path: Path):
    launcher, handle, _ = start_sleepers(tmp_path)
    node1 = node_processes(launcher, 1)
    try:
        os.kill(launcher.followers[1].pid, signal.SIGSTOP)  # it cannot obey the exit order: close kills it
        launcher.close(wait_seconds=1)
        assert launcher.follower_exits == {1: -signal.SIGKILL}
        assert not any(alive(p) for p in settle(node1))
    finally:
        handle.local.kill()
        for proc in node1:  # on failure, do not leak
            with contextlib.suppress(psutil.Error):
                proc.kill()
    assert running(handle.rdzv_id) == []


@pytest.mark.e2e
def test_a_failed_start_of_node_0_calls_the_other_nodes_off(tmp_path: Path):
    """Node 0's agent cannot start (the owner is out of file descriptors) after node 1's run order was
    written: node 1 is told to stop at once instead of waiting for the rendezvous up to its join timeout."""
    launcher, spec = sleepers(tmp_path)
    launcher.open()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    free = list(itertools.islice((fd for fd in range(soft) if not _open_fd(fd)), 3))
    try:
        # three free descriptors: enough for writing an order, not for Popen's pipes
        resource.setrlimit(resource.RLIMIT_NOFILE, (free[-1] + 1, hard))
        with pytest.raises(OSError, match="Too many open files"):
            launcher.start(spec)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        order = read_json(launcher.channel.order(1)) or {}
        assert (order.get("action"), order.get("segment")) == ("stop", 0)
        deadline = time.monotonic() + 15
        state: dict[str, Any] = {}
        while time.monotonic() < deadline and state.get("status") != "exited":
            time.sleep(0.1)
            state = read_json(launcher.channel.state(1)) or {}
        assert state.get("segment") == 0 and state.get("status") == "exited", state
        assert state["agent"] is None
    finally:
        launcher.close()
    assert launcher.follower_exits == {1: 0}


def _open_fd(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
