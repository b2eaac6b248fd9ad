"""The standby launcher: a parked process runs a segment exactly as a cold start would; a dead or stale one is
replaced and never used. Real processes, pipes and signals; a script and a helper module in tmp_path."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from supervisor.launcher import LaunchSpec, LocalLauncher
from supervisor.launcher.standby import StandbyLauncher, StandbyOptions, Target
from supervisor.launcher.standby_child import top_level_imports

PY = sys.executable
#: Prints what a training script can see of how it was started, then exits with $CODE.
SCRIPT = """\
import json, os, sys
import helper
from helper import VALUE
main = sys.modules["__main__"]
print(json.dumps({
    "argv": sys.argv, "file": __file__, "name": __name__, "path0": sys.path[0], "cwd": os.getcwd(),
    "env": {k: v for k, v in os.environ.items() if k.startswith(("ROLLBACK_SUPERVISOR_", "STANDBY_TEST"))},
    "helper": VALUE, "main_file": main.__file__, "spec": getattr(__spec__, "name", None), "package": __package__,
    "pgid_is_pid": os.getpgid(0) == os.getpid(), "helper_loaded_from": helper.__file__,
    "builtins": type(__builtins__).__name__,
}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("STANDBY_TEST_CODE", "0")))
"""
FAST = StandbyOptions(delay_seconds=0, torch=False)  # torch's import is the e2e test's; these stay fast


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "helper.py").write_text("VALUE = 1\n")
    return tmp_path


def spec(cwd: Path, segment: int, command: tuple[str, ...] | None = None, **env: str) -> LaunchSpec:
    overrides = {
        "ROLLBACK_SUPERVISOR_PLAN": str(cwd / f"plan-{segment}.json"),
        "STANDBY_TEST_CODE": "3",
        **env,
    }
    return LaunchSpec(
        command or (PY, "train.py", "--segment", str(segment)), env_overrides=overrides, cwd=str(cwd)
    )


def run(launcher, s: LaunchSpec) -> tuple[dict, list, int, int]:
    """Start and wait; (what the script printed, all output lines, exit code, pid)."""
    lines: list[tuple[str, str]] = []
    handle = launcher.start(s, lambda stream, line: lines.append((stream, line)))
    info = handle.wait(60)
    out = [json.loads(line) for stream, line in lines if stream == "stdout" and line.startswith("{")]
    assert out, lines
    return out[0], lines, info.returncode, int(handle.handle_id)


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ((PY, "train.py", "--a"), (Target(PY, (), "path", "train.py"), ("--a",))),
        (("python3", "-u", "-m", "pkg.mod", "x"), (Target("python3", ("-u",), "module", "pkg.mod"), ("x",))),
        ((PY, "-W", "ignore", "t.py"), (Target(PY, ("-W", "ignore"), "path", "t.py"), ())),
        ((PY, "-c", "print(1)"), None),
        ((PY, "--version"), None),
        (("torchrun", "t.py"), None),
        (("bash", "run.sh"), None),
    ],
)
def test_which_commands_can_park(command, expected):
    assert Target.of(command) == expected


def test_only_unconditional_top_level_imports_are_found():
    source = """\
from __future__ import annotations
import os, json as j
from a.b import c, d
from . import sibling
try:
    import fast_json
except ImportError:
    import slow_json
if os.environ.get("X"):
    import optional
def f():
    import inner
class K:
    import in_class
