"""The local launcher: a real process group, its output streamed, stopped with grace then for sure."""

from __future__ import annotations

import signal
import sys
import threading

import psutil

from supervisor.launcher import ExitInfo, Launcher, LaunchSpec, LocalLauncher, SegmentHandle, process_started
from supervisor.launcher.local import environment

PY = sys.executable


def _start(code: str, lines: list | None = None, **env: str) -> SegmentHandle:
    launcher: Launcher = LocalLauncher()
    sink = (lambda stream, line: lines.append((stream, line))) if lines is not None else None
    spec = LaunchSpec((PY, "-c", code), env_overrides={"PATH": "/usr/bin:/bin", **env}, inherit_env=False)
    return launcher.start(spec, sink)


def test_output_is_streamed_line_by_line_and_kept_as_tails():
    lines: list[tuple[str, str]] = []
    handle = _start("import sys; print('out 1'); print('err 1', file=sys.stderr); print('out 2')", lines)
    info = handle.wait()
    assert isinstance(info, ExitInfo) and info.returncode == 0 and info.signal_sent is None
    assert [line for s, line in lines if s == "stdout"] == ["out 1", "out 2"]
    assert [line for s, line in lines if s == "stderr"] == ["err 1"]
    assert info.stdout_tail == "out 1\nout 2" and info.stderr_tail == "err 1"


def test_the_handle_id_is_the_pid_and_the_details_identify_the_process():
    handle = _start("import sys; sys.exit(3)")
    details = handle.details()
    assert handle.handle_id == str(details["pid"])
    assert details["pid_started"] is None or details["pid_started"] > 0
    info = handle.wait()
    assert info.returncode == 3 and info.handle_id == handle.handle_id


def test_wait_exit_returns_none_while_running_and_the_code_once_it_exited():
    handle = _start("import time; time.sleep(60)")  # not stdin: it is /dev/null under CI
    assert handle.wait_exit(0.05) is None and handle.poll() is None
    handle.stop(5, sig=signal.SIGTERM)
    assert handle.wait_exit(5) == -signal.SIGTERM
    assert handle.wait().signal_sent == signal.SIGTERM


def test_a_child_that_ignores_the_signal_is_killed_after_the_grace_with_its_group():
    ready = threading.Event()
    lines: list[tuple[str, str]] = []

    def sink(stream: str, line: str) -> None:
        lines.append((stream, line))
        ready.set()

    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"child = subprocess.Popen([{PY!r}, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    handle = LocalLauncher().start(LaunchSpec((PY, "-c", code)), sink)
    assert ready.wait(30)
    grandchild = int(lines[0][1])
    handle.stop(0.5, sig=signal.SIGTERM)
    info = handle.wait()
    assert info.returncode == -signal.SIGKILL and info.signal_sent == signal.SIGTERM
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_kill_is_recorded_as_sent_by_us():
    handle = _start("import time; time.sleep(60)")
    handle.kill()
    info = handle.wait()
    assert info.returncode == -signal.SIGKILL and info.signal_sent == signal.SIGKILL


def test_a_failing_output_sink_does_not_block_the_child():
    def broken(stream: str, line: str) -> None:
        raise RuntimeError("sink down")

    handle = LocalLauncher().start(LaunchSpec((PY, "-c", "for i in range(2000): print(i)")), broken)
    info = handle.wait()
    assert info.returncode == 0 and info.stdout_tail.endswith("1999")


