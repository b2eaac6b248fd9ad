"""The warm standby under torchrun (issue 20, item 1): a whole single-node agent parked with its ranks.

Real torchrun agents with 2 gloo ranks. The end-to-end test supervises the example under DDP with the drill
SIGKILLing rank 1 at step 22; with `relaunch: {standby: true}` the second segment runs in the agent parked while
the first one trained, and everything its final checkpoint stores (model, optimizer, scheduler, every rank's
RNG streams and data position) equals a cold relaunch's bit for bit. The other tests use a small script: a
standby's ranks are torchrun's own (RANK, WORLD_SIZE, a working process group) and get the segment's
per-segment variables; a stale standby is killed with its ranks and replaced by a cold start.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from supervisor.errors import UserError
from supervisor.launcher import LaunchSpec, TorchrunLauncher, TorchrunOptions
from supervisor.launcher.standby import StandbyOptions
from supervisor.launcher.standby_torchrun import TorchrunStandbyLauncher
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.flowkit import CHARLM, FAST_POLICY, SMALL, stored_state
from tests.test_standby_resume import PRELOAD_MARKED, marks

PY = sys.executable
STEPS = 24
RESUME_STEP = 20

#: Each rank says who it is, what its segment told it, and that its process group works.
RANKS = """\
import os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1])
dist.all_reduce(t)
time.sleep(0.3 * dist.get_rank())  # one line at a time: the ranks share the agent's output pipe
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']} pid {os.getpid()} "
      f"segment {os.environ.get('ROLLBACK_SUPERVISOR_TEST')} sum {int(t)} argv {sys.argv[1:]}", flush=True)
dist.destroy_process_group()
"""


def two_rank_standby() -> TorchrunStandbyLauncher:
    return TorchrunStandbyLauncher(
        StandbyOptions(delay_seconds=0), TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    )


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_standbys_ranks_are_torchruns_own_and_get_their_segments_variables(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    launcher = two_rank_standby()
    env = {"OMP_NUM_THREADS": "1"}
    with launcher:
        spec = LaunchSpec((PY, str(script), "a"), env_overrides={**env, "ROLLBACK_SUPERVISOR_TEST": "first"})
        first_lines: list[str] = []
        first = launcher.start(spec, on_line=lambda s, line: first_lines.append(line))  # cold; parks the next
        assert first.wait(120).returncode == 0
        parked = launcher.parked(timeout=30)
        assert parked is not None and parked.wait_ready(120), "the standby's ranks never reported"
        ranks = parked.report["ranks"]
        assert len(ranks) == 2 and all(alive(pid) for pid in ranks)

        lines: list[str] = []
        spec = LaunchSpec((PY, str(script), "b"), env_overrides={**env, "ROLLBACK_SUPERVISOR_TEST": "second"})
        second = launcher.start(spec, on_line=lambda s, line: lines.append(line))
        assert second.wait(120).returncode == 0
        assert int(second.handle_id) == parked.pid  # the parked agent became the segment
        assert not parked.channel.exists()  # its plan files are gone with the segment
        newest = launcher.parked(timeout=30)
        assert newest is not None and newest.channel.exists()
    said = sorted(line for line in lines if line.startswith("rank "))
    # ranks[i] is local rank i's pid (= RANK i on one node), each started by the parked agent before the plan.
    assert said == [f"rank {r} of 2 pid {pid} segment second sum 3 argv ['b']" for r, pid in enumerate(ranks)]
    assert f"segment starts in standby pid {parked.pid}" in caplog.text
    assert sorted(line for line in first_lines if line.startswith("rank "))[0].endswith("argv ['a']")
    # Closing the launcher killed the standby parked after the second segment: its agent and its ranks.
    newer = [r for r in caplog.records if "discarded: the supervisor is closing" in r.getMessage()]
    assert len(newer) == 1
    leftover = [
        p for p in psutil.process_iter(["cmdline"]) if "rbs-standby-" in " ".join(p.info["cmdline"] or [])
    ]
    assert leftover == [] and not newest.channel.exists()


def test_parked_ranks_give_up_when_their_agent_is_gone(tmp_path: Path):
    """The agent SIGKILLed alone (its ranks live in sessions of their own): each rank sees its parent change
    and exits instead of waiting for a plan for ever."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    with two_rank_standby() as launcher:
        parked = launcher.park_for(LaunchSpec((PY, str(script)), env_overrides={"OMP_NUM_THREADS": "1"}))
        assert parked is not None and parked.wait_ready(120)
        ranks = parked.report["ranks"]
        os.kill(parked.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(pid) for pid in ranks)