"""
    assert top_level_imports(source) == ["os", "json", "a.b", "a.b.c", "a.b.d", "fast_json"]
    assert top_level_imports(source, package="pkg")[-3:] == ["pkg", "pkg.sibling", "fast_json"]


def test_a_segment_in_the_standby_sees_what_a_cold_start_sees(project: Path):
    cold, cold_lines, cold_code, _ = run(LocalLauncher(), spec(project, 1))
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0))
        assert parked is not None and parked.wait_ready(30)
        assert str(project / "helper.py") in [f[0] for f in parked.report["files"]]  # imported while parked
        warm, warm_lines, warm_code, pid = run(launcher, spec(project, 1))
    assert pid == parked.pid  # the parked process became the segment: its PID and process group
    assert warm == cold and warm_code == cold_code == 3
    assert warm["env"]["ROLLBACK_SUPERVISOR_PLAN"] == str(project / "plan-1.json")  # the segment's own plan
    assert warm["argv"] == ["train.py", "--segment", "1"] and warm["name"] == "__main__"
    assert warm["pgid_is_pid"] and warm["file"] == str(project / "train.py") == warm["main_file"]
    assert ("stderr", "to stderr") in warm_lines and len(warm_lines) == len(cold_lines)


def test_a_module_command_runs_as_python_dash_m(project: Path):
    (project / "pkg").mkdir()
    (project / "pkg" / "__init__.py").write_text("")
    (project / "pkg" / "mod.py").write_text(SCRIPT)
    command = (PY, "-m", "pkg.mod", "--x")
    cold, _, _, _ = run(LocalLauncher(), spec(project, 1, command))
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0, command))
        assert parked is not None and parked.wait_ready(30)
        warm, _, _, pid = run(launcher, spec(project, 1, command))
    assert pid == parked.pid and warm == cold


def test_a_killed_standby_is_replaced_and_the_relaunch_starts_cold(project: Path, caplog):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    with StandbyLauncher(FAST) as launcher:
        killed = launcher.park_for(spec(project, 0))
        assert killed is not None and killed.wait_ready(30)
        os.kill(killed.pid, signal.SIGKILL)
        killed.proc.wait(10)
        out, _, code, pid = run(launcher, spec(project, 1))
        assert pid != killed.pid and code == 3 and out["argv"][-1] == "1"
        assert f"standby pid {killed.pid} not used: it exited with code -9 while parked" in caplog.text
        replacement = launcher.parked(timeout=10)  # started after that segment (delay 0)
        assert replacement is not None and replacement.pid not in (killed.pid, pid)
        out, _, code, pid = run(launcher, spec(project, 2))
        assert pid == replacement.pid and code == 3 and out["argv"][-1] == "2"


@pytest.mark.parametrize("change", ["code", "environment", "working directory", "command"])
def test_a_stale_standby_is_replaced_never_used(project: Path, change: str, caplog):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    other = project / "elsewhere"
    other.mkdir()
    for name in ("train.py", "helper.py"):
        (other / name).write_text((project / name).read_text())
    with StandbyLauncher(FAST) as launcher:
        stale = launcher.park_for(spec(project, 0))
        assert stale is not None and stale.wait_ready(30)
        relaunch = spec(project, 1)
        if change == "code":
            helper = project / "helper.py"
            helper.write_text("VALUE = 2\n")
            st = helper.stat()
            os.utime(helper, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))  # a later mtime for sure
        elif change == "environment":
            relaunch = spec(project, 1, STANDBY_TEST_FLAG="on")
        elif change == "working directory":
            relaunch = spec(other, 1)
        else:
            relaunch = spec(project, 1, (PY, "-u", "train.py", "--segment", "1"))
        out, _, code, pid = run(launcher, relaunch)
        assert pid != stale.pid and code == 3
        assert stale.proc.poll() is not None  # killed, not left parked
        assert f"standby pid {stale.pid} not used: the {change}" in caplog.text or (
            change == "code"
            and f"standby pid {stale.pid} not used: {project / 'helper.py'} changed" in caplog.text
        )
        if change == "code":
            assert out["helper"] == 2  # the new code ran
        replacement = launcher.parked(timeout=10)
        assert replacement is not None and replacement.pid not in (stale.pid, pid)


def test_only_the_per_segment_variables_may_differ(project: Path):
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0, ROLLBACK_SUPERVISOR_FAULTS="kill@3"))
        assert parked is not None and parked.wait_ready(30)
        out, _, _, pid = run(launcher, spec(project, 1))
    assert pid == parked.pid
    assert out["env"] == {"ROLLBACK_SUPERVISOR_PLAN": str(project / "plan-1.json"), "STANDBY_TEST_CODE": "3"}


def test_closing_kills_the_parked_process_and_parks_no_more(project: Path):
    launcher = StandbyLauncher(FAST)
    parked = launcher.park_for(spec(project, 0))
    assert parked is not None
    launcher.close()
    assert parked.proc.wait(10) == -signal.SIGKILL
    _, _, code, pid = run(launcher, spec(project, 1))
    assert pid != parked.pid and code == 3
    assert launcher.parked() is None


def test_a_standby_left_by_a_vanished_supervisor_exits_on_its_own(project: Path):
    """The plan pipe's write end closes with the supervisor: end of file, and the parked process exits 0."""
    launcher = StandbyLauncher(FAST)
    parked = launcher.park_for(spec(project, 0))
    assert parked is not None and parked.wait_ready(30)
    os.close(parked._plan_w)  # what the supervisor's death does to the pipe
    assert parked.proc.wait(30) == 0


