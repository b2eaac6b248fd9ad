"""The torchrun launcher: the command around the user's script, and real ranks run as one process group."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest

from supervisor.errors import UserError
from supervisor.launcher import ExitInfo, LaunchSpec, TorchrunLauncher, TorchrunOptions
from supervisor.launcher.torchrun import TorchrunSegment, root_cause_exitcode, script_args, split_command

PY = sys.executable


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((PY, "train.py", "--steps", "3"), ("train.py", "--steps", "3")),
        (("python", "train.py"), ("train.py",)),
        (("python3", "-m", "pkg.train"), ("-m", "pkg.train")),
        (("python", "-u", "-W", "error", "-Xdev", "train.py"), ("train.py",)),
        (("train.py", "--x"), ("train.py", "--x")),
        ((), ()),
    ],
)
def test_script_args_drop_the_interpreter(command, expected):
    assert script_args(command) == expected


def test_the_command_puts_the_torchrun_options_before_the_script():
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=4, extra_args=("--log-dir", "/tmp/l")))
    cmd = launcher.command(("/other/venv/bin/python", "-u", "train.py", "--steps", "3"), rdzv_id="abc")
    assert cmd == (
        "/other/venv/bin/python",  # the user's interpreter runs the agent (and the ranks), with its options
        "-u",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "4",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "localhost:0",
        "--rdzv-id",
        "abc",
        "--max-restarts",
        "0",
        "--log-dir",
        "/tmp/l",
        "train.py",
        "--steps",
        "3",
    )


def test_each_start_gets_its_own_rendezvous():
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    a, b = (launcher.command(("x.py",)) for _ in range(2))
    assert a[a.index("--rdzv-id") + 1] != b[b.index("--rdzv-id") + 1]


def test_a_script_without_an_interpreter_runs_under_the_supervisors_python():
    assert launcher_head(("train.py", "--x")) == (PY, "-m", "torch.distributed.run")


def launcher_head(command: tuple[str, ...]) -> tuple[str, ...]:
    cmd = TorchrunLauncher(TorchrunOptions()).command(command, rdzv_id="x")
    return cmd[: cmd.index("torch.distributed.run") + 1]


@pytest.mark.parametrize("flag", ["-c", "-i", "--version", "-Z"])
def test_an_interpreter_option_torchrun_cannot_carry_is_refused_by_name(flag):
    with pytest.raises(UserError, match=f"'{flag}'"):
        split_command(("python", flag, "train.py"))


def test_the_interpreter_options_stand_before_the_module():
    split = split_command(("python3", "-OO", "-W", "ignore", "-m", "pkg.train", "-u"))
    assert (split.interpreter, split.flags, split.script) == (
        "python3",
        ("-OO", "-W", "ignore"),
        ("-m", "pkg.train", "-u"),
    )


def test_nproc_per_node_must_be_positive():
    with pytest.raises(UserError, match="nproc_per_node"):
        TorchrunOptions(nproc_per_node=0)


@pytest.mark.parametrize("nnodes", ["2", "1:4"])
def test_several_nodes_need_an_explicit_rendezvous_endpoint(nnodes):
    with pytest.raises(UserError, match="explicit endpoint"):
        TorchrunOptions(nnodes=nnodes)
    assert TorchrunOptions(nnodes=nnodes, rdzv_endpoint="head:29400").nnodes == nnodes


#: The end of torchrun's stderr when rank 0 exits 76 and the agent stops rank 1 (torch 2.x, captured here).
ROOT_CAUSE = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/tmp/rf/fail.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_16:29:33
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 30828)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 30828
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_16:29:33
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 76 (pid: 30827)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_the_root_cause_names_the_failed_ranks_exit_code():
    assert root_cause_exitcode(ROOT_CAUSE) == 76  # not the -15 of the rank the agent stopped
    assert root_cause_exitcode("Traceback ...\nValueError: bad") is None


class _Ended:
    """A finished inner handle with a given exit."""

    def __init__(self, code: int, stderr: str) -> None:
        self.info = ExitInfo(code, stderr, "", None, "7", 1.0)

    def wait(self, timeout=None) -> ExitInfo:
        return self.info


@pytest.mark.parametrize(
    ("code", "stderr", "expected"),
    [(1, ROOT_CAUSE, 76), (1, "Traceback: agent crashed", 1), (0, "", 0), (2, ROOT_CAUSE, 2), (-9, "", -9)],
)
def test_the_torchrun_handle_reports_the_failed_ranks_code(code, stderr, expected):
    info = TorchrunSegment(_Ended(code, stderr)).wait()  # type: ignore[arg-type]
    assert info.returncode == expected and info.stderr_tail == stderr


class _Recorder:
    """A launcher that records the spec it was asked to start (torchrun's wrapping, without torchrun)."""

    def __init__(self) -> None:
        self.specs: list[LaunchSpec] = []

    def start(self, spec, on_line=None):
        self.specs.append(spec)
        return "handle"


def test_start_wraps_the_command_and_keeps_env_and_cwd():
    inner = _Recorder()
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=2), inner=inner)
    handle = launcher.start(LaunchSpec(("python", "t.py"), {"A": "1"}, cwd="/w", inherit_env=False, name="n"))
    assert handle.inner == "handle"
    (spec,) = inner.specs
    assert spec.command[:3] == ("python", "-m", "torch.distributed.run") and spec.command[-1] == "t.py"
    assert (spec.env_overrides, spec.cwd, spec.inherit_env, spec.name) == ({"A": "1"}, "/w", False, "n")


