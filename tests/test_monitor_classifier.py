"""The exit classifier: a table of real-world exits and logs, plus real subprocesses and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from supervisor.monitor import classify_exit, exit_signal, read_oom_kills
from supervisor.monitor.classifier import PatternError

CASES = yaml.safe_load((Path(__file__).parent / "data" / "exit_cases" / "cases.yaml").read_text())


def test_the_table_is_big_enough_and_covers_every_class():
    assert len(CASES) >= 20
    assert {c["expect"] for c in CASES} == {
        None,
        "preemption",
        "hardware_fault",
        "oom",
        "software_error",
        "unknown_exit",
    }


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_exit_case(case):
    event = classify_exit(
        case["returncode"],
        case["stderr"],
        signal_sent_by_us=case.get("signal_sent_by_us"),
        notice_seen=case.get("notice_seen", False),
        extra_patterns=case.get("extra_patterns", ()),
        cgroup_oom_kills=case.get("cgroup_oom_kills"),
    )
    if case["expect"] is None:
        assert event is None
        return
    assert event is not None
    assert (event.type, event.evidence["rule"]) == (case["expect"], case["rule"])
    assert event.source == "exit" and event.evidence["returncode"] == case["returncode"]
    assert "\n" not in event.reason


def test_evidence_names_the_matching_line_and_the_exception():
    case = next(c for c in CASES if c["id"] == "xid13_graphics_exception_is_the_application")
    event = classify_exit(case["returncode"], case["stderr"])
    assert event.evidence["match"].startswith("NVRM: Xid (PCI:0000:01:00): 13,")
    assert event.evidence["exception"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert event.evidence["matched_rules"] == ["xid_application", "illegal_memory_access", "python_traceback"]


@pytest.mark.parametrize(
    ("returncode", "name"),
    [
        (-15, "SIGTERM"),
        (143, "SIGTERM"),
        (-9, "SIGKILL"),
        (137, "SIGKILL"),
        (-7, "SIGBUS"),
        (1, None),
        (75, None),
        (None, None),
    ],
)
def test_exit_signal_conventions(returncode, name):
    sig = exit_signal(returncode)
    assert (sig.name if sig else None) == name


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"type": "hang", "pattern": "x"}, "classifier_patterns[0].type: expected one of"),
        ({"type": "oom", "pattern": "("}, "expected a valid regular expression"),
        ({"type": "oom", "pattern": ""}, "pattern: expected a non-empty regular expression"),
        ({"type": "oom", "pattern": "x", "priority": "high"}, "priority: expected a number"),
    ],
)
def test_bad_policy_patterns_are_rejected(row, message):
    with pytest.raises(PatternError) as info:
        classify_exit(1, "x", extra_patterns=[row])
    assert message in str(info.value)


def test_read_oom_kills_reads_cgroup_v2_and_v1_files(tmp_path):
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert read_oom_kills(v2) == 2 and read_oom_kills(v1) == 5
    assert read_oom_kills(tmp_path / "missing") is None


def _child(code: str) -> subprocess.Popen:
    """A real Python child that prints 'ready' once its signal handlers are in place."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


SLEEPER = "import time\nprint('ready', flush=True)\ntime.sleep(60)\n"
GRACEFUL = (
    "import signal, sys, time\n"
    "def on_term(sig, frame):\n"
    "    print('SIGTERM received, emergency checkpoint saved', file=sys.stderr)\n"
    "    sys.exit(75)\n"
    "signal.signal(signal.SIGTERM, on_term)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("code", "sig", "by_us", "expect", "rule"),
    [
        (SLEEPER, signal.SIGTERM, False, "preemption", "sigterm"),
        (SLEEPER, signal.SIGTERM, True, None, None),
        (SLEEPER, signal.SIGKILL, False, "unknown_exit", "sigkill"),
        (GRACEFUL, signal.SIGTERM, False, "preemption", "exit_preempted"),
        (GRACEFUL, signal.SIGTERM, True, None, None),
    ],
    ids=["sigterm", "sigterm-ours", "sigkill", "graceful-preempt", "graceful-ours"],
)
def test_real_signals(code, sig, by_us, expect, rule):
    proc = _child(code)
    os.kill(proc.pid, sig)
    returncode, stderr = _finish(proc)
    event = classify_exit(returncode, stderr, signal_sent_by_us=int(sig) if by_us else None)
    assert (event.type if event else None, event.evidence["rule"] if event else None) == (expect, rule)


@pytest.mark.e2e
def test_real_exception_is_a_software_error():
    proc = subprocess.run(
        [sys.executable, "-c", "def step():\n    raise KeyError('tokens')\nstep()\n"],
        capture_output=True,
        text=True,
    )
    event = classify_exit(proc.returncode, proc.stderr[-4000:])
    assert proc.returncode == 1
    assert event.type == "software_error" and event.evidence["exception"] == "KeyError: 'tokens'"


@pytest.mark.e2e
def test_real_sigbus_is_a_hardware_fault():
    proc = subprocess.run(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGBUS)"],
        capture_output=True,
        text=True,
    )
    event = classify_exit(proc.returncode, proc.stderr)
    assert (
        proc.returncode == -signal.SIGBUS
        and event.type == "hardware_fault"
        and event.evidence["rule"] == "sigbus"
    )


@pytest.mark.e2e
def test_real_cuda_oom_text_from_a_child():
    code = "import sys\nsys.stderr.write('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\\n')\nsys.exit(1)\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert classify_exit(proc.returncode, proc.stderr).type == "oom"