def test_output_printed_while_parked_reaches_the_segment_first(project: Path):
    """Import-time output larger than a pipe's buffer neither blocks the parking nor gets lost."""
    (project / "helper.py").write_text(
        "import sys\nfor i in range(5000):\n    print(f'import warning {i:05d} ' + 'x' * 40, file=sys.stderr)\nVALUE = 1\n"
    )
    _, cold_lines, _, _ = run(LocalLauncher(), spec(project, 1))
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0))
        assert parked is not None and parked.wait_ready(30)  # 250 KB printed, and still it parked
        _, warm_lines, _, pid = run(launcher, spec(project, 1))
    assert pid == parked.pid
    assert [line for s, line in warm_lines if s == "stderr"] == [
        line for s, line in cold_lines if s == "stderr"
    ]
    assert warm_lines[0] == ("stderr", "import warning 00000 " + "x" * 40)


def test_a_segment_left_in_a_standby_by_a_vanished_supervisor_is_reclaimed(project: Path):
    """The record keeps the standby's PID and start time, and its environment names a plan in the lineage's
    directory (the one it was parked with), so the next supervisor recognises and kills it."""
    (project / "train.py").write_text("import time\nprint('training', flush=True)\ntime.sleep(600)\n")
    with StandbyLauncher(FAST) as launcher:
        assert_reclaimed_for_its_lineage_only(launcher, spec(project, 0), spec(project, 1), project)


def assert_reclaimed_for_its_lineage_only(
    launcher: StandbyLauncher, parking: LaunchSpec, segment: LaunchSpec, plan_dir: Path
) -> None:
    """Park for `parking`, start `segment` in the standby (a script that prints `training` and sleeps), then do
    what the next supervisor does after a crash: reclaim with another lineage's plan directory (left alone),
    then with `plan_dir` (killed)."""
    parked = launcher.park_for(parking)
    assert parked is not None and parked.wait_ready(30)
    lines: list[tuple[str, str]] = []
    handle = launcher.start(segment, lambda stream, line: lines.append((stream, line)))
    assert int(handle.handle_id) == parked.pid
    deadline = time.monotonic() + 30
    while ("stdout", "training") not in lines and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ("stdout", "training") in lines
    details = {**handle.details(), "host": socket.gethostname(), "index": 1}
    LocalLauncher().reclaim({**details, "env_in_dir": {"ROLLBACK_SUPERVISOR_PLAN": str(plan_dir / "other")}})
    assert handle.wait_exit(1.0) is None  # not the lineage's: left alone
    LocalLauncher().reclaim({**details, "env_in_dir": {"ROLLBACK_SUPERVISOR_PLAN": str(plan_dir)}})
    assert handle.wait(30).returncode == -signal.SIGKILL
