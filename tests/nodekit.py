"""Two torchrun nodes on this machine for the framework tests: a policy's launcher section, the loss of a
whole node (its agent and its ranks) at a known point, and one supervised lineage on one or two nodes.

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

from policies import load_policy
from supervisor.launcher import TorchrunLauncher, TorchrunOptions
from supervisor.launcher.node_channel import read_json
from supervisor.launcher.slurm import launcher_from_policy
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.flowkit import stored_state


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


def supervise_lineage(
    work: Path,
    lineage: str,
    command: tuple[str, ...],
    policy_text: str,
    *,
    faults: str = "",
    launcher: str = "torchrun",
    kill_node_after: int | None = None,
    stored: bool = True,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One lineage of `command` on 2 ranks: its record and (`stored`) everything its final checkpoint holds.

    `launcher`: "torchrun" (one node of 2 ranks), "nodes" (2 torchrun nodes of 1 rank), or "own" (the command
    starts its other rank itself, as Lightning's launcher does). With `kill_node_after`, node 1 is killed whole
    once a drill `hang` fault in `faults` fired on rank 1 after that step's checkpoint committed.
    """
    if launcher == "nodes":
        policy_text += two_nodes()
    path = work / f"{lineage}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(policy_text)
    chosen: Any = None
    if launcher == "torchrun":
        chosen = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    elif launcher == "nodes":
        chosen = launcher_from_policy(load_policy(path).launcher, work)
    options = RunOptions(
        command=command,
        policy_path=str(path),
        lineage=lineage,
        workdir=work,
        stop_grace_seconds=20,
        env={"OMP_NUM_THREADS": "1", **({"ROLLBACK_SUPERVISOR_FAULTS": faults} if faults else {})},
        launcher=chosen,
        max_segments=4,
    )
    killer = None
    if kill_node_after is not None:
        hang = next(f for f in faults.split(",") if f.startswith("hang@"))
        killer = NodeKiller(chosen, work, hang_key=hang, rank=1, step=kill_node_after).start()
    with LineageRunner(options, sleep=lambda s: None) as runner:
        rec = runner.supervise().to_dict()
    if killer is not None:
        killed = killer.join()
        assert "error" not in killed and killed["ranks"], killed
    final = stored_state(runner.layout.checkpoints, rec["final_checkpoint"]) if stored else {}
    return rec, final


def run_of(rec: dict[str, Any]) -> dict[str, Any]:
    """A lineage record's MLflow run, as tests.flowkit's series helpers take it."""
    return {"tracking_uri": rec["mlflow"]["tracking_uri"], "mlflow_run_id": rec["mlflow"]["run_id"]}
