"""`rollback-supervisor drill` end to end: the real flow, the example, injected faults, the verdict table."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from supervisor.cli import main
from tests.flowkit import CHARLM, FAST_POLICY, SMALL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _table_rows(out: str) -> dict[str, list[str]]:
    """The drill's rich table, fault key -> its cells."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│┃|]", line) if c.strip()]
        if cells and re.fullmatch(r"[a-z]+@\d+(:rank\d+)?", cells[0]):
            rows[cells[0]] = cells
    return rows


def _lineage_record(workdir: Path) -> dict:
    (path,) = (workdir / "lineages").glob("drill-*/lineage.json")
    return json.loads(path.read_text())


def test_drill_passes_each_fault_of_a_mix_on_the_example(prefect_harness, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    argv = [
        "drill",
        "--policy",
        str(FAST_POLICY),
        "--faults",
        "nan@45,kill@55,hw@65",
        "--workdir",
        str(tmp_path),
        "--stop-grace",
        "10",
        "--",
        "python",
        CHARLM,
        "--steps",
        "75",
        "--eval-every",
        "20",
        *SMALL,
    ]
    code = main(argv)
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert set(rows) == {"nan@45", "kill@55", "hw@65"}, out
    assert rows["nan@45"][1:4] == ["non_finite", "non_finite", "rollback"], out
    assert rows["kill@55"][1:4] == ["unknown_exit", "unknown_exit", "resume"], out
    assert rows["hw@65"][1:4] == ["hardware_fault", "hardware_fault", "resume"], out
    assert all(r[-1] == "PASS" for r in rows.values()), out
    assert "run finished" in out
    assert code == 0

    # The drill drove a real lineage: the NaN was rolled back in process, the kill and the Xid line each
    # cost one relaunch, and the run trained to its last step.
    rec = _lineage_record(tmp_path)
    assert rec["status"] == "finished"
    assert [s["outcome"] for s in rec["segments"]] == ["resume", "resume", "finished"]
    assert rec["segments"][0]["in_process"][0]["event"]["type"] == "non_finite"


def test_drill_fails_a_script_that_never_lets_faults_fire(prefect_harness, tmp_path, capsys, monkeypatch):
    # A training script that does not use the training-side API: the faults are never injected, so nothing
    # is detected or recovered, and the drill must say so with exit code 1.
    monkeypatch.setenv("COLUMNS", "200")
    script = tmp_path / "plain.py"
    script.write_text("for step in range(1, 51):\n    print('step', step, flush=True)\n")
    argv = [
        "drill",
        "--policy",
        str(FAST_POLICY),
        "--faults",
        "spike@10,term@20",
        "--workdir",
        str(tmp_path / "w"),
        "--",
        sys.executable,
        str(script),
    ]
    code = main(argv)
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert set(rows) == {"spike@10", "term@20"}, out
    assert rows["spike@10"][1:3] == ["spike", "-"], out
    assert rows["term@20"][1:3] == ["preemption", "-"], out
    assert all(r[-1] == "FAIL" for r in rows.values()), out
    assert code == 1


def test_drill_without_a_command_is_a_usage_error(tmp_path, capsys):
    assert main(["drill", "--policy", str(FAST_POLICY), "--workdir", str(tmp_path)]) == 2
    assert "expected the training command after `--`" in capsys.readouterr().err