def test_a_child_outlives_its_leader_killed_by_the_signal_and_gets_the_grace(tmp_path):
    # torchrun's agent (or a shell) dies of SIGUSR2 at once; its children must still run their handlers.
    done = tmp_path / "saved"
    child = (
        "import signal, sys, time\n"
        "def handler(signum, frame):\n"
        "    time.sleep(0.3)\n"
        f"    open({str(done)!r}, 'w').write('saved')\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGUSR2, handler)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    leader = f"import subprocess, time\nsubprocess.Popen([{PY!r}, '-c', {child!r}])\ntime.sleep(60)\n"
    ready = threading.Event()
    handle = LocalLauncher().start(
        LaunchSpec((PY, "-c", leader)), lambda stream, line: line == "ready" and ready.set()
    )
    assert ready.wait(30)
    handle.stop(10, sig=signal.SIGUSR2)
    info = handle.wait()
    assert info.returncode == -signal.SIGUSR2 and info.signal_sent == signal.SIGUSR2
    assert done.read_text() == "saved"  # without the wait for descendants, SIGKILL came first


def test_a_child_that_outstays_the_grace_is_killed_once_its_leader_died(tmp_path):
    child = "import signal, time\nsignal.signal(signal.SIGUSR2, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    leader = f"import subprocess, sys, time\np = subprocess.Popen([{PY!r}, '-c', {child!r}])\nprint(p.pid, flush=True)\ntime.sleep(60)\n"
    lines: list[str] = []
    ready = threading.Event()

    def sink(stream: str, line: str) -> None:
        lines.append(line)
        if line == "ready":
            ready.set()

    handle = LocalLauncher().start(LaunchSpec((PY, "-c", leader)), sink)
    assert ready.wait(30)
    handle.stop(0.5, sig=signal.SIGUSR2)
    handle.wait()
    grandchild = int(next(line for line in lines if line != "ready"))
    assert _ends(grandchild)


def _ends(pid: int, within: float = 5.0) -> bool:
    """Whether `pid` is gone or a zombie within `within` seconds (a SIGKILL lands asynchronously)."""
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_wait_with_a_timeout_raises_timeout_error_while_running():
    handle = _start("import time; time.sleep(60)")
    assert handle.started()
    try:
        handle.wait(0.05)
        raise AssertionError("wait returned while the segment runs")
    except TimeoutError:
        pass
    handle.kill()
    assert handle.wait(10).returncode == -signal.SIGKILL


def test_the_environment_is_ours_plus_the_overrides_or_only_the_overrides(monkeypatch):
    monkeypatch.setenv("RS_TEST_OURS", "1")
    assert environment(LaunchSpec(("x",))) is None  # exactly ours
    inherited = environment(LaunchSpec(("x",), env_overrides={"A": "2"}))
    assert inherited is not None and inherited["RS_TEST_OURS"] == "1" and inherited["A"] == "2"
    assert environment(LaunchSpec(("x",), env_overrides={"A": "2"}, inherit_env=False)) == {"A": "2"}
    handle = LocalLauncher().start(
        LaunchSpec(
            (PY, "-c", "import os; print(os.environ.get('RS_TEST_OURS'), os.environ['A'])"), {"A": "2"}
        )
    )
    assert handle.wait(30).stdout_tail == "1 2"


def test_reclaim_kills_only_its_own_segment_on_this_host(tmp_path):
    import os
    import socket
    import subprocess

    sleep = [PY, "-c", "import time; time.sleep(60)"]
    ours = subprocess.Popen(
        sleep, start_new_session=True, env={**os.environ, "RS_PLAN": str(tmp_path / "p.json")}
    )
    try:
        details = {
            "pid": ours.pid,
            "pid_started": process_started(ours.pid),
            "host": socket.gethostname(),
            "index": 0,
            "env_in_dir": {"RS_PLAN": str(tmp_path)},
        }
        LocalLauncher().reclaim({**details, "host": "elsewhere"})
        LocalLauncher().reclaim({**details, "env_in_dir": {"RS_PLAN": str(tmp_path / "other")}})
        LocalLauncher().reclaim({**details, "pid_started": details["pid_started"] - 100})  # PID reused
        assert ours.poll() is None
        LocalLauncher().reclaim(details)
        try:
            assert ours.wait(10) == -signal.SIGKILL
        except subprocess.TimeoutExpired:  # say what the process is doing, for the next one to diagnose
            import psutil
            import pytest

            proc = psutil.Process(ours.pid)
            pytest.fail(
                f"not killed: status {proc.status()}, environ RS_PLAN {proc.environ().get('RS_PLAN')}"
            )
    finally:
        if ours.poll() is None:
            ours.kill()
            ours.wait()
