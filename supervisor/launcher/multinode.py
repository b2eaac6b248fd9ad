"""The owner's side of a multi-node lineage: one torchrun agent per node, node 0's here, the others' by followers.

The owner (this launcher, inside the lineage's one supervisor) runs node 0's agent as a local process group
and hosts torchrun's c10d store there (`is_host=true`); for every other node it writes a `run` order into the
channel (node_channel.py) that the node's follower (follower.py) obeys. Every segment has its own rendezvous
id, so an agent left over from an older segment can never join a newer one. The segment's handle watches
every node: the owner's agent directly, the others through their followers' state files and beats.

A segment ends when every node's agent has ended. Once one node failed, the others get
`peer_exit_grace_seconds` to fail on their own (their collectives error out when a peer's sockets close), then
are killed: nothing useful survives a broken job. A node whose torchrun agent itself was SIGKILLed by someone
else, whose follower died, was restarted under a running agent, or stopped beating for `node_timeout_seconds`,
is a lost node: the segment's exit carries the launcher's verdict `hardware_fault` with `kind: node_lost`, the
way SLURM's NODE_FAIL does, and the policy decides once. A stop of ours excuses only the nodes lost after it was
sent. A rank SIGKILLed under a live agent (the OOM killer) is no lost node: the agent reports it, and the nodes'
exits are merged (the first failure's code, every node's output tail) for the classifier, as on one node.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from policies.launcher_schema import TorchrunSpec
from supervisor.errors import UserError
from supervisor.launcher.base import ExitInfo, Launcher, LaunchSpec, OnLine, SegmentHandle
from supervisor.launcher.follower import reclaim_node
from supervisor.launcher.local import LocalLauncher
from supervisor.launcher.node_channel import NODE_ENV, Beat, Channel, read_json, write_json
from supervisor.launcher.torchrun import TorchrunLauncher, TorchrunOptions, root_cause_exitcode
from supervisor.lineage.exclusions import HostPool

log = logging.getLogger("rollback_supervisor.launcher")

#: The event type of a lost node, and the `kind` its evidence names.
NODE_LOST_CAUSE = "hardware_fault"
NODE_LOST = "node_lost"
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class MultinodeOptions:
    """How the owner runs a segment on several nodes."""

    nodes: int
    """Nodes, the owner's included; checked to be >= 2."""
    rdzv_endpoint: str
    """host:port of torchrun's c10d store, on the owner's node, reachable from every node."""
    channel_dir: Path
    """Where each owner's channel directory is made (`<channel_dir>/<owner id>`); every node must see it."""
    nproc_per_node: int = 1
    """Ranks per node."""
    followers: str = "local"
    """`local`: the owner starts each follower as a local process (one machine standing in for several);
    `external`: something else starts them on their nodes (`srun`, a Kubernetes Indexed Job)."""
    node_timeout_seconds: float = 30.0
    """A follower silent this long (or that never took its order) is a lost node; followers give the owner
    as long before they kill their agent and leave."""
    peer_exit_grace_seconds: float = 30.0
    """After one node failed, how long the others get to end on their own before they are killed."""
    rdzv_join_timeout_seconds: int = 600
    """torchrun's `join_timeout`: how long an agent waits for the other nodes at a segment's start."""
    beat_seconds: float = 0.5
    """How often the owner and each follower beat, and how often the owner reads the followers."""
    python: str = sys.executable
    """The interpreter that runs a local follower."""

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise UserError(
                f"launcher.torchrun.nodes: expected >= 2 for a multi-node launcher, got {self.nodes}"
            )
        if self.followers not in ("local", "external"):
            raise UserError(
                f"launcher.torchrun.followers: expected local or external, got {self.followers!r}"
            )
        if self.rdzv_endpoint.endswith(":0") or ":" not in self.rdzv_endpoint:
            raise UserError(
                f"launcher.torchrun.rdzv_endpoint: expected host:port with a fixed port reachable from every "
                f"node, got {self.rdzv_endpoint!r}"
            )

    def torchrun(self, node: int) -> TorchrunOptions:
        """Node `node`'s torchrun options; node 0 (the owner's) hosts the rendezvous store."""
        conf = f"is_host={'true' if node == 0 else 'false'},join_timeout={self.rdzv_join_timeout_seconds}"
        return TorchrunOptions(
            nproc_per_node=self.nproc_per_node,
            rdzv_endpoint=self.rdzv_endpoint,
            nnodes=str(self.nodes),
            extra_args=("--rdzv-conf", conf),
        )