def test_a_stale_standby_is_killed_with_its_ranks_and_the_segment_starts_cold(tmp_path: Path, caplog):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    launcher = two_rank_standby()
    spec = LaunchSpec((PY, str(script)), env_overrides={"OMP_NUM_THREADS": "1"})
    with launcher:
        stale = launcher.park_for(spec)
        assert stale is not None and stale.wait_ready(120)
        agent, ranks = stale.pid, stale.report["ranks"]
        time.sleep(0.01)
        script.write_text(RANKS + "\n# edited\n")  # the code it imported changed
        lines: list[str] = []
        handle = launcher.start(spec, on_line=lambda s, line: lines.append(line))
        assert handle.wait(120).returncode == 0
        assert int(handle.handle_id) != agent
        assert not alive(agent) and not any(alive(pid) for pid in ranks)
        assert re.search(
            rf"standby pid {agent} not used: .*ranks.py changed since it was imported", caplog.text
        )
        assert len([line for line in lines if line.startswith("rank ")]) == 2
        replacement = launcher.parked(timeout=30)  # and a new standby was parked for the next relaunch
        assert replacement is not None and replacement.pid not in (agent, int(handle.handle_id))


@pytest.mark.parametrize(
    "options",
    [
        TorchrunOptions(nproc_per_node=2, rdzv_endpoint="localhost:29400"),
        TorchrunOptions(nnodes="1:2", rdzv_endpoint="h:29400"),
    ],
)
def test_a_standby_needs_one_node_and_a_free_port(options: TorchrunOptions):
    with pytest.raises(UserError, match="one node with a rendezvous on a free port"):
        TorchrunStandbyLauncher(StandbyOptions(), TorchrunLauncher(options))


# -- end to end: the example under DDP, rank 1 SIGKILLed, resumed through the parked agent ----------------------


def supervise(workdir: Path, park: str | None) -> tuple[dict, LineageRunner]:
    """`park`: None (cold), "imports", "plan", or "preload" (`park: plan, preload: true`: each rank keeps the
    newest commit read; the example then runs under test_standby_resume's marked wrapper, which waits for both
    ranks' standbys to hold the step-20 checkpoint before the kill)."""
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    relaunch = ""
    if park:
        point, preload = ("plan", "true") if park == "preload" else (park, "false")
        relaunch = (
            f"relaunch: {{standby: true, standby_delay_seconds: 0, park: {point}, preload: {preload}}}\n"
        )
    policy.write_text(FAST_POLICY.read_text() + relaunch)
    script = CHARLM
    if park == "preload":
        script = str(workdir / "marked_charlm.py")
        Path(script).write_text(PRELOAD_MARKED)
    options = RunOptions(
        command=(PY, script, "--steps", str(STEPS), "--eval-every", "20", *SMALL, "--threads", "1"),
        policy_path=str(policy),
        lineage="trs",
        workdir=workdir,
        stop_grace_seconds=15,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "kill@22:rank1", "OMP_NUM_THREADS": "1"},
        launcher=TorchrunLauncher(TorchrunOptions(nproc_per_node=2)),
        max_segments=4,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise().to_dict()
    return record, runner


def stored(runner: LineageRunner, checkpoint_id: str) -> dict[str, Any]:
    return stored_state(runner.layout.checkpoints, checkpoint_id)


