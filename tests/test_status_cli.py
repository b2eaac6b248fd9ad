"""`rollback-supervisor status` over a hand-built lineage record and a real checkpoint store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.cli import main
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
    ids = _store(demo / "checkpoints")
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
            "{tmp}/lineages/bad/lineage.json: cannot read the lineage record",
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
