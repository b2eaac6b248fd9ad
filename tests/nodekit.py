"""Two torchrun nodes on this machine for the framework tests: a policy's launcher section, and the loss of a
whole node (its agent and its ranks) at a known point.

The multi-node launcher (`supervisor.launcher.multinode`) runs node 0's agent itself and node 1's through a
follower; both rendezvous (c10d) on 127.0.0.1. `NodeKiller` waits until rank `rank` has fired its drill
`hang` fault (so the step before it is over everywhere and no later checkpoint can be written) and the
named checkpoint is committed, then SIGKILLs node 1's agent's process group and each of its ranks' sessions,
as a machine vanishing would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from supervisor.launcher.node_channel import read_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(nproc_per_node: int = 1) -> str:
    """The policy section that runs every segment on 2 torchrun nodes (c10d rendezvous on 127.0.0.1)."""
    return (
        "launcher:\n"
        "  type: torchrun\n"
        "  torchrun:\n"
        "    nodes: 2\n"
        f"    nproc_per_node: {nproc_per_node}\n"
        f"    rdzv_endpoint: 127.0.0.1:{free_port()}\n"
        "    node_timeout_seconds: 10\n"
        "    peer_exit_grace_seconds: 10\n"
        "    rdzv_join_timeout_seconds: 60\n"
    )


class NodeKiller:
    """Kills node 1 once `hang_key` fired on rank `rank` and a checkpoint of `step` is committed (a thread)."""

    def __init__(self, launcher: Any, workdir: Path, *, hang_key: str, rank: int, step: int):
        self.launcher, self.workdir = launcher, workdir
        self.hang_key, self.rank, self.step = hang_key, rank, step
        self.killed: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> NodeKiller:
        self._thread.start()
        return self

    def join(self) -> dict[str, Any]:
        self._thread.join(5)
        return self.killed

    def _ready(self) -> bool:
        committed = list(self.workdir.rglob(f"ckpt-{self.step:010d}-*/COMMITTED"))
        fired = list(self.workdir.rglob(f"faults-fired.rank{self.rank}.json"))
        return bool(committed) and any(self.hang_key in json.loads(p.read_text() or "[]") for p in fired)

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        while not self._ready():
            if time.monotonic() > deadline:
                self.killed["error"] = (
                    f"rank {self.rank} never fired {self.hang_key} after a step-{self.step} commit"
                )
                return
            time.sleep(0.1)
        state = read_json(self.launcher.channel.state(1)) or {}
        agent = psutil.Process(state["agent"]["pid"])
        ranks = agent.children(recursive=True)
        groups = {agent.pid, *(os.getpgid(p.pid) for p in ranks)}
        for group in groups:  # the whole node: its agent's group and every rank's own session
            os.killpg(group, signal.SIGKILL)
        self.killed.update(agent=agent.pid, ranks=[p.pid for p in ranks])
