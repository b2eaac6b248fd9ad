"""A resume through the warm standby is bit-identical to one through a cold start.

The supervisor core (LineageRunner, no Prefect) runs the example; the drill SIGKILLs it at step 22 and the
policy resumes from the checkpoint of step 20. With `relaunch: {standby: true}` the second segment runs in
the process parked while the first one trained; without it, in a fresh one. Final parameters, optimizer state
and every logged loss after the resume point must be equal bit for bit.

With `park: plan` the standby has also run the example up to `Session.attach` (model, data and optimizer
built) before the decision; a wrapper of the example records, per process, when it built and when it
attached, so the test sees that the build came before the segment was launched and was not redone.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from supervisor.orchestrator import LineageRunner, RunOptions, python_command
from tests.flowkit import CHARLM, FAST_POLICY, SMALL, assert_same_state, live_series, load_final_state

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 24
RESUME_STEP = 20


#: The example, with marks: one `{"what": built | attached, "pid", "t"}` line per event in marks.jsonl beside it.
MARKED = f"""\
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("charlm", {CHARLM!r})
charlm = sys.modules["charlm"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(charlm)
MARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "marks.jsonl")
def mark(what):
    with open(MARKS, "a") as f:
        f.write(json.dumps({{"what": what, "pid": os.getpid(), "t": time.time()}}) + "\\n")
build, attach = charlm.build, charlm.Session.attach
def marked_build(*args):
    parts = build(*args)
    mark("built")
    return parts
def marked_attach(**kwargs):
    sess = attach(**kwargs)
    mark("attached")
    return sess
charlm.build, charlm.Session.attach = marked_build, marked_attach
if __name__ == "__main__":
    sys.exit(charlm.main())
"""


#: The marked example, and more marks: each copy a standby preloads (`preloaded:<id>`), each copy a restore took
#: (`took:<id>`, any rank) and the tier each restore through `Tiers` used (`restored:<tier>`). The first segment
#: waits after step 21 (the step-20 checkpoint is committed by then, the kill is at 22) until a standby of each
#: rank holds that checkpoint: the test sees the preload used, not a race.
PRELOAD_MARKED = MARKED.replace(
    'if __name__ == "__main__":',
    """from supervisor.checkpoint import preload, tiers
hold, take, restore, log = preload.Preloader._hold, preload.take, tiers.Tiers.restore, charlm.Session.log
def marked_hold(self, snap):
    hold(self, snap)
    mark("preloaded:" + snap.id)
def marked_take(root, checkpoint_id):
    snap = take(root, checkpoint_id)
    if snap is not None:
        mark("took:" + checkpoint_id)
    return snap
def marked_restore(self, info, *args):
    used = restore(self, info, *args)
    mark("restored:" + used)
    return used
def held(prefix):
    pids = set()
    with open(MARKS) as f:
        for line in f:
            try:  # another process may be appending its line right now
                m = json.loads(line)
            except ValueError:
                continue
            if m["what"].startswith("preloaded:" + prefix):
                pids.add(m["pid"])
    return len(pids) >= int(os.environ.get("WORLD_SIZE", "1"))
def waiting_log(self, **metrics):
    if self.plan.segment == 0 and self.step == 21 and "loss" in metrics:
        deadline = time.time() + 120
        while time.time() < deadline and not held("0000000020-"):
            time.sleep(0.05)
    return log(self, **metrics)
preload.Preloader._hold, preload.take, tiers.Tiers.restore = marked_hold, marked_take, marked_restore
charlm.Session.log = waiting_log
if __name__ == "__main__":""",
)


def supervise(
    workdir: Path, standby: bool, park: str | None = None, marked: bool = False, preload: bool = False
) -> tuple[dict, LineageRunner]:
    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    relaunch = "relaunch: {standby: true, standby_delay_seconds: 0}\n" if standby else ""
    if park:
        relaunch = f"relaunch: {{standby: true, standby_delay_seconds: 0, park: {park}, preload: {str(preload).lower()}}}\n"
    policy.write_text(FAST_POLICY.read_text() + relaunch)
    script = CHARLM
    if marked:  # the marked example, cold and parked alike
        script = str(workdir / "marked_charlm.py")
        Path(script).write_text(PRELOAD_MARKED if preload else MARKED)
    options = RunOptions(
        command=python_command(["python", script, "--steps", str(STEPS), "--eval-every", "20", *SMALL]),
        policy_path=str(policy),
        lineage="standby",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "kill@22"},
        max_segments=4,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise().to_dict()
    return record, runner


def final_state(record: dict, runner: LineageRunner) -> tuple[dict, dict[int, float]]:
    assert [s["outcome"] for s in record["segments"]][-1] == "finished"
    second = record["segments"][1]
    assert second["restore"]["checkpoint_id"].startswith(f"{RESUME_STEP:010d}-")
    result = {"tracking_uri": record["mlflow"]["tracking_uri"], "mlflow_run_id": record["mlflow"]["run_id"]}
    state = load_final_state(runner.layout.checkpoints, record["final_checkpoint"], STEPS, SMALL)
    return state, live_series(result, "loss")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, LineageRunner, list[logging.LogRecord]]:
    """The plain example's cold lineage, the reference of the first and the preloading test: supervised once
    per module. With every log record it produced, the launcher's at INFO (as caplog would hold them)."""
    launcher, root = logging.getLogger("rollback_supervisor.launcher"), logging.getLogger()
    level, handler = launcher.level, _Records()
    launcher.setLevel(logging.INFO)
    root.addHandler(handler)
    try:
        record, runner = supervise(tmp_path_factory.mktemp("standby-cold") / "cold", standby=False)
    finally:
        root.removeHandler(handler)
        launcher.setLevel(level)
    return record, runner, handler.records


