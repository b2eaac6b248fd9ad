"""Spot test (issue 7): the flow's whole process tree dies mid-training; a new run resumes the lineage.

`rollback-supervisor run` runs as a real subprocess in its own session (with its own ephemeral Prefect
server); the test kills it with SIGKILL (whole tree, no warning) or SIGTERM (the CLI only, graceful), then
re-runs the same lineage with the real flow in process. The resumed lineage must start from the newest
valid checkpoint, never retrain a checkpointed step, and end bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from mlflow.tracking import MlflowClient

from policies import History
from supervisor import exitcodes
from supervisor.checkpoint import CheckpointInfo, open_store
from supervisor.lineage import Lease
from tests.conftest import REPO
from tests.flowkit import (
    CHARLM,
    assert_same_state,
    live_series,
    load_final_state,
    record,
    run_flow,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 60
KILL_AFTER_STEP = 40  # the fast policy checkpoints every 20 steps: kill once step 40 is committed
CLI = Path(sys.executable).with_name("rollback-supervisor")
SPOT_POLICY = REPO / "tests" / "data" / "policies" / "spot.yaml"  # fast.yaml with a startup-proof hang limit
#: The most the resume may wait for the killed supervisor's lease. It waits for nothing in practice: a lease whose
#: holder's process is dead on this host is taken over at once; a holder elsewhere would be waited out (60 s TTL).
LEASE_WAIT = 90.0
START_TIMEOUT = 420.0  # a cold ephemeral Prefect server plus 40 steps, on 2 busy cores


# -- helpers shared with the remote test ---------------------------------------------------------


def cli_argv(
    workdir: Path, lineage: str, *, policy: Path = SPOT_POLICY, steps: int = STEPS, lease_wait: float = 0.0
) -> list[str]:
    """`rollback-supervisor run` for the example workload."""
    return [
        str(CLI), "run", "--policy", str(policy), "--lineage", lineage, "--workdir", str(workdir),
        "--stop-grace", "20", "--lease-wait", str(lease_wait),
        "--", "python", CHARLM, "--steps", str(steps), "--eval-every", "20",
    ]  # fmt: skip


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment; without a PREFECT_API_URL in `extra` the CLI starts its own server."""
    env = {**os.environ, **(extra or {})}
    if "PREFECT_API_URL" not in (extra or {}):
        env.pop("PREFECT_API_URL", None)  # an ephemeral server of its own, as on a bare spot machine
    return env