RANKS = """\
import os, sys, time
os.write(1, f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n".encode())  # one write: no interleaving
if len(sys.argv) > 1:
    time.sleep(60)
"""


@pytest.mark.slow
def test_real_torchrun_runs_every_rank_and_stop_ends_them_all(tmp_path: Path):

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {"OMP_NUM_THREADS": "1"}
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    lines: list[str] = []
    info = launcher.start(LaunchSpec((PY, str(script)), env), lambda s, line: lines.append(line)).wait()
    assert info.returncode == 0, info.stderr_tail
    assert sorted(line for line in lines if line.startswith("rank ")) == ["rank 0 of 2", "rank 1 of 2"]

    both = threading.Event()
    seen: list[str] = []

    def sink(stream: str, line: str) -> None:
        seen.append(line)
        if sum(s.startswith("rank ") for s in seen) == 2:
            both.set()

    handle = launcher.start(LaunchSpec((PY, str(script), "wait"), env), sink)
    assert both.wait(60), seen
    handle.stop(10, sig=signal.SIGTERM)
    info = handle.wait()
    assert info.signal_sent == signal.SIGTERM and info.returncode != 0


@pytest.mark.slow
def test_the_runner_supervises_through_the_torchrun_launcher(tmp_path: Path):
    """Given in RunOptions, the launcher starts every segment; the lineage finishes as with a local one."""
    from supervisor.orchestrator import LineageRunner, RunOptions
    from tests.flowkit import FAST_POLICY

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    lines: list[str] = []
    options = RunOptions(
        command=(PY, str(script)),
        policy_path=str(FAST_POLICY),
        lineage="tr",
        workdir=tmp_path / "wd",
        stop_grace_seconds=5,
        env={"OMP_NUM_THREADS": "1"},
        launcher=TorchrunLauncher(TorchrunOptions(nproc_per_node=2)),
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_line=lambda s, line: lines.append(line))
    assert record.status == "finished" and len(record.segments) == 1
    assert sorted(line for line in lines if line.startswith("rank ")) == ["rank 0 of 2", "rank 1 of 2"]
    assert record.command == [PY, str(script)]  # the record keeps the user's command


