"""`park: plan`: the standby runs the script up to its first `load_plan` and parks there; one that never gets
there, exits first, or looked up a per-segment variable too early is discarded, never used.

Real processes, pipes, signals and timers. The script loads the real `supervisor/runtime/plan.py` by path (its
`load_plan` is the park point) without importing the runtime package, which would import torch and cost
seconds per process; the e2e resume through charlm is test_standby_resume.py's.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from policies import PolicyError, parse_policy
from supervisor.launcher import LaunchSpec, LocalLauncher, standby_child
from supervisor.launcher.standby import PLAN_VARIABLE, StandbyLauncher, StandbyOptions
from supervisor.launcher.standby_child import PARKED_PLAN_VARIABLE
from supervisor.runtime import plan
from tests.test_standby import assert_reclaimed_for_its_lineage_only

PY = sys.executable
PLAN_PY = Path(plan.__file__)
#: Builds (appends `{"built", pid, t}` to built.jsonl), asks for its plan, then prints what it sees and exits 3.
#: A file `hang` in its directory makes it sleep before asking; `exit` makes it exit 5 there; `peek` makes it
#: look up its plan variable before asking.
SCRIPT = f"""\
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("rbs_plan", {str(PLAN_PY)!r})
plan = sys.modules["rbs_plan"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)
here = os.path.dirname(os.path.abspath(__file__))
peeked = None
if os.path.exists(os.path.join(here, "peek")):
    peeked = os.environ.get("ROLLBACK_SUPERVISOR_PLAN", "absent")
with open(os.path.join(here, "built.jsonl"), "a") as f:
    f.write(json.dumps({{"what": "built", "pid": os.getpid(), "t": time.time(), "peeked": peeked}}) + "\\n")
if os.path.exists(os.path.join(here, "hang")):
    time.sleep(600)
if os.path.exists(os.path.join(here, "exit")):
    sys.exit(5)