def start_cli(
    root: Path,
    workdir: Path,
    lineage: str,
    *,
    policy: Path = SPOT_POLICY,
    steps: int = STEPS,
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """`rollback-supervisor run` in its own session, logging to `root/cli-<lineage>.log`."""
    log = root / f"cli-{lineage}.log"
    return subprocess.Popen(
        cli_argv(workdir, lineage, policy=policy, steps=steps),
        cwd=root,
        env=cli_env(env),
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def cli_log(root: Path, lineage: str) -> str:
    return (root / f"cli-{lineage}.log").read_text(errors="replace")


def wait_until(what: str, check: Callable[[], bool], proc: subprocess.Popen, log: Callable[[], str]) -> None:
    """Poll `check` until true; fail at once with the CLI's log if the CLI exits first."""
    deadline = time.monotonic() + START_TIMEOUT
    while not check():
        if proc.poll() is not None:
            pytest.fail(f"the CLI exited with {proc.returncode} before {what}; its log:\n{log()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {START_TIMEOUT:.0f}s; the CLI's log:\n{log()[-4000:]}")
        time.sleep(0.2)


def newest(store: str | Path) -> CheckpointInfo | None:
    """The newest committed, live checkpoint of a store (local directory or URL), or None."""
    try:
        infos = [i for i in open_store(store).list() if not i.abandoned]
    except FileNotFoundError:
        return None
    return max(infos, key=lambda i: i.seq, default=None)


def reached(store: str | Path, step: int) -> Callable[[], bool]:
    def check() -> bool:
        info = newest(store)
        return info is not None and info.step >= step

    return check


def process_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def role(p: psutil.Process) -> str:
    try:
        argv = p.cmdline()
    except psutil.Error:
        return "gone"
    cmd = " ".join(argv)
    if "rollback-supervisor" in " ".join(argv[:2]):
        return "cli"
    if "charlm.py" in cmd:
        return "training"
    return "prefect-server" if "uvicorn" in cmd or "prefect.server" in cmd else cmd[:80]


def running(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    """Which of `procs` still run after up to `timeout` s (zombies awaiting their reaper count as gone)."""

    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout
    while (left := [p for p in procs if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def kill_tree(proc: subprocess.Popen) -> list[psutil.Process]:
    """SIGKILL the CLI and every descendant (the training and the ephemeral Prefect server) at once."""
    tree = process_tree(proc)
    for p in tree:
        with contextlib.suppress(psutil.Error):
            p.kill()
    proc.wait(30)
    return tree


def reap(proc: subprocess.Popen, tree: list[psutil.Process]) -> None:
    """Clean-up after a failed test: only the processes this test started, by PID."""
    left = []
    with contextlib.suppress(psutil.Error):
        left = process_tree(proc) if proc.poll() is None else []
    for p in [*tree, *left]:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)


def segment_steps(result: dict[str, Any], started: float) -> list[int]:
    """The loss steps a segment logged, in logging order: every point timestamped after it started."""
    client = MlflowClient(tracking_uri=result["tracking_uri"])
    points = client.get_metric_history(result["mlflow_run_id"], "loss")
    return [
        p.step for p in sorted(points, key=lambda p: (p.timestamp, p.step)) if p.timestamp >= started * 1000
    ]


def reference_run(factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One uninterrupted supervised run of the example per test session (shared with the remote test)."""
    root = factory.getbasetemp() / "spot-reference"
    done = root / "reference.json"
    if done.exists():
        return json.loads(done.read_text())
    root.mkdir(exist_ok=True)
    result = run_flow(root / "work", steps=STEPS, policy=SPOT_POLICY, lineage="reference")
    assert result["status"] == "finished", result
    rec = record(root / "work", "reference")
    assert len(rec["segments"]) == 1
    ref = {
        "checkpoints": rec["storage"]["checkpoints"],
        "final_checkpoint": result["final_checkpoint"],
        "tracking_uri": result["tracking_uri"],
        "mlflow_run_id": result["mlflow_run_id"],
    }
    done.write_text(json.dumps(ref))
    return ref


def assert_resumed_exactly(
    ref: dict[str, Any],
    result: dict[str, Any],
    rec: dict[str, Any],
    resume_from: CheckpointInfo,
    checkpoints: Path | None = None,
) -> None:
    """What every spot resume must show: the resume point, no checkpointed step redone, same bits."""
    assert result["status"] == "finished", result
    interrupted, resumed = rec["segments"][0], rec["segments"][-1]
    assert len(rec["segments"]) == 2, [s["outcome"] for s in rec["segments"]]
    assert interrupted["outcome"] == "interrupted"
    assert interrupted["event"]["type"] == "preemption"
    assert interrupted["decision"]["action"] == "resume"
    assert interrupted["decision"]["target_id"] == resume_from.id
    assert resumed["restore"]["checkpoint_id"] == resume_from.id
    assert resumed["outcome"] == "finished"
    # The interrupted segment spent restart budget: a crash loop cannot reset it.
    history = History.from_dict(rec["history"])
    assert history.restarts == 1
    assert [e.event.type for e in history] == ["preemption"]
    # Never retrains a checkpointed step: the new segment logs exactly the steps after the resume point.
    assert segment_steps(result, resumed["started"]) == list(range(resume_from.step + 1, STEPS + 1))
    # Bit-identical to the uninterrupted run: parameters, optimizer state, and every loss after the resume.
    a = load_final_state(Path(ref["checkpoints"]), ref["final_checkpoint"], STEPS)
    b = load_final_state(
        checkpoints or Path(rec["storage"]["checkpoints"]), result["final_checkpoint"], STEPS
    )
    assert b["step"] == STEPS
    assert_same_state(a, b)
    la, lb = live_series(ref, "loss"), live_series(result, "loss")
    after = range(resume_from.step + 1, STEPS + 1)
    assert [lb[s] for s in after] == [la[s] for s in after]


# -- SIGKILL: the machine vanishes ------------------------------------------------------------------


@dataclass
class Killed:
    """What the SIGKILL case left behind and what the resumed run did."""

    roles: list[str]
    survivors: list[str]
    newest: CheckpointInfo
    record_after_kill: dict[str, Any]
    lease_after_kill: dict[str, Any]
    cli_pid: int
    ref: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
def sigkilled(prefect_harness, tmp_path_factory) -> Killed:
    lineage = "spot-kill"
    root = tmp_path_factory.mktemp("spot-kill")
    work = root / "work"
    store = work / "checkpoints" / lineage
    proc = start_cli(root, work, lineage)
    tree: list[psutil.Process] = []
    try:
        wait_until(
            f"a checkpoint at step >= {KILL_AFTER_STEP}",
            reached(store, KILL_AFTER_STEP),
            proc,
            lambda: cli_log(root, lineage),
        )
        tree = process_tree(proc)
        roles = sorted(role(p) for p in tree)
        kill_tree(proc)
        survivors = [f"{p.pid} {role(p)}" for p in running(tree)]
        lineage_dir = work / "lineages" / lineage
        case = Killed(
            roles=roles,
            survivors=survivors,
            newest=newest(store),
            record_after_kill=json.loads((lineage_dir / "lineage.json").read_text()),
            lease_after_kill=json.loads((lineage_dir / "lease.json").read_text()),
            cli_pid=proc.pid,
        )
        case.ref = reference_run(tmp_path_factory)
        case.result = run_flow(
            work, steps=STEPS, policy=SPOT_POLICY, lineage=lineage, lease_wait_seconds=LEASE_WAIT
        )
        case.record = record(work, lineage)
        return case
    finally:
        reap(proc, tree)


def test_sigkill_takes_down_the_whole_flow_tree(sigkilled: Killed):
    assert sigkilled.roles == ["cli", "prefect-server", "training"]
    assert sigkilled.survivors == []
    # The supervisor died without a word: the record still shows the segment as running.
    seg = sigkilled.record_after_kill["segments"][-1]
    assert seg["ended"] is None and seg["outcome"] is None
    assert sigkilled.record_after_kill["status"] == "running"
    assert sigkilled.lease_after_kill["owner"].split(":")[1] == str(sigkilled.cli_pid)


def test_sigkill_resumes_from_newest_checkpoint_bit_identical(sigkilled: Killed):
    assert sigkilled.newest.step >= KILL_AFTER_STEP
    assert_resumed_exactly(sigkilled.ref, sigkilled.result, sigkilled.record, sigkilled.newest)
    # The relaunched segment's restore came from the lineage's own recovery, not from a fresh start.
    assert sigkilled.record["segments"][0]["event"]["source"] == "lineage"
    assert sigkilled.record["mlflow"]["run_id"] == sigkilled.record_after_kill["mlflow"]["run_id"]


# -- SIGTERM: the graceful path ---------------------------------------------------------------------


@dataclass
class Terminated:
    """What the SIGTERM case showed and what the resumed run did."""

    returncode: int
    cli_output: str
    survivors: list[str]
    step_at_signal: int
    emergency: CheckpointInfo
    record_after_term: dict[str, Any]
    lease_left: bool
    segment_log: str
    ref: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)


def _heartbeat_step(path: Path) -> int:
    try:
        return json.loads(path.read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


@pytest.fixture(scope="module")
def sigtermed(prefect_harness, tmp_path_factory) -> Terminated:
    lineage = "spot-term"
    root = tmp_path_factory.mktemp("spot-term")
    work = root / "work"
    store = work / "checkpoints" / lineage
    beat = work / "lineages" / lineage / "heartbeat.json"
    proc = start_cli(root, work, lineage)
    tree: list[psutil.Process] = []
    try:
        # Past the step-40 checkpoint and off the 20-step cadence, so the emergency checkpoint is new.
        wait_until(
            f"step {KILL_AFTER_STEP + 3} after a checkpoint at step >= {KILL_AFTER_STEP}",
            lambda: reached(store, KILL_AFTER_STEP)() and _heartbeat_step(beat) >= KILL_AFTER_STEP + 3,
            proc,
            lambda: cli_log(root, lineage),
        )
        tree = process_tree(proc)
        step_at_signal = _heartbeat_step(beat)
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(120)
        lineage_dir = work / "lineages" / lineage
        case = Terminated(
            returncode=returncode,
            cli_output=cli_log(root, lineage),
            survivors=[f"{p.pid} {role(p)}" for p in running(tree, timeout=15)],
            step_at_signal=step_at_signal,
            emergency=newest(store),
            record_after_term=json.loads((lineage_dir / "lineage.json").read_text()),
            lease_left=Lease(str(lineage_dir)).holder() is not None,  # a released lease keeps only its token
            segment_log=(lineage_dir / "segments" / "0.log").read_text(),
        )
        case.ref = reference_run(tmp_path_factory)
        # The graceful path released the lease: the next run may take it at once.
        case.result = run_flow(work, steps=STEPS, policy=SPOT_POLICY, lineage=lineage, lease_wait_seconds=0)
        case.record = record(work, lineage)
        return case
    finally:
        reap(proc, tree)


def test_sigterm_cli_exits_143_and_leaves_nothing_running(sigtermed: Terminated):
    assert sigtermed.returncode == 143, sigtermed.cli_output[-3000:]
    assert "interrupted (received SIGTERM)" in sigtermed.cli_output
    assert sigtermed.survivors == []
    assert not sigtermed.lease_left


def test_sigterm_writes_emergency_checkpoint_where_training_was(sigtermed: Terminated):
    seg = sigtermed.record_after_term["segments"][-1]
    assert seg["returncode"] == exitcodes.EXIT_PREEMPTED
    assert seg["outcome"] == "interrupted" and seg["event"]["type"] == "preemption"
    assert f"emergency checkpoint at step {sigtermed.emergency.step}" in sigtermed.segment_log
    # The emergency checkpoint is at the step the training had reached, not a cadence checkpoint.
    assert sigtermed.emergency.step == seg["last_step"]
    assert sigtermed.emergency.step >= sigtermed.step_at_signal > KILL_AFTER_STEP
    # Off the 20-step cadence, unless a loaded machine let training reach its last step (60) before the signal
    # arrived (measured here: 2-6 steps after the signal idle, 17 once in CI); the log line above still shows
    # it was the emergency path that wrote it.
    assert sigtermed.emergency.step % 20 != 0 or sigtermed.emergency.step == STEPS


def test_sigterm_resumes_from_emergency_checkpoint_bit_identical(sigtermed: Terminated):
    assert_resumed_exactly(sigtermed.ref, sigtermed.result, sigtermed.record, sigtermed.emergency)


def test_sigterm_records_the_signal_the_supervisor_sent(sigtermed: Terminated):
    assert sigtermed.record_after_term["segments"][0]["signal_sent"] == signal.SIGTERM
