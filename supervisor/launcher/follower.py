"""A follower: one per non-owner node of a multi-node lineage; it runs that node's torchrun agent on order.

It reads its orders from the channel (see node_channel), starts each announced segment's agent as a local
process group (LocalLauncher: output streamed to the channel's log, every rank reaped), beats, reports the
agent's exit (code, the signal we sent, output tails), and stops or kills its agent when told. It ends its
agent and exits when the owner goes silent for `owner_timeout` (3) or on an `exit` order (0).

A stop for a segment whose run order it never read (the owner overwrote it within a beat) is reported as that
segment's end, `never_started`, so the owner does not wait for it. A follower started again (by its scheduler,
after it died) resumes from its state file: it goes on from the recorded order, so the current run order is not
obeyed twice, and an agent its predecessor left running is killed (it cannot be reaped or stopped from here)
and its segment reported `lost`.
Run as `python -m supervisor.launcher.follower` or `rollback-supervisor follow`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psutil

from supervisor.launcher.base import LaunchSpec
from supervisor.launcher.local import LocalLauncher, LocalSegment, is_segment_process
from supervisor.launcher.node_channel import NODE_ENV, Beat, Channel, read_json, write_json

log = logging.getLogger("rollback_supervisor.follower")

EXIT_OWNER_LOST = 3
#: The follower's exit when its host is excluded from the lineage: it refused its run order and left.
EXIT_EXCLUDED = 4


def reclaim_node(details: Mapping[str, Any]) -> bool:
    """SIGKILL a node's agent and its ranks (each in a session of its own) if they run on this host and are
    still the processes the follower reported (start time checked: a reused PID is left alone); True if killed."""
    pid = details.get("pid")
    if not pid or details.get("host") != socket.gethostname():
        return False
    if not is_segment_process(pid, details.get("pid_started"), {}):
        return False
    try:
        ranks = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        ranks = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.Error):
            rank.kill()
    log.warning("killed the node's agent %d and its %d ranks on this host", pid, len(ranks))
    return True


class Follower:
    """Obeys one node's orders until told to exit or the owner is gone; `run()` once, from one thread."""

    def __init__(
        self,
        channel: Channel,
        node: int,
        owner: str,
        *,
        beat_seconds: float = 0.5,
        owner_timeout: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.channel = channel
        self.node = node
        self.owner = owner
        self.beat_seconds = beat_seconds
        self.clock = clock
        self.owner_beat = Beat(owner_timeout, clock())
        self.beats = 0
        self.seq = 0
        self.segment: int | None = None
        self.agent: LocalSegment | None = None
        self.exit: dict[str, Any] | None = None
        self.leaving = False
        self.refused: str | None = None  #: why it refused a run order (its host is excluded); it then leaves
        self._logfile: Any = None
        self._log_lock = threading.Lock()
        self._wake = threading.Event()
        self._written_status: str | None = None

    def run(self) -> int:
        """The loop: read the owner's beat and this node's order, collect the agent's exit, beat."""
        log.info("node %d following owner %s in %s", self.node, self.owner, self.channel.root)
        self._resume()
        try:
            while True:
                code = self._step(self.clock())
                self._write_state()
                if code is not None:
                    return code
                self._wake.wait(self.beat_seconds)
        finally:
            self._end_agent(0.0, signal.SIGKILL)

    def _resume(self) -> None:
        """Go on from a predecessor's state file (the same owner's): its order, its segment, its agent's fate."""
        state = read_json(self.channel.state(self.node))
        if state is None or state.get("owner") != self.owner:
            return
        self.seq = int(state.get("seq") or 0)
        self.segment = state.get("segment")
        self.exit = state.get("exit")
        self.beats = int(state.get("beats") or 0)
        agent = state.get("agent")
        log.warning("node %d: resuming after follower pid %s at order %d, segment %s",
                    self.node, state.get("pid"), self.seq, self.segment)  # fmt: skip
        if not agent:
            return
        # Not our child: we could neither reap it nor learn its exit code, so its segment is over for this node.
        killed = reclaim_node({**agent, "host": state.get("host")})
        why = f"its follower was restarted while the agent (pid {agent.get('pid')}) ran; " + (
            "the new follower killed the agent" if killed else "the agent was already gone"
        )
        log.error("node %d: segment %s lost: %s", self.node, self.segment, why)
        self.exit = {
            "returncode": None,
            "lost": why,
            "signal_sent": None,
            "stderr_tail": "",
            "stdout_tail": "",
        }

    def _step(self, now: float) -> int | None:
        owner = read_json(self.channel.owner)
        if owner is not None and owner.get("owner") == self.owner:
            self.owner_beat.see(owner.get("beats"), now)
        if self.owner_beat.stale(now):
            log.error(
                "node %d: the owner has not beaten for %.0fs; killing this node's agent and leaving",
                self.node,
                self.owner_beat.silent_for(now),
            )
            self._end_agent(0.0, signal.SIGKILL)
            return EXIT_OWNER_LOST
        order = read_json(self.channel.order(self.node))
        if order is not None and order.get("owner") == self.owner and int(order.get("seq", 0)) > self.seq:
            self._obey(order)
        self._collect()
        if self.refused is not None and self.agent is None:
            return EXIT_EXCLUDED
        if self.leaving and self.agent is None:
            return 0
        return None

    def _obey(self, order: dict[str, Any]) -> None:
        self.seq = int(order["seq"])
        action = order.get("action")
        log.info("node %d: order %d: %s segment %s", self.node, self.seq, action, order.get("segment"))
        if action == "run":
            if self.agent is not None:  # a stale segment: the owner moved on without it
                self._end_agent(0.0, signal.SIGKILL)
            host = socket.gethostname()
            if host in (order.get("exclude_hosts") or []):
                self._refuse(order, host)
            else:
                self._start(order)
        elif action == "stop":
            grace, sig = float(order.get("grace", 0.0)), int(order.get("signal", signal.SIGTERM))
            segment = order.get("segment")
            if segment is not None and (self.segment is None or segment > self.segment):
                # The stop overwrote a run order this follower never read: report that segment as ended.
                if self.agent is not None:  # an older segment's: the owner moved on without it
                    self._end_agent(0.0, signal.SIGKILL)
                self.segment = int(segment)
                self.exit = {"returncode": None, "never_started": True, "signal_sent": sig,
                             "stderr_tail": "", "stdout_tail": ""}  # fmt: skip
                log.warning("node %d: segment %d stopped before this follower started it", self.node, segment)
            elif self.agent is not None and segment in (None, self.segment):
                agent = self.agent  # stopping blocks up to the grace: the beats must go on meanwhile
                threading.Thread(target=agent.stop, args=(grace, sig), daemon=True).start()
        elif action == "exit":
            self.leaving = True
            self._end_agent(float(order.get("grace", 0.0)), int(order.get("signal", signal.SIGKILL)))

    def _refuse(self, order: dict[str, Any], host: str) -> None:
        """This host is excluded from the lineage: report the segment refused, and leave (a follower started on
        another host takes this node's place)."""
        self.segment = int(order["segment"])
        self.refused = (
            f"host {host} is excluded from this lineage (see `rollback-supervisor status`; "
            "`rollback-supervisor exclusions clear` lets it back); start this node's follower on another host"
        )
        log.error("node %d: refusing segment %d: %s", self.node, self.segment, self.refused)
        self.exit = {"returncode": None, "refused": self.refused, "signal_sent": None,
                     "stderr_tail": "", "stdout_tail": ""}  # fmt: skip

    def _start(self, order: dict[str, Any]) -> None:
        self.segment = int(order["segment"])
        self.exit = None
        env = {**order.get("env", {}), NODE_ENV: str(self.node)}
        spec = LaunchSpec(tuple(order["command"]), env_overrides=env, cwd=order.get("cwd"))
        self._logfile = open(self.channel.log(self.node, self.segment), "a")  # noqa: SIM115
        self.agent = LocalLauncher().start(spec, self._sink)
        log.info("node %d: segment %d started as pid %s", self.node, self.segment, self.agent.handle_id)
        self._write_state()  # the agent is recorded at once: a follower started after us must find it

    def _sink(self, stream: str, line: str) -> None:
        with self._log_lock:
            if self._logfile is not None:
                self._logfile.write(f"{stream}: {line}\n")
                self._logfile.flush()

    def _collect(self) -> None:
        """Once the agent has exited: reap it and keep how it ended for the state file."""
        if self.agent is None or self.agent.poll() is None:
            return
        info = self.agent.wait(60.0)
        self.exit = {
            "returncode": info.returncode,
            "signal_sent": info.signal_sent,
            "stderr_tail": info.stderr_tail,
            "stdout_tail": info.stdout_tail,
            "handle_id": info.handle_id,
            "duration_s": info.duration_s,
        }
        log.info("node %d: segment %s ended with %s", self.node, self.segment, info.returncode)
        self.agent = None
        with self._log_lock:
            self._logfile.close()
            self._logfile = None

    def _end_agent(self, grace: float, sig: int) -> None:
        if self.agent is not None:
            self.agent.stop(grace, sig)
            self.agent.wait_exit(10.0)  # a SIGKILL lands asynchronously: collect its exit, not a live agent
            self._collect()

    def _write_state(self) -> None:
        self.beats += 1
        state = {
            "owner": self.owner,
            "node": self.node,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "beats": self.beats,
            "seq": self.seq,
            "segment": self.segment,
            "status": "running" if self.agent is not None else "exited" if self.exit else "idle",
            "agent": self.agent.details() if self.agent is not None else None,
            "exit": self.exit,
        }
        # fsynced when the status changes (an exit must survive), not on every beat
        write_json(self.channel.state(self.node), state, durable=state["status"] != self._written_status)
        self._written_status = state["status"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rollback-supervisor follow",
        description="Run this node's torchrun agent for each segment the lineage's owner announces.",
    )
    parser.add_argument(
        "--dir", required=True, type=Path, help="The channel directory, shared by every node."
    )
    parser.add_argument("--node", required=True, type=int, help="This node's index (1 .. nodes-1).")
    parser.add_argument("--owner", required=True, help="The owner's id, as the owner passed it.")
    parser.add_argument("--beat-seconds", type=float, default=0.5)
    parser.add_argument("--owner-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    if args.node < 1:
        parser.error(f"--node: expected an index >= 1 (0 is the owner's node), got {args.node}")
    logging.basicConfig(level=logging.INFO, format=f"follower[node {args.node}] %(levelname)s %(message)s")
    follower = Follower(
        Channel(args.dir),
        args.node,
        args.owner,
        beat_seconds=args.beat_seconds,
        owner_timeout=args.owner_timeout,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ends the agent through run()'s finally
    return follower.run()


if __name__ == "__main__":
    sys.exit(main())