os.environ.setdefault("SET_BY_SCRIPT", "1")
p = plan.load_plan("t", workdir=here)
print(json.dumps({{
    "argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "pid": os.getpid(), "attached": time.time(),
    "env": {{k: v for k, v in os.environ.items()
            if k.startswith(("ROLLBACK_", "STANDBY_TEST", "SET_BY")) and k != "ROLLBACK_CACHE_DIR"}},  # the harness's
    "plan_workdir": p.workdir, "supervised": p.supervised,
}}))
sys.exit(3)
"""
FAST = StandbyOptions(delay_seconds=0, torch=False, park="plan")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def spec(cwd: Path, segment: int, *args: str, **env: str) -> LaunchSpec:
    plan_file = cwd / f"plan-{segment}.json"
    plan.LaunchPlan("l", str(cwd / f"seg-{segment}"), str(cwd / "ck"), "sqlite://").write(plan_file)
    overrides = {"ROLLBACK_SUPERVISOR_PLAN": str(plan_file), "STANDBY_TEST": "on", **env}
    return LaunchSpec((PY, "train.py", "--lr", "1", *args), env_overrides=overrides, cwd=str(cwd))


def run(launcher, s: LaunchSpec) -> tuple[dict, int, int, float]:
    """Start and wait; (what the script printed, exit code, pid, when it was started)."""
    lines: list[tuple[str, str]] = []
    sent = time.time()
    handle = launcher.start(s, lambda stream, line: lines.append((stream, line)))
    info = handle.wait(60)
    out = [json.loads(line) for stream, line in lines if stream == "stdout" and line.startswith("{")]
    assert out, lines
    return out[0], info.returncode, int(handle.handle_id), sent


def builds(project: Path) -> list[dict]:
    path = project / "built.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_the_park_module_name_is_the_same_on_both_sides():
    assert standby_child.PARK_MODULE == plan.PARK_MODULE
    assert PLAN_VARIABLE == plan.PLAN_ENV
    assert not PARKED_PLAN_VARIABLE.startswith(standby_child.PER_SEGMENT_PREFIX)  # never an early read


#: Asks for its plan, says so, then trains for ever (until a supervisor kills it).
TRAINS_ON = f"""\
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("rbs_plan", {str(PLAN_PY)!r})
plan = sys.modules["rbs_plan"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)
plan.load_plan("t", workdir=os.path.dirname(os.path.abspath(__file__)))
print("training", flush=True)
time.sleep(600)
"""


def test_a_segment_started_in_a_standby_parked_at_its_plan_is_reclaimed_after_its_supervisor_vanished(
    project: Path,
):
    """Parked with no segment's plan, it still names the lineage's plan directory in the environment it was
    started with (which is what the next supervisor can read of it), so it is recognised and killed."""
    (project / "train.py").write_text(TRAINS_ON)
    with StandbyLauncher(FAST) as launcher:
        assert_reclaimed_for_its_lineage_only(launcher, spec(project, 0), spec(project, 1), project)


def test_the_script_runs_up_to_its_plan_while_parked_and_then_sees_what_a_cold_start_sees(project: Path):
    cold, cold_code, cold_pid, _ = run(LocalLauncher(), spec(project, 1, ROLLBACK_SUPERVISOR_FAULTS="kill@3"))
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0, ROLLBACK_SUPERVISOR_FAULTS="nan@1"))
        assert parked is not None and parked.wait_ready(30) and parked.report["park"] == "plan"
        built = [b for b in builds(project) if b["pid"] == parked.pid]
        assert len(built) == 1  # built while parked, before any plan was sent
        warm, warm_code, pid, sent = run(launcher, spec(project, 1, ROLLBACK_SUPERVISOR_FAULTS="kill@3"))
    assert pid == parked.pid == warm["pid"] and built[0]["t"] < sent < warm["attached"]
    assert len([b for b in builds(project) if b["pid"] == pid]) == 1  # not built again after the plan came
    assert warm_code == cold_code == 3 and warm["name"] == "__main__"
    assert {k: v for k, v in warm.items() if k not in ("pid", "attached")} == {
        k: v for k, v in cold.items() if k not in ("pid", "attached")
    }
    assert warm["env"] == {  # the segment's per-segment variables, the script's own change kept
        "ROLLBACK_SUPERVISOR_PLAN": str(project / "plan-1.json"),
        "ROLLBACK_SUPERVISOR_FAULTS": "kill@3",
        "STANDBY_TEST": "on",
        "SET_BY_SCRIPT": "1",
    }
    assert warm["plan_workdir"] == str(project / "seg-1") and warm["supervised"] and cold_pid != pid


@pytest.mark.parametrize("preload", [False, True])
@pytest.mark.parametrize("trouble", ["hang", "exit"])
def test_a_standby_that_never_reaches_its_park_point_is_discarded_and_later_ones_park_at_the_imports(
    project: Path, trouble: str, preload: bool, caplog
):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    (project / trouble).write_text("")
    options = StandbyOptions(
        delay_seconds=0,
        torch=False,
        park="plan",
        park_timeout_seconds=2.0,
        preload=str(project / "ck") if preload else None,
    )
    with StandbyLauncher(options) as launcher:
        stuck = launcher.park_for(spec(project, 0))
        assert stuck is not None
        assert stuck.proc.wait(30) == (-9 if trouble == "hang" else 5)  # the bound killed it / it exited
        why = "had not reached its park point after 2s" if trouble == "hang" else "exited with code 5 before"
        said = f"standby pid {stuck.pid} never used: it {why}"
        deadline = time.monotonic() + 30  # the launcher's watcher notices the exit on a thread of its own
        while said not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.02)
        assert said in caplog.text
        (project / trouble).unlink()
        replacement = launcher.parked(timeout=10)  # parked again at once, at the imports this time
        assert replacement is not None and replacement.pid != stuck.pid
        assert replacement.park_point == "imports" == launcher.park_point
        assert replacement.options.preload is None  # no park point to preload at
        assert replacement.wait_ready(30)
        out, code, pid, _ = run(launcher, spec(project, 1))
    assert (
        pid == replacement.pid
        and code == 3
        and out["env"]["ROLLBACK_SUPERVISOR_PLAN"].endswith("plan-1.json")
    )
    assert [b["pid"] for b in builds(project)].count(pid) == 1  # the import-only standby built after its plan


def test_a_relaunch_never_waits_past_the_bound_for_a_standby_still_on_its_way(project: Path, caplog):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    (project / "hang").write_text("")
    options = StandbyOptions(
        delay_seconds=3600, torch=False, park="plan", park_timeout_seconds=3.0, ready_timeout_seconds=120
    )
    with StandbyLauncher(options) as launcher:
        stuck = launcher.park_for(spec(project, 0))
        assert stuck is not None
        while stuck.pid not in [b["pid"] for b in builds(project)]:  # past the `hang` check: asleep
            assert stuck.proc.poll() is None
            time.sleep(0.05)
        (project / "hang").unlink()  # the cold start does not hang
        out, code, pid, sent = run(launcher, spec(project, 1))
        assert pid != stuck.pid and code == 3 and stuck.proc.poll() is not None
        assert time.time() - sent < 60  # cold at the 3 s bound, not after ready_timeout_seconds (120 s)
    assert f"standby pid {stuck.pid} not used: it " in caplog.text


@pytest.mark.parametrize("change", ["peek", "arguments"])
def test_a_standby_that_peeked_at_its_segment_or_has_other_arguments_is_not_used(
    project: Path, change: str, caplog
):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    if change == "peek":
        (project / "peek").write_text("")
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0))
        assert parked is not None and parked.wait_ready(30)
        relaunch = spec(project, 1, "--resume") if change == "arguments" else spec(project, 1)
        out, code, pid, _ = run(launcher, relaunch)
        assert pid != parked.pid and code == 3 and parked.proc.poll() is not None
        assert out["env"]["ROLLBACK_SUPERVISOR_PLAN"] == str(project / "plan-1.json")
    expected = {
        "peek": "the script read ROLLBACK_SUPERVISOR_PLAN before its park point",
        "arguments": "the arguments changed",
    }[change]
    assert f"standby pid {parked.pid} not used: {expected}" in caplog.text
    assert launcher.park_point == ("imports" if change == "peek" else "plan")  # it would peek every time
    if (
        change == "peek"
    ):  # parked in the base environment: the plan of the segment it was parked for is not set
        assert [b["peeked"] for b in builds(project) if b["pid"] == parked.pid] == ["absent"]


@pytest.mark.parametrize("change", ["code", "environment", "working directory"])
def test_a_stale_standby_parked_at_its_plan_is_not_used(project: Path, change: str, caplog):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    other = project / "elsewhere"
    other.mkdir()
    (other / "train.py").write_text(SCRIPT)
    with StandbyLauncher(FAST) as launcher:
        parked = launcher.park_for(spec(project, 0))
        assert parked is not None and parked.wait_ready(30)
        relaunch = spec(project, 1)
        if change == "code":
            script = project / "train.py"
            script.write_text(SCRIPT.replace("sys.exit(3)", "sys.exit(4)"))
            st = script.stat()
            os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
        elif change == "environment":
            relaunch = spec(project, 1, STANDBY_TEST="off")
        else:
            relaunch = spec(other, 1)
        _, code, pid, _ = run(launcher, relaunch)
        assert pid != parked.pid and parked.proc.poll() is not None
        assert code == (4 if change == "code" else 3)
    assert f"standby pid {parked.pid} not used: " in caplog.text
    assert (f"the {change} changed" if change != "code" else "train.py changed since") in caplog.text


def test_a_parked_standby_of_a_vanished_supervisor_exits_at_its_park_point_without_running_on(project: Path):
    launcher = StandbyLauncher(FAST)
    parked = launcher.park_for(spec(project, 0))
    assert parked is not None and parked.wait_ready(30)
    os.close(parked._plan_w)  # what the supervisor's death does to the pipe
    assert parked.proc.wait(30) == 0
    launcher.close()
    lines = [line for _, line in parked._held]
    assert not any(line.startswith("{") for line in lines)  # it never went past load_plan


POLICY = "version: 1\nname: x\nrules: [{when: [oom], action: resume}]\n"
SCRIPT_SECTION = (
    "script:\n  checkpoints: {glob: 'c/step_*.pt', step_from: name, step_pattern: 'step_(?P<step>\\d+)'}\n"
)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            "relaunch: {park: plan}\n",
            "relaunch.standby: expected true with park: plan (park says where the standby waits), got false",
        ),
        (
            SCRIPT_SECTION + "relaunch: {standby: true, park: plan}\n",
            "relaunch.park: expected imports with a `script:` section (a script that never asks for a launch "
            'plan would train unsupervised in the standby), got "plan"',
        ),
        (
            "relaunch: {standby: true, park: later}\n",
            'relaunch.park: expected one of imports, plan, got "later"',
        ),
        (
            "relaunch: {standby: true, park: plan, park_timeout_seconds: 0}\n",
            "relaunch.park_timeout_seconds: expected a number > 0, got 0",
        ),
        (
            "relaunch: {standby: true, preload: true}\n",
            'relaunch.park: expected plan with preload: true (the standby preloads at its park point), got "imports"',
        ),
    ],
)
def test_park_plan_policy_refusals(extra: str, message: str):
    with pytest.raises(PolicyError) as info:
        parse_policy(POLICY + extra)
    assert message in str(info.value)


def test_park_plan_policy_defaults():
    assert parse_policy(POLICY).relaunch.park == "imports"
    relaunch = parse_policy(POLICY + "relaunch: {standby: true, park: plan}\n").relaunch
    assert (relaunch.park, relaunch.park_timeout_seconds) == ("plan", 300.0)
    assert parse_policy(POLICY + SCRIPT_SECTION + "relaunch: {standby: true}\n").relaunch.park == "imports"
    assert not relaunch.preload
    assert parse_policy(POLICY + "relaunch: {standby: true, park: plan, preload: true}\n").relaunch.preload


def test_the_park_options_are_checked():
    with pytest.raises(Exception, match="relaunch.park: expected one of imports, plan"):
        StandbyOptions(park="model")
    with pytest.raises(Exception, match="relaunch.park_timeout_seconds: expected a number > 0"):
        StandbyOptions(park="plan", park_timeout_seconds=0)
    with pytest.raises(Exception, match="relaunch.preload: needs park: plan"):
        StandbyOptions(preload="/ckpt")