def assert_equal_tree(a: Any, b: Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for key in a:
            assert_equal_tree(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_tree(x, y, f"{path}/{i}")
    else:
        assert a == b, path


@pytest.fixture(scope="module")
def cold_lineage(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, LineageRunner]:
    """The cold reference lineage, the same for every parametrization: supervised once per module."""
    return supervise(tmp_path_factory.mktemp("standby-torchrun") / "cold", park=None)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("park", ["imports", "plan", "preload"])
def test_a_resume_through_a_parked_torchrun_agent_is_bit_identical_to_a_cold_one(
    tmp_path: Path, caplog, park: str, cold_lineage: tuple[dict, LineageRunner]
):
    cold_record, cold_runner = cold_lineage
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    warm_record, warm_runner = supervise(tmp_path / "warm", park=park)

    for record in (cold_record, warm_record):
        first, second = record["segments"]
        assert first["event"]["evidence"]["rule"] == "torchrun_child_sigkill", first["event"]
        assert second["restore"]["checkpoint_id"].startswith(f"{RESUME_STEP:010d}-")
        assert second["outcome"] == "finished" and record["status"] == "finished"
    used = [int(pid) for pid in re.findall(r"segment starts in standby pid (\d+)", caplog.text)]
    assert used == [warm_record["segments"][1]["pid"]]  # the resumed segment ran in the parked agent
    if park != "imports":  # both ranks ran the example up to Session.attach (process group, DDP model) parked
        assert "(parked" in caplog.text and "the script up to its plan took" in caplog.text
    if park == "preload":  # each rank restored the step-20 checkpoint from the copy its own standby read
        first, second = warm_record["segments"]
        target = second["restore"]["checkpoint_id"]
        seen = marks(tmp_path / "warm")
        took = {pid for pid, what in seen.items() if f"took:{target}" in what}
        assert len(took) == 2, seen
        assert all(
            what[f"preloaded:{target}"][0] < first["ended"] for pid, what in seen.items() if pid in took
        )
    assert re.search(r"standby pid \d+ discarded: the supervisor is closing", caplog.text)  # none left behind

    cold = stored(cold_runner, cold_record["final_checkpoint"])
    warm = stored(warm_runner, warm_record["final_checkpoint"])
    assert "ranks" in warm and len(warm["ranks"]) == 2  # each rank's RNG streams and data position
    # The example seeds torch only (it uses neither Python's `random` nor NumPy's global generator), so those
    # two streams start from the OS's entropy in each lineage: each is compared with the lineage's own step-20
    # checkpoint instead, which its resumed segment restored (a process that had not would hold fresh ones).
    for record, runner, final in ((cold_record, cold_runner, cold), (warm_record, warm_runner, warm)):
        resumed_from = stored(runner, record["segments"][1]["restore"]["checkpoint_id"])
        pairs = [(final, resumed_from), *((final["ranks"][r], resumed_from["ranks"][r]) for r in ("0", "1"))]
        for tree, before in pairs:
            for stream in ("python", "numpy"):
                assert_equal_tree(tree["rng"].pop(stream), before["rng"][stream], stream)
    assert_equal_tree(cold, warm)


def test_the_runner_parks_torchrun_agents_where_it_can_and_says_why_not_elsewhere(tmp_path: Path, caplog):
    from policies import load_policy
    from supervisor.orchestrator.runner import with_standby

    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(FAST_POLICY.read_text() + "relaunch: {standby: true}\n")
    policy = load_policy(policy_path)
    base = RunOptions(command=(PY, "train.py"), policy_path=str(policy_path), lineage="x", workdir=tmp_path)

    free = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    wrapped = with_standby(RunOptions(**{**base.__dict__, "launcher": free}), policy).launcher
    assert isinstance(wrapped, TorchrunStandbyLauncher) and wrapped.inner is free

    fixed = TorchrunLauncher(TorchrunOptions(nproc_per_node=2, rdzv_endpoint="localhost:29400"))
    with caplog.at_level(logging.WARNING, "rollback_supervisor.orchestrator"):
        assert with_standby(RunOptions(**{**base.__dict__, "launcher": fixed}), policy).launcher is fixed
    assert "a parked agent beside the running one needs a port of its own" in caplog.text
    assert "starts each segment cold" in caplog.text
