"""`rollback-supervisor status` over a hand-built lineage record and a checkpoint store where the default
storage puts it (`<workdir>/checkpoints/<lineage>`); test_status_real_run.py reads what a real run wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policies.schema import CheckpointConfig
from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.checkpoint.options import CheckpointInfo
from supervisor.cli import main
from supervisor.commands.status import DEFAULT_STORAGE, in_process_reason, segment_steps
from supervisor.report import report_tags
from supervisor.state import TrainingState
from tests.test_report_timeline import CKPT, FINAL, lineage_record

EXE = Path(sys.executable).with_name("rollback-supervisor")


def _store(directory: Path) -> list[str]:
    """Save along the sample lineage's story (every 100 steps, rollbacks abandoning later commits)."""
    torch.manual_seed(0)
    state = TrainingState()
    model = state.register("model", torch.nn.Linear(4, 2))
    options = CheckpointOptions(directory=directory, async_save=False, memory_slots=0)
    with CheckpointManager(options, state) as manager:

        def save(step):
            with torch.no_grad():
                model.weight.add_(0.01)
            return manager.save(step, metrics={"loss": 3.0 - step / 300, "val_loss": 3.1 - step / 300}).id

        ids = [save(100)]
        manager.abandon_after(ids[0])  # the in-process NaN rollback to 100
        ids += [save(200), save(300), save(400)]
        manager.abandon_after(ids[1])  # the spike: roll back to 200
        ids += [save(300), save(400), save(500), save(600)]
    return ids


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    wd = tmp_path / "wd"
    demo = wd / "lineages" / "charlm-demo"
    demo.mkdir(parents=True)
    ids = _store(wd / "checkpoints" / "charlm-demo")  # the default storage's place; the record has no storage
    assert [ids[i] for i in (0, 1, 5, 6, 7)] == [CKPT[100], CKPT[200], CKPT[400], CKPT[500], FINAL]
    (demo / "lineage.json").write_text(json.dumps(lineage_record(), indent=2))
    fresh = wd / "lineages" / "fresh"
    fresh.mkdir(parents=True)
    record = {
        "version": 1,
        "lineage": "fresh",
        "status": "running",
        "segments": [{"index": 0, "pid": 7, "started": 1.0}],
    }
    (fresh / "lineage.json").write_text(json.dumps(record))
    return wd


def _json(capsys, *args: str) -> dict:
    assert main(["status", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))


def test_json_lists_every_lineage_with_segments_timeline_and_checkpoints(workdir, capsys):
    doc = _json(capsys, "--workdir", str(workdir))
    demo, fresh = doc["lineages"]
    assert (demo["lineage"], fresh["lineage"]) == ("charlm-demo", "fresh")
    assert demo["status"] == "finished" and demo["final_checkpoint"] == FINAL
    assert demo["final_reason"] == "training finished at step 600"
    assert (demo["rollbacks"], demo["restarts"]) == (2, 4)
    assert [s["outcome"] for s in demo["segments"]] == ["rollback", "resume", "resume", "finished"]
    assert [(r["event"], r["action"], r["target_step"]) for r in demo["timeline"]] == [
        ("non_finite", "rollback", 100),
        ("spike", "rollback", 200),
        ("unknown_exit", "resume", 400),
        ("hardware_fault", "resume", 500),
    ]
    assert demo["timeline"][0]["value"] == "NaN"
    ckpts = demo["checkpoints"]
    assert [(c["step"], c["abandoned"]) for c in ckpts] == [
        (100, False),
        (200, False),
        (300, True),
        (400, True),
        (300, False),
        (400, False),
        (500, False),
        (600, False),
    ]
    assert ckpts[-1]["id"] == FINAL and ckpts[-1]["parent_id"] == CKPT[500]
    assert ckpts[0]["metrics"] == pytest.approx({"loss": 3.0 - 1 / 3, "val_loss": 3.1 - 1 / 3})
    assert fresh["status"] == "running" and fresh["checkpoints"] == [] and fresh["timeline"] == []