def test_a_resume_through_the_standby_is_bit_identical_to_a_cold_one(tmp_path: Path, caplog, cold):
    cold_record, cold_runner, cold_records = cold
    # No launcher line about a standby (the lineage itself is called "standby": other loggers may say so).
    assert [r for r in cold_records if r.name.endswith(".launcher")]  # the records were collected at all
    assert not [r for r in cold_records if r.name.endswith(".launcher") and "standby" in r.getMessage()]
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    warm_record, warm_runner = supervise(tmp_path / "warm", standby=True)

    used = [int(pid) for pid in re.findall(r"segment starts in standby pid (\d+)", caplog.text)]
    second = warm_record["segments"][1]
    assert second["returncode"] == 0 and used == [second["pid"]]  # the resumed segment ran in the standby
    assert warm_record["segments"][0]["returncode"] == -9
    target = second["restore"]["checkpoint_id"]  # read ahead into the page cache while the segment started
    assert re.search(rf"page-cache warm-up of checkpoint {target}: [1-9]\d* files", caplog.text)
    assert re.search(r"standby pid \d+ discarded: the supervisor is closing", caplog.text)  # none left behind

    cold, cold_losses = final_state(cold_record, cold_runner)
    warm, warm_losses = final_state(warm_record, warm_runner)
    assert_same_state(cold, warm)
    resumed = range(RESUME_STEP + 1, STEPS + 1)
    assert [warm_losses[s] for s in resumed] == [cold_losses[s] for s in resumed]


def marks(workdir: Path) -> dict[int, dict[str, list[float]]]:
    """pid -> {what: [times]} from the marked example's marks.jsonl."""
    out: dict[int, dict[str, list[float]]] = {}
    for line in (workdir / "marks.jsonl").read_text().splitlines():
        m = json.loads(line)
        out.setdefault(m["pid"], {}).setdefault(m["what"], []).append(m["t"])
    return out


def test_a_resume_through_a_standby_parked_at_its_plan_is_bit_identical_and_built_beforehand(
    tmp_path: Path, caplog
):
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    cold_record, cold_runner = supervise(tmp_path / "cold", standby=False, marked=True)
    parked_record, parked_runner = supervise(tmp_path / "parked", standby=True, park="plan", marked=True)

    used = [int(pid) for pid in re.findall(r"segment starts in standby pid (\d+)", caplog.text)]
    first, second = parked_record["segments"][0], parked_record["segments"][1]
    assert first["returncode"] == -9 and second["returncode"] == 0 and used == [second["pid"]]
    assert "the script up to its plan took" in caplog.text
    seen = marks(tmp_path / "parked")
    resumed = seen[second["pid"]]
    # Built once, before the segment was launched (while the first one trained), attached after the launch.
    assert len(resumed["built"]) == 1 and len(resumed["attached"]) == 1
    assert resumed["built"][0] < second["started"] <= resumed["attached"][0]
    assert resumed["built"][0] < first["ended"]
    assert re.search(r"standby pid \d+ discarded: the supervisor is closing", caplog.text)  # none left behind

    cold, cold_losses = final_state(cold_record, cold_runner)
    parked, parked_losses = final_state(parked_record, parked_runner)
    assert_same_state(cold, parked)
    steps = range(RESUME_STEP + 1, STEPS + 1)
    assert [parked_losses[s] for s in steps] == [cold_losses[s] for s in steps]


def test_a_resume_through_a_preloading_standby_restores_from_memory_and_is_bit_identical(
    tmp_path: Path, caplog, cold
):
    cold_record, cold_runner, _ = cold
    caplog.set_level(logging.INFO, "rollback_supervisor.launcher")
    warm_record, warm_runner = supervise(
        tmp_path / "preloaded", standby=True, park="plan", marked=True, preload=True
    )
    first, second = warm_record["segments"][0], warm_record["segments"][1]
    assert first["returncode"] == -9 and second["returncode"] == 0
    assert [int(p) for p in re.findall(r"segment starts in standby pid (\d+)", caplog.text)] == [
        second["pid"]
    ]
    target = second["restore"]["checkpoint_id"]
    seen = marks(tmp_path / "preloaded")[second["pid"]]
    assert f"preloaded:{target}" in seen  # read while the first segment trained, in the process that resumed
    assert seen["preloaded:" + target][0] < first["ended"]
    assert "restored:preloaded" in seen and "restored:local" not in seen  # no disk read for the restore
    assert f"took:{target}" in seen

    cold, cold_losses = final_state(cold_record, cold_runner)
    warm, warm_losses = final_state(warm_record, warm_runner)
    assert_same_state(cold, warm)
    steps = range(RESUME_STEP + 1, STEPS + 1)
    assert [warm_losses[s] for s in steps] == [cold_losses[s] for s in steps]