@dataclass
class NodeExit:
    """How one node's agent ended, as the owner saw it."""

    node: int
    returncode: int | None  #: the failed rank's code if the agent names one, else its own; None: unknown
    stderr_tail: str = ""
    stdout_tail: str = ""
    signal_sent: int | None = None  #: the signal the owner (through the follower) sent it
    duration_s: float = 0.0
    lost: str | None = None  #: why the node counts as lost without an exit of its own
    killed_after_peer: bool = False  #: killed by the owner because another node had already failed
    seen: int = 0  #: the order in which the owner saw the nodes end
    details: dict[str, Any] = field(default_factory=dict)
    agent_returncode: int | None = None  #: the torchrun agent's own exit (1 when a rank failed under it)
    lost_after_stop: bool = False  #: lost only after the owner's stop was sent: the stop explains it
    never_started: bool = False  #: stopped before its follower read the run order
    host: str | None = None  #: the host its follower runs on, as its state file says


def rank_returncode(agent_code: int | None, stderr_tail: str) -> int | None:
    """The code a node reports: the failed rank's from the agent's "Root Cause" block (exit 1), else the agent's."""
    if agent_code == 1:  # the agent's ChildFailedError
        return root_cause_exitcode(stderr_tail) or agent_code
    return agent_code


def is_lost(node: NodeExit) -> bool:
    """Lost: its follower could not report, or its agent itself (not a rank) died of a SIGKILL nobody of ours sent."""
    if node.lost:
        return not node.lost_after_stop
    return node.signal_sent is None and not node.killed_after_peer and _sigkilled(node.agent_returncode)


def _sigkilled(code: int | None) -> bool:
    return code in (-signal.SIGKILL, 128 + signal.SIGKILL)


def combine_exits(
    nodes: list[NodeExit], *, signal_sent: int | None, handle_id: str, hosts: tuple[str, ...] = ()
) -> ExitInfo:
    """One segment exit from every node's: a lost node is the launcher's verdict, else the first failure's code.

    See `is_lost`; a node lost after the owner's stop was sent is excused by it, one lost before is not. The
    merged tails put the first failing node first, each under a `node <k>` header, for the classifier.
    """
    lost = [n for n in nodes if is_lost(n)]
    failed = sorted(
        (n for n in nodes if n.returncode not in (0, None) and not n.killed_after_peer), key=lambda n: n.seen
    )
    first = lost[0] if lost else failed[0] if failed else nodes[0]
    order = [first, *(n for n in nodes if n is not first)]
    returncode = first.returncode
    if returncode is None:
        returncode = next((n.returncode for n in failed if n.returncode is not None), 1)
    summary = {
        str(n.node): {
            "returncode": n.returncode,
            **({"lost": n.lost} if n.lost else {}),
            **({"lost_after_stop": True} if n.lost and n.lost_after_stop else {}),
            **({"killed_after_peer": True} if n.killed_after_peer else {}),
            **({"never_started": True} if n.never_started else {}),
        }
        for n in nodes
    }
    cause, evidence = None, {}
    if lost:
        node = lost[0]
        why = (
            node.lost
            or f"its torchrun agent was killed (exit {node.agent_returncode}) by a signal the owner did not send"
        )
        cause = NODE_LOST_CAUSE
        evidence = {"kind": NODE_LOST, "rule": NODE_LOST, "node": node.node, "why": why, "nodes": summary}
        if node.host:
            evidence["host"] = node.host
    else:
        evidence = {"nodes": summary}
    return ExitInfo(
        returncode=returncode,
        stderr_tail="\n".join(f"--- node {n.node} (exit {n.returncode}) ---\n{n.stderr_tail}" for n in order),
        stdout_tail="\n".join(f"--- node {n.node} ---\n{n.stdout_tail}" for n in order),
        signal_sent=signal_sent,
        handle_id=handle_id,
        duration_s=max((n.duration_s for n in nodes), default=0.0),
        cause=cause,
        cause_evidence=evidence if cause else {},
        hosts=hosts,
    )