def test_json_agrees_with_the_mlflow_tags(workdir, capsys):
    demo = _json(capsys, "--workdir", str(workdir), "--lineage", "charlm-demo")["lineages"][0]
    tags = report_tags(lineage_record())
    assert tags["rollback.status"] == demo["status"]
    assert tags["rollback.final_checkpoint"] == demo["final_checkpoint"]
    assert tags["rollback.final_reason"] == demo["final_reason"]
    assert (tags["rollback.rollbacks"], tags["rollback.restarts"]) == (
        str(demo["rollbacks"]),
        str(demo["restarts"]),
    )
    assert sum(k.startswith("rollback.decision.") for k in tags) == len(demo["timeline"])


def test_human_output_shows_tables_for_each_lineage(workdir, capsys):
    assert main(["status", "--workdir", str(workdir)]) == 0
    out = capsys.readouterr().out
    assert "charlm-demo: finished, 4 segment(s), 2 rollback(s) (1 in process), 4 restart(s)" in out
    assert "fresh: running, 1 segment(s)" in out
    for text in ("segments", "events and decisions", "checkpoints", "hardware_fault", "Xid 79", "no events"):
        assert text in out, text
    assert out.count("abandoned") == 2
    assert "no checkpoints" in out
    rows = {line.lstrip("│ ")[:17]: line for line in out.splitlines() if line.lstrip("│ ")[:10].isdigit()}
    assert "live" in rows[FINAL] and "final" in rows[FINAL]
    assert "rollback target (#1)" in rows[CKPT[200]]


