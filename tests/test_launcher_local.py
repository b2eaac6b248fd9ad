"""The local launcher: a real process group, its output streamed, stopped with grace then for sure."""

from __future__ import annotations

import signal
import sys
import threading

import psutil

from supervisor.launcher import ExitInfo, Launcher, LaunchSpec, LocalLauncher, SegmentHandle

PY = sys.executable


def _start(code: str, lines: list | None = None, **env: str) -> SegmentHandle:
    launcher: Launcher = LocalLauncher()
    sink = (lambda stream, line: lines.append((stream, line))) if lines is not None else None
    return launcher.start(LaunchSpec((PY, "-c", code), env={"PATH": "/usr/bin:/bin", **env}), sink)


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
    handle = _start("import sys; sys.stdin.readline(); sys.exit(5)")
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