RANK_EXITS = """\
import os, sys, time
rank = int(os.environ["RANK"])
time.sleep(0.3 * rank)  # rank 0 fails first: it is the root cause
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("code", [3, 76])
def test_a_real_ranks_exit_code_reaches_the_handle(tmp_path: Path, code: int):
    from supervisor.monitor import classify_exit

    script = tmp_path / "exits.py"
    script.write_text(RANK_EXITS)
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    info = launcher.start(LaunchSpec((PY, str(script), str(code)), {"OMP_NUM_THREADS": "1"})).wait(120)
    assert info.returncode == code, info.stderr_tail
    assert (
        classify_exit(info.returncode, info.stderr_tail) is None
    )  # stopped / anomaly: as under the local launcher


USR2_RANKS = """\
import os, signal, sys, time
rank = os.environ["RANK"]
def handler(signum, frame):
    time.sleep(0.3)
    os.write(1, f"rank {rank} saved\\n".encode())
    sys.exit(3)
signal.signal(signal.SIGUSR2, handler)
os.write(1, f"rank {rank} ready\\n".encode())
time.sleep(60)
"""


@pytest.mark.slow
def test_an_anomaly_stop_lets_the_ranks_run_their_handlers(tmp_path: Path):
    # torchrun's agent dies of SIGUSR2 at once; the ranks must still get the grace to save.
    script = tmp_path / "usr2.py"
    script.write_text(USR2_RANKS)
    ready = threading.Event()
    seen: list[str] = []

    def sink(stream: str, line: str) -> None:
        seen.append(line)
        if sum(s.endswith(" ready") for s in seen) == 2:
            ready.set()

    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    handle = launcher.start(LaunchSpec((PY, str(script)), {"OMP_NUM_THREADS": "1"}), sink)
    assert ready.wait(60), seen
    handle.poll()  # the watch polls: the ranks are remembered as the group's descendants
    handle.stop(20, sig=signal.SIGUSR2)
    info = handle.wait(30)
    assert info.signal_sent == signal.SIGUSR2
    assert sorted(s for s in seen if s.endswith(" saved")) == ["rank 0 saved", "rank 1 saved"]


SLEEPING_RANKS = """\
import os, time
with open(os.path.join(os.environ["OUT"], f"rank{os.environ['RANK']}.pid"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("agent_dies_first", [False, True])
def test_a_vanished_supervisors_torchrun_segment_is_reclaimed_with_every_rank(
    tmp_path: Path, agent_dies_first
):
    """torchrun starts each rank in a session of its own, so killing the agent's group leaves the ranks
    training. The next supervisor's reclaim kills them too: listed under the live agent, or found by the
    plan directory their environment names once the agent died first."""
    import os
    import socket
    import time

    import psutil

    from supervisor.launcher import LocalLauncher

    script = tmp_path / "ranks.py"
    script.write_text(SLEEPING_RANKS)
    plan_dir = tmp_path / "lineage"
    env = {
        "OMP_NUM_THREADS": "1",
        "OUT": str(tmp_path),
        "ROLLBACK_SUPERVISOR_PLAN": str(plan_dir / "plan-0.json"),
    }
    handle = TorchrunLauncher(TorchrunOptions(nproc_per_node=2)).start(LaunchSpec((PY, str(script)), env))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("rank*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    ranks = [int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)]
    details = {**handle.details(), "host": socket.gethostname(), "index": 0}
    if agent_dies_first:
        os.kill(int(handle.handle_id), signal.SIGKILL)
        handle.wait(30)
    assert all(psutil.pid_exists(pid) for pid in ranks)  # a killpg of the agent alone would leave these

    LocalLauncher().reclaim({**details, "env_in_dir": {"ROLLBACK_SUPERVISOR_PLAN": str(tmp_path / "other")}})
    assert all(psutil.pid_exists(pid) for pid in ranks)  # another lineage's: left alone
    LocalLauncher().reclaim({**details, "env_in_dir": {"ROLLBACK_SUPERVISOR_PLAN": str(plan_dir)}})
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in ranks)
    if not agent_dies_first:
        assert handle.wait(30).returncode == -signal.SIGKILL


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