def test_lineage_filter_and_its_errors(workdir, capsys):
    assert [
        x["lineage"] for x in _json(capsys, "--workdir", str(workdir), "--lineage", "fresh")["lineages"]
    ] == ["fresh"]
    assert main(["status", "--workdir", str(workdir), "--lineage", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--lineage nope" in err and "expected one of: charlm-demo, fresh" in err


@pytest.mark.parametrize(
    ("make", "args", "code", "message"),
    [
        (lambda tmp: None, ["--workdir", "{tmp}/missing"], 2, "--workdir {tmp}/missing: no such directory"),
        (lambda tmp: tmp.mkdir(exist_ok=True), ["--workdir", "{tmp}"], 0, "no lineages under {tmp}/lineages"),
        (
            lambda tmp: (
                (tmp / "lineages" / "bad").mkdir(parents=True)
                or (tmp / "lineages" / "bad" / "lineage.json").write_text("{not json")
            ),
            ["--workdir", "{tmp}"],
            2,
            "lineage record {tmp}/lineages/bad/lineage.json is not valid JSON",
        ),
        (
            lambda tmp: tmp.mkdir(exist_ok=True),
            ["--workdir", "{tmp}", "stray"],
            2,
            "unexpected argument(s) stray",
        ),
    ],
    ids=["missing-workdir", "empty-workdir", "corrupt-record", "stray-argument"],
)
def test_workdir_problems(tmp_path, capsys, make, args, code, message):
    make(tmp_path)
    assert main(["status", *(a.format(tmp=tmp_path) for a in args)]) == code
    captured = capsys.readouterr()
    assert message.format(tmp=tmp_path) in (captured.err if code else captured.out)


@pytest.mark.e2e
@pytest.mark.slow
def test_console_script_prints_json(workdir):
    out = subprocess.run(
        [str(EXE), "status", "--workdir", str(workdir), "--json"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert [x["lineage"] for x in json.loads(out.stdout)["lineages"]] == ["charlm-demo", "fresh"]
    missing = subprocess.run(
        [str(EXE), "status", "--workdir", str(workdir / "nope")], capture_output=True, text=True
    )
    assert (
        missing.returncode == 2 and "error: --workdir" in missing.stderr and "Traceback" not in missing.stderr
    )


def test_in_process_rows_say_in_process_and_relaunches_keep_their_delay(workdir, capsys):
    rows = _json(capsys, "--workdir", str(workdir), "--lineage", "charlm-demo")["lineages"][0]["timeline"]
    for row in rows:
        assert ("in process" in row["reason"]) == row["in_process"], row["reason"]


@pytest.mark.parametrize(
    ("reason", "shown"),
    [
        (
            "rules[0]: roll back; skip 300 batches, lr x0.5, relaunch in 0.7 s; budgets left: 4 of 5",
            "rules[0]: roll back; skip 300 batches, lr x0.5, continued in process, no relaunch; budgets left: 4 of 5",
        ),
        ("fake in-process rollback", "fake in-process rollback; handled in process"),
    ],
)
def test_in_process_reason(reason, shown):
    assert in_process_reason(reason) == shown


def _info(step: int, seq: int, wall_time: float, abandoned: bool = False) -> CheckpointInfo:
    return CheckpointInfo(
        id=f"{step:010d}-{seq:06d}", step=step, wall_time=wall_time, seq=seq, abandoned=abandoned
    )


#: A store along one lineage: 100 and 120 before the segment (started at t=10), 140 during it (t=12).
INFOS = [_info(100, 1, 5.0), _info(120, 2, 6.0), _info(140, 3, 12.0)]


def _seg(**kw) -> dict:
    # start_step / last_step are the heartbeat's steps at launch and at exit, as the orchestrator records them
    return {"index": 1, "started": 10.0, "ended": 20.0, "start_step": 90, "last_step": 137, **kw}


@pytest.mark.parametrize(
    ("seg", "spool", "steps"),
    [
        # killed at 150: the heartbeat said 137, the spool logged 150
        (_seg(restore={"checkpoint_id": "0000000100-000001"}), (19.0, 150), (100, 150)),
        # no spool: the checkpoint it saved (140) beats the lagging heartbeat
        (_seg(restore={"checkpoint_id": "0000000100-000001"}), None, (100, 140)),
        # a checkpoint retention deleted: its id still names its step
        (_seg(restore={"checkpoint_id": "0000000080-000009"}, last_step=85), None, (80, 140)),
        # the heartbeat file is the lineage's: unchanged since launch means this segment never beat
        (_seg(restore={"checkpoint_id": "0000000100-000001"}, start_step=137, ended=11.0), None, (100, 100)),
        (_seg(restore={"from_scratch": True}, ended=11.0, last_step=5), None, (0, 5)),
        # "the newest valid" at launch: the newest checkpoint saved before the segment started
        (_seg(restore={}, ended=11.0, last_step=None), None, (120, 120)),
        (_seg(restore={}, index=0, started=1.0, ended=2.0, last_step=None), None, (0, 0)),
        # the anomaly that ended it was seen at step 152
        (
            _seg(restore={"checkpoint_id": "0000000100-000001"}, event={"step": 152, "wall_time": 19.5}),
            (19.0, 150),
            (100, 152),
        ),
        # an in-process rollback at step 160 went back to 140 at t=14; after it the spool logged 150, and the
        # heartbeat (158) may predate the rollback
        (
            _seg(
                restore={"checkpoint_id": "0000000100-000001"},
                last_step=158,
                in_process=[
                    {
                        "time": 14.0,
                        "event": {"step": 160},
                        "decision": {"action": "rollback", "target_step": 140},
                    }
                ],
            ),
            (19.0, 150),
            (100, 150),
        ),
        # ... but a beat past the anomaly's step is on the new branch
        (
            _seg(
                restore={"checkpoint_id": "0000000100-000001"},
                last_step=171,
                in_process=[
                    {
                        "time": 14.0,
                        "event": {"step": 160},
                        "decision": {"action": "rollback", "target_step": 140},
                    }
                ],
            ),
            (19.0, 150),
            (100, 171),
        ),
    ],
)
def test_segment_steps_come_from_the_record_checkpoints_and_spool(seg, spool, steps):
    assert segment_steps(seg, INFOS, spool) == steps


def test_the_default_storage_is_the_schemas():
    assert CheckpointConfig().storage == DEFAULT_STORAGE


def _record(lineage: str, **extra) -> dict:
    return {"version": 1, "lineage": lineage, "status": "finished", "segments": [], **extra}


def _small_store(directory: Path) -> str:
    state = TrainingState()
    state.register("model", torch.nn.Linear(2, 2))
    with CheckpointManager(
        CheckpointOptions(directory=directory, async_save=False, memory_slots=0), state
    ) as m:
        return m.save(10).id


@pytest.mark.parametrize("where", ["recorded-outside-the-workdir", "workdir-moved", "no-storage-key"])
def test_status_finds_the_store_wherever_the_policy_put_it(tmp_path, capsys, where):
    wd = tmp_path / "wd"
    (wd / "lineages" / "x").mkdir(parents=True)
    if where == "recorded-outside-the-workdir":  # storage: /abs/elsewhere
        store = tmp_path / "elsewhere" / "x"
        storage = {"checkpoints": str(store), "remote": None, "durable": str(wd / "lineages" / "x")}
    elif where == "workdir-moved":  # storage: ./ckpts, recorded when the workdir was /old/wd
        store = wd / "ckpts" / "x"
        storage = {"checkpoints": "/old/wd/ckpts/x", "remote": None, "durable": "/old/wd/lineages/x"}
    else:
        store, storage = wd / "checkpoints" / "x", None
    ckpt = _small_store(store)
    record = _record("x", **({"storage": storage} if storage else {}))
    (wd / "lineages" / "x" / "lineage.json").write_text(json.dumps(record))
    view = _json(capsys, "--workdir", str(wd))["lineages"][0]
    assert [c["id"] for c in view["checkpoints"]] == [ckpt]
    assert view["checkpoint_store"] == str(store.resolve())


BINARY = bytes(range(256)) * 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (BINARY, "is not valid JSON (UnicodeDecodeError"),
        (b"\x89PNG\r\n\x1a\n" + BINARY, "is not valid JSON"),
        (b'{"lineage": "x", "segments": [', "is not valid JSON (JSONDecodeError"),
        (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON (RecursionError"),
        (b"[1, 2]", "is not a lineage record: expected a JSON object, found a list"),
        (b'{"segments": 5}', "is not a lineage record: key 'segments': found a number"),
        (b'{"segments": [{"in_process": [1]}]}', "segments[0].in_process[0]: expected an object"),
        (b'{"segments": [{"restore": "latest"}]}', "segments[0].restore: found a string"),
        (b'{"segments": [{"started": true}]}', "segments[0].started: found a boolean"),
    ],
    ids=[
        "binary",
        "png",
        "truncated",
        "deep",
        "list",
        "segments-number",
        "in-process-item",
        "restore",
        "bool",
    ],
)
def test_an_invalid_lineage_record_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "lineages" / "bad" / "lineage.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    assert main(["status", "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: lineage record {path} ") and message in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "directory"])
def test_a_lineage_record_that_is_no_file_does_not_hang(tmp_path, capsys, make):
    path = tmp_path / "lineages" / "bad" / "lineage.json"
    path.parent.mkdir(parents=True)
    make(path)  # a FIFO with no writer: reading it would wait forever
    assert main(["status", "--workdir", str(tmp_path)]) == 2
    assert f"lineage record {path} is not a regular file" in capsys.readouterr().err


@pytest.mark.e2e
def test_console_script_on_a_binary_record_prints_one_line(tmp_path):
    path = tmp_path / "lineages" / "bad" / "lineage.json"
    path.parent.mkdir(parents=True)
    path.write_bytes(BINARY)
    out = subprocess.run(
        [str(EXE), "status", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith(f"error: lineage record {path} is not valid JSON")
