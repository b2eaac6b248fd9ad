"""The torchrun launcher: the command around the user's script, and real ranks run as one process group."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import pytest

from supervisor.launcher import LaunchSpec, TorchrunLauncher, TorchrunOptions
from supervisor.launcher.torchrun import script_args

PY = sys.executable


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((PY, "train.py", "--steps", "3"), ("train.py", "--steps", "3")),
        (("python", "train.py"), ("train.py",)),
        (("python3", "-m", "pkg.train"), ("-m", "pkg.train")),
        (("train.py", "--x"), ("train.py", "--x")),
        ((), ()),
    ],
)
def test_script_args_drop_the_interpreter(command, expected):
    assert script_args(command) == expected


def test_the_command_puts_the_torchrun_options_before_the_script():
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=4, extra_args=("--log-dir", "/tmp/l")))
    cmd = launcher.command(("python", "train.py", "--steps", "3"), rdzv_id="abc")
    assert cmd == (
        PY,
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


def test_nproc_per_node_must_be_positive():
    with pytest.raises(ValueError, match="nproc_per_node"):
        TorchrunOptions(nproc_per_node=0)


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
    assert launcher.start(LaunchSpec(("python", "t.py"), env={"A": "1"}, cwd="/w")) == "handle"
    (spec,) = inner.specs
    assert spec.command[:3] == (PY, "-m", "torch.distributed.run") and spec.command[-1] == "t.py"
    assert spec.env == {"A": "1"} and spec.cwd == "/w"


RANKS = """\
import os, sys, time
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
if len(sys.argv) > 1:
    time.sleep(60)
"""


@pytest.mark.slow
def test_real_torchrun_runs_every_rank_and_stop_ends_them_all(tmp_path: Path):
    import os

    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = TorchrunLauncher(TorchrunOptions(nproc_per_node=2))
    lines: list[str] = []
    info = launcher.start(
        LaunchSpec(("python", str(script)), env=env), lambda s, line: lines.append(line)
    ).wait()
    assert info.returncode == 0, info.stderr_tail
    assert sorted(line for line in lines if line.startswith("rank ")) == ["rank 0 of 2", "rank 1 of 2"]

    both = threading.Event()
    seen: list[str] = []

    def sink(stream: str, line: str) -> None:
        seen.append(line)
        if sum(s.startswith("rank ") for s in seen) == 2:
            both.set()

    handle = launcher.start(LaunchSpec(("python", str(script), "wait"), env=env), sink)
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
        command=("python", str(script)),
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
    assert record.command == ["python", str(script)]  # the record keeps the user's command