class MultinodeLauncher:
    """Starts each segment on every node: node 0's agent here, the others' through their followers.

    `close()` tells every follower to exit (and waits for the local ones); until then the owner beats. Not
    thread-safe: the runner's thread only (the beat runs on its own thread).
    """

    def __init__(self, options: MultinodeOptions, inner: Launcher | None = None):
        self.options = options
        self.inner: Launcher = inner if inner is not None else LocalLauncher()
        self.owner = uuid.uuid4().hex[:12]
        self.channel = Channel(Path(options.channel_dir) / self.owner)
        self.segments = 0
        self.seq = 0
        self.followers: dict[int, subprocess.Popen] = {}
        self.follower_exits: dict[int, int | None] = {}  #: each local follower's exit code, once closed
        self._beats = 0
        self._order_lock = threading.Lock()
        self._stop_beat = threading.Event()
        self._beat_thread: threading.Thread | None = None

    # -- the owner's beat and the followers -----------------------------------------------------

    def open(self) -> None:
        """Start beating and the local followers (once); `start()` does it for the first segment."""
        if self._beat_thread is not None:
            return
        self._beat()
        self._beat_thread = threading.Thread(target=self._beat_loop, name="owner-beat", daemon=True)
        self._beat_thread.start()
        for node in range(1, self.options.nodes):
            if self.options.followers == "local":
                self.followers[node] = self._spawn_follower(node)
            else:
                log.warning(
                    "node %d: start its follower there with: %s", node, " ".join(self.follower_command(node))
                )

    def _beat(self) -> None:
        self._beats += 1
        write_json(
            self.channel.owner,
            {"owner": self.owner, "pid": os.getpid(), "host": socket.gethostname(), "beats": self._beats},
        )

    def _beat_loop(self) -> None:
        while not self._stop_beat.wait(self.options.beat_seconds):
            try:
                self._beat()
            except OSError as exc:  # a full or flaky shared disk: the followers time out if it lasts
                log.warning("owner beat not written to %s: %s", self.channel.owner, exc)

    def follower_command(self, node: int) -> list[str]:
        """What starts node `node`'s follower; a cluster runs the same on that node (srun, an Indexed Job)."""
        o = self.options
        return [
            o.python,
            "-m",
            "supervisor.launcher.follower",
            "--dir",
            str(self.channel.root),
            "--node",
            str(node),
            "--owner",
            self.owner,
            "--beat-seconds",
            str(o.beat_seconds),
            "--owner-timeout",
            str(o.node_timeout_seconds),
        ]

    def _spawn_follower(self, node: int) -> subprocess.Popen:
        self.channel.node_dir(node).mkdir(parents=True, exist_ok=True)
        out = open(self.channel.node_dir(node) / "follower.log", "a")  # noqa: SIM115
        with out:
            proc = subprocess.Popen(
                self.follower_command(node), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        log.info("node %d: follower started as pid %d (owner %s)", node, proc.pid, self.owner)
        return proc

    def order(self, node: int, action: str, **fields: Any) -> int:
        """Write node `node`'s next order; returns its sequence number (a stop may come from another thread)."""
        with self._order_lock:
            self.seq += 1
            write_json(
                self.channel.order(node),
                {"owner": self.owner, "seq": self.seq, "action": action, **fields},
                durable=True,
            )
            return self.seq

    def close(self, wait_seconds: float = 10.0) -> None:
        """Tell every follower to exit (killing its agent), wait for the local ones, stop beating.

        A local follower that does not exit in time is SIGKILLed; its agent, in a session of its own, is then
        killed here from the follower's state file (PID and start time checked).
        """
        if self._beat_thread is None:
            return
        for node in range(1, self.options.nodes):
            self.order(node, "exit", grace=0.0, signal=int(signal.SIGKILL))
        deadline = time.monotonic() + wait_seconds
        for node, proc in self.followers.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("node %d: follower pid %d did not exit; killing it", node, proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            self.follower_exits[node] = proc.returncode
            self._reclaim_agent(node)
        self.followers.clear()
        self._stop_beat.set()
        self._beat_thread.join(5)
        self._beat_thread = None

    def _reclaim_agent(self, node: int) -> None:
        """Kill the agent an ended follower's state file still names (a follower that exited cleanly names none)."""
        state = read_json(self.channel.state(node)) or {}
        if state.get("owner") == self.owner and state.get("agent"):
            if reclaim_node({**state["agent"], "host": state.get("host")}):
                log.warning("node %d: its follower ended and left agent pid %s; killed it", node,
                            state["agent"].get("pid"))  # fmt: skip

    # -- segments -------------------------------------------------------------------------------

    def start(self, spec: LaunchSpec, on_line: OnLine | None = None) -> MultinodeSegment:
        self.open()
        segment = self.segments
        self.segments += 1
        rdzv_id = _UNSAFE.sub("-", f"{spec.name or 'segment'}-{self.owner[:6]}-{segment}")
        orders = {}
        for node in range(1, self.options.nodes):
            command = TorchrunLauncher(self.options.torchrun(node)).command(spec.command, rdzv_id)
            orders[node] = self.order(
                node,
                "run",
                segment=segment,
                rdzv_id=rdzv_id,
                command=list(command),
                env=dict(spec.env_overrides),
                cwd=spec.cwd,
                exclude_hosts=list(spec.exclude_hosts),
            )
        try:
            # A follower that died (with its node) is replaced; an agent it left behind is ended first.
            for node, proc in list(self.followers.items()):
                if proc.poll() is not None:
                    log.warning("node %d: follower pid %d had exited with %s; starting another", node, proc.pid,
                                proc.returncode)  # fmt: skip
                    self._reclaim_agent(node)
                    self.followers[node] = self._spawn_follower(node)
            command = TorchrunLauncher(self.options.torchrun(0)).command(spec.command, rdzv_id)
            local_spec = replace(spec, command=command, env_overrides={**spec.env_overrides, NODE_ENV: "0"})
            local = self.inner.start(local_spec, on_line)
        except BaseException as exc:
            # The other nodes' agents would wait for node 0 up to the join timeout: call them off now.
            log.error("segment %d: node 0 did not start (%s); stopping the other nodes", segment, exc)
            for node in orders:
                with contextlib.suppress(OSError):
                    self.order(node, "stop", segment=segment, grace=0.0, signal=int(signal.SIGKILL))
            raise
        if socket.gethostname() in spec.exclude_hosts:
            log.error("segment %s: node 0 runs here, on %s, which the lineage excludes; the owner's node cannot "
                      "move: run the supervisor on another host", spec.name, socket.gethostname())  # fmt: skip
        log.info("segment %s: %d nodes, rendezvous %s at %s", spec.name, self.options.nodes, rdzv_id,
                 self.options.rdzv_endpoint)  # fmt: skip
        return MultinodeSegment(self, local, segment, rdzv_id, orders, on_line)

    def host_pool(self) -> HostPool:
        """Local followers: every node is this machine, which is never excluded. External ones: not known here
        (a follower on an excluded host refuses its run order and leaves, for one elsewhere to take its node)."""
        if self.options.followers == "local":
            why = "followers: local runs every node on this machine"
            return HostPool(self.options.nodes, (socket.gethostname(),), why)
        return HostPool(self.options.nodes, None)

    def reclaim(self, details: Mapping[str, Any]) -> None:
        """Node 0's agent leads its process group; the other nodes' followers leave when this owner is gone."""
        self.inner.reclaim(details)


class MultinodeSegment:
    """One segment on every node; `stop()` from any thread, everything else from the owner's thread."""

    def __init__(
        self,
        launcher: MultinodeLauncher,
        local: SegmentHandle,
        segment: int,
        rdzv_id: str,
        orders: dict[int, int],
        on_line: OnLine | None,
    ):
        self.launcher = launcher
        self.options = launcher.options
        self.local = local
        self.segment = segment
        self.rdzv_id = rdzv_id
        self.orders = orders
        self.on_line = on_line
        now = time.monotonic()
        self.beats = {node: Beat(self.options.node_timeout_seconds, now) for node in orders}
        self.exits: dict[int, NodeExit] = {}
        self.remote_details: dict[int, Any] = {}
        self.hosts: dict[int, str] = {0: socket.gethostname()}  #: each node's host, from its follower's state
        self._log_offsets = dict.fromkeys(orders, 0)
        self._signal_sent: int | None = None
        self._stop_at: float | None = None  #: when the owner's stop was sent (monotonic)
        self._first_failure: float | None = None
        self._peer_killed: set[int] = set()  #: remote nodes ordered killed after a peer failed
        self._lock = threading.Lock()
        self._idle = threading.Event()  # never set: a pause between reads of the followers' states

    @property
    def handle_id(self) -> str:
        return self.rdzv_id

    def details(self) -> dict[str, Any]:
        return {**self.local.details(), "rdzv_id": self.rdzv_id, "nodes": self.options.nodes}

    def started(self) -> bool:
        return True

    def poll(self) -> int | None:
        with self._lock:
            self._update(time.monotonic())
            if len(self.exits) < self.options.nodes:
                return None
            return combine_exits(
                self._ordered(), signal_sent=self._signal_sent, handle_id=self.rdzv_id
            ).returncode

    def _ordered(self) -> list[NodeExit]:
        return [self.exits[n] for n in sorted(self.exits)]

    def _update(self, now: float) -> None:
        if 0 not in self.exits and self.local.poll() is not None:
            info = self.local.wait(60.0)
            self._ended(NodeExit(0, rank_returncode(info.returncode, info.stderr_tail), info.stderr_tail,
                                 info.stdout_tail, info.signal_sent, info.duration_s,
                                 agent_returncode=info.returncode), now)  # fmt: skip
        for node, seq in self.orders.items():
            self._forward_log(node)
            if node in self.exits:
                continue
            state = read_json(self.launcher.channel.state(node)) or {}
            if state.get("owner") == self.launcher.owner:
                self.beats[node].see(state.get("beats"), now)
                if isinstance(state.get("host"), str):
                    self.hosts[node] = state["host"]
            took = int(state.get("seq", 0)) >= seq and state.get("segment") == self.segment
            if took and state.get("agent"):
                self.remote_details[node] = {
                    **state["agent"],
                    "host": state.get("host"),
                    "index": self.segment,
                }
            done = state.get("exit") if took and state.get("status") == "exited" else None
            if done is not None and done.get("lost"):  # its follower was restarted under a running agent
                self._lost(node, str(done["lost"]), now, now)
            elif done is not None and done.get("refused"):  # its host is excluded: the follower left
                log.error("segment %d: node %d refused: %s", self.segment, node, done["refused"])
                self._lost(node, f"refused: {done['refused']}", now, now)
            elif done is not None and done.get("never_started"):
                log.info("segment %d: node %d was stopped before it started", self.segment, node)
                self._ended(
                    NodeExit(node, None, signal_sent=done.get("signal_sent"), never_started=True), now
                )
            elif done is not None:
                agent_code = done.get("returncode")
                tail = done.get("stderr_tail", "")
                self._ended(NodeExit(node, rank_returncode(agent_code, tail), tail, done.get("stdout_tail", ""),
                                     done.get("signal_sent"), float(done.get("duration_s", 0.0)),
                                     killed_after_peer=node in self._peer_killed,
                                     agent_returncode=agent_code), now)  # fmt: skip
            elif (proc := self.launcher.followers.get(node)) is not None and proc.poll() is not None:
                why = (
                    f"its follower exited with {proc.returncode} (see {self.launcher.channel.node_dir(node)})"
                )
                self._lost(node, why, now, now)
            elif self.beats[node].stale(now):
                why = "its follower never took the order" if not took else "its follower stopped beating"
                why += f" ({self.beats[node].silent_for(now):.0f}s)"
                self._lost(node, why, self.beats[node].moved_at, now)
        self._cleanup_after_failure(now)

    def _lost(self, node: int, why: str, since: float, now: float) -> None:
        """Node `node` is lost since `since`; a stop of ours sent before that explains it."""
        after_stop = self._stop_at is not None and since > self._stop_at
        log.error("segment %d: node %d lost%s: %s", self.segment, node,
                  " after our stop" if after_stop else "", why)  # fmt: skip
        self._ended(
            NodeExit(node, None, lost=why, lost_after_stop=after_stop, host=self.hosts.get(node)), now
        )

    def _ended(self, node_exit: NodeExit, now: float) -> None:
        if node_exit.lost and node_exit.node in self.remote_details:
            # Its follower cannot end the agent any more: on this very host (one machine standing in for
            # several) it is ended here; on another host the scheduler's teardown of the node's step does it.
            reclaim_node(self.remote_details[node_exit.node])
        node_exit.seen = len(self.exits)
        self.exits[node_exit.node] = node_exit
        failed = node_exit.lost or (node_exit.returncode != 0 and not node_exit.never_started)
        if failed and self._first_failure is None and not node_exit.killed_after_peer:
            self._first_failure = now
            if is_lost(node_exit) and not node_exit.lost:
                log.error(
                    "segment %d: node %d lost: its torchrun agent was SIGKILLed from outside",
                    self.segment,
                    node_exit.node,
                )
            elif _sigkilled(node_exit.returncode) and not node_exit.signal_sent:
                log.warning(
                    "segment %d: node %d: a rank was SIGKILLed under its live agent (agent exit %s): a failed "
                    "rank, not a lost node",
                    self.segment,
                    node_exit.node,
                    node_exit.agent_returncode,
                )
            if len(self.exits) < self.options.nodes:
                log.warning(
                    "segment %d: node %d ended with %s; the other nodes get %.0fs to end on their own",
                    self.segment,
                    node_exit.node,
                    node_exit.lost or node_exit.returncode,
                    self.options.peer_exit_grace_seconds,
                )

    def _cleanup_after_failure(self, now: float) -> None:
        """A broken job: kill the nodes still running once the peer grace is over."""
        if self._first_failure is None or now - self._first_failure < self.options.peer_exit_grace_seconds:
            return
        if self._signal_sent is not None:
            return
        for node in range(self.options.nodes):
            if node in self.exits:
                continue
            log.warning("segment %d: node %d still runs after a peer failed; killing it", self.segment, node)
            if node == 0:
                self.local.kill()
                info = self.local.wait(60.0)
                self._ended(NodeExit(0, rank_returncode(info.returncode, info.stderr_tail), info.stderr_tail,
                                     info.stdout_tail, None, info.duration_s, killed_after_peer=True,
                                     agent_returncode=info.returncode), now)  # fmt: skip
            elif node not in self._peer_killed:
                self._peer_killed.add(node)
                self.launcher.order(node, "stop", segment=self.segment, grace=0.0, signal=int(signal.SIGKILL))

    def _forward_log(self, node: int) -> None:
        """Pass the node's new output lines to the segment's sink, each marked with the node."""
        if self.on_line is None:
            return
        path = self.launcher.channel.log(node, self.segment)
        try:
            with open(path, "rb") as fh:
                fh.seek(self._log_offsets[node])
                chunk = fh.read()
        except OSError:
            return
        end = chunk.rfind(b"\n") + 1
        self._log_offsets[node] += end
        for raw in chunk[:end].decode(errors="replace").splitlines():
            stream, _, line = raw.partition(": ")
            self.on_line(stream if stream in ("stdout", "stderr") else "stdout", f"[node {node}] {line}")

    def wait_exit(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.poll()
            if code is not None or time.monotonic() >= deadline:
                return code
            pause = min(self.options.beat_seconds, max(0.0, deadline - time.monotonic()))
            if 0 in self.exits:  # node 0 has ended: its wait would return at once
                self._idle.wait(pause)
            else:
                self.local.wait_exit(pause)

    def stop(self, grace_seconds: float, sig: int = signal.SIGTERM) -> None:
        """Stop every node: order the followers, stop node 0 here, then wait for the followers' reports.

        The nodes are read once first, so that a node lost before the stop is not excused by it.
        """
        with self._lock:
            self._update(time.monotonic())
            self._signal_sent = sig
            self._stop_at = time.monotonic()
        for node in self.orders:
            self.launcher.order(node, "stop", segment=self.segment, grace=grace_seconds, signal=int(sig))
        self.local.stop(grace_seconds, sig)
        self.wait_exit(grace_seconds + self.options.node_timeout_seconds)

    def kill(self) -> None:
        self.stop(0.0, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> ExitInfo:
        if self.wait_exit(float("inf") if timeout is None else timeout) is None:
            raise TimeoutError(f"segment {self.rdzv_id}: nodes still running after {timeout}s")
        hosts = tuple(dict.fromkeys(self.hosts[n] for n in sorted(self.hosts)))
        return combine_exits(
            self._ordered(), signal_sent=self._signal_sent, handle_id=self.rdzv_id, hosts=hosts
        )


def torchrun_launcher(spec: TorchrunSpec, workdir: Path) -> Launcher:
    """The launcher a policy's `launcher: {type: torchrun}` asks for: one node's torchrun, or every node's."""
    if spec.nodes == 1:
        return TorchrunLauncher(
            TorchrunOptions(
                nproc_per_node=spec.nproc_per_node, rdzv_endpoint=spec.rdzv_endpoint or "localhost:0"
            )
        )
    assert spec.rdzv_endpoint is not None  # the schema requires it for several nodes
    return MultinodeLauncher(
        MultinodeOptions(
            nodes=spec.nodes,
            rdzv_endpoint=spec.rdzv_endpoint,
            channel_dir=Path(spec.channel_dir) if spec.channel_dir else Path(workdir) / "multinode",
            nproc_per_node=spec.nproc_per_node,
            followers=spec.followers,
            node_timeout_seconds=spec.node_timeout_seconds,
            peer_exit_grace_seconds=spec.peer_exit_grace_seconds,
            rdzv_join_timeout_seconds=spec.rdzv_join_timeout_seconds,
        )
    )
