"""A training process killed by a fatal signal (a segfault in an extension, a bad GPU, an abort) leaves its stack.

The runner sets PYTHONFAULTHANDLER=1 in every segment unless the user set it, and the classifier puts
faulthandler's error and the crashing thread's frames into the event: the lineage record says where it crashed.
The children here really segfault (`ctypes.string_at(0)`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.monitor.classifier import classify_exit
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.test_runner_supervise import SCRATCH

#: Crashes in `crash_in_here` on its main thread while another thread sleeps (faulthandler dumps both).
CRASHER = """\
import ctypes, sys, threading, time, pathlib

def sleeper():
    time.sleep(60)

def crash_in_here():
    ctypes.string_at(0)

marker = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None
if marker is not None and marker.exists():
    sys.exit(0)  # the relaunch finishes
if marker is not None:
    marker.write_text("crashed once")
threading.Thread(target=sleeper, daemon=True).start()
time.sleep(0.2)
crash_in_here()
"""


def crash(tmp_path: Path, faulthandler: str | None) -> subprocess.CompletedProcess:
    script = tmp_path / "crasher.py"
    script.write_text(CRASHER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    if faulthandler is not None:
        env["PYTHONFAULTHANDLER"] = faulthandler
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=60)


def test_the_event_names_the_crashing_threads_frames_innermost_first(tmp_path: Path):
    done = crash(tmp_path, "1")
    assert done.returncode == -signal.SIGSEGV
    event = classify_exit(done.returncode, done.stderr)
    assert event is not None
    assert event.evidence["signal"] == "SIGSEGV" and event.evidence["fatal_error"] == "Segmentation fault"
    stack = event.evidence["fatal_stack"]
    assert "string_at" in stack[0]  # innermost: where the signal hit
    assert stack[1] == f"{tmp_path / 'crasher.py'}:7 in crash_in_here"  # the crashing thread, not the sleeper
    assert stack[2].endswith(" in <module>") and len(stack) == 3
    assert f"signal SIGSEGV at {stack[1]}" in event.reason  # the innermost frame of the user's own code


def test_a_dump_in_the_tail_is_not_blamed_for_a_sigkill():
    """A rank torn down after another one crashed: the SIGKILLed one's reason names no frame of the other's."""
    text = 'Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n  File "/x/a.py", line 1 in f\n'
    event = classify_exit(-signal.SIGKILL, text)
    assert event is not None and event.evidence["fatal_stack"] == ["/x/a.py:1 in f"]
    assert " at /x/a.py" not in event.reason


def test_without_faulthandler_there_is_nothing_to_report_and_nothing_is_made_up(tmp_path: Path):
    done = crash(tmp_path, None)
    assert done.returncode == -signal.SIGSEGV and "Fatal Python error" not in done.stderr
    event = classify_exit(done.returncode, done.stderr)
    assert event is not None and event.evidence["signal"] == "SIGSEGV"
    assert "fatal_error" not in event.evidence and "fatal_stack" not in event.evidence


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # torchrun with --tee or a log prefix: each line of the rank's stderr starts with its tag
            "[default0]:Fatal Python error: Aborted\n[default0]:\n"
            "[default0]:Thread 0x00007f01 (most recent call first):\n"
            '[default0]:  File "/x/loader.py", line 9 in _worker\n'
            "[default0]:\n[default0]:Current thread 0x00007f02 (most recent call first):\n"
            '[default0]:  File "/x/train.py", line 41 in step\n'
            '[default0]:  File "/x/train.py", line 80 in main\n'
            "[default0]:\n[default0]:Extension modules: torch._C (total: 1)\n",
            ("Aborted", ["/x/train.py:41 in step", "/x/train.py:80 in main"]),
        ),
        (  # two crashes in the tail (two ranks): the last one is reported
            'Fatal Python error: Bus error\n\nCurrent thread 0x1 (most recent call first):\n  File "a.py", line 1 in f\n'
            "Fatal Python error: Segmentation fault\n\nCurrent thread 0x2 (most recent call first):\n"
            '  File "b.py", line 2 in g\n',
            ("Segmentation fault", ["b.py:2 in g"]),
        ),
        (  # the error without a stack (the tail was cut): the error alone
            "Fatal Python error: Segmentation fault\n\n",
            ("Segmentation fault", None),
        ),
    ],
)
def test_faulthandler_dumps_as_launchers_print_them(text: str, expected: tuple[str, list[str] | None]):
    event = classify_exit(-signal.SIGABRT, text)
    assert event is not None
    assert (event.evidence["fatal_error"], event.evidence.get("fatal_stack")) == expected


def supervise(tmp_path: Path, env: dict[str, str]) -> list:
    (tmp_path / "crasher.py").write_text(CRASHER)
    policy = tmp_path / "policy.yaml"
    policy.write_text(SCRATCH)
    options = RunOptions(
        command=(sys.executable, str(tmp_path / "crasher.py"), str(tmp_path / "marker")),
        policy_path=str(policy),
        lineage="crash",
        workdir=tmp_path / "wd",
        stop_grace_seconds=5,
        env=env,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise()
    assert record.status == "finished" and len(record.segments) == 2, [s.event for s in record.segments]
    return record.segments


def test_the_runner_turns_faulthandler_on_and_the_lineage_record_shows_the_frame(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    crashed, _ = supervise(tmp_path, {})
    evidence = crashed.event["evidence"]
    assert evidence["signal"] == "SIGSEGV" and evidence["fatal_error"] == "Segmentation fault"
    assert f"{tmp_path / 'crasher.py'}:7 in crash_in_here" in evidence["fatal_stack"]
    assert crashed.decision["action"] == "resume"


def test_a_users_own_setting_wins_even_when_it_turns_faulthandler_off(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    crashed, _ = supervise(tmp_path, {"PYTHONFAULTHANDLER": ""})
    assert crashed.event["evidence"]["signal"] == "SIGSEGV"
    assert "fatal_error" not in crashed.event["evidence"]
