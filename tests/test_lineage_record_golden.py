"""lineage.json files written by the code before the split (f1e52c9): read and written back exactly, and resumed."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from supervisor.lineage import LineageRecord
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.flowkit import FAST_POLICY

GOLDEN = Path(__file__).parent / "data" / "lineage"
#: A lineage that resumed once and finished; one whose supervisor was interrupted mid-segment (SIGTERM).
FILES = ["v1-lineage.json", "v1-interrupted-lineage.json"]


@pytest.mark.parametrize("name", FILES)
def test_an_old_record_round_trips_exactly(name: str):
    data = json.loads((GOLDEN / name).read_text())
    assert LineageRecord.from_dict(data).to_dict() == data


@pytest.mark.parametrize("name", FILES)
def test_the_runner_resumes_an_old_record_and_keeps_what_it_wrote(tmp_path: Path, name: str):
    old = json.loads((GOLDEN / name).read_text())
    lineage_dir = tmp_path / "wd" / "lineages" / "t"
    lineage_dir.mkdir(parents=True)
    shutil.copy(GOLDEN / name, lineage_dir / "lineage.json")
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        FAST_POLICY.read_text().replace(
            "target: {select: latest}", "target: {select: latest}\n    allow_scratch: true"
        )
    )
    options = RunOptions(
        command=(sys.executable, "-c", "pass"),
        policy_path=str(policy),
        lineage="t",
        workdir=tmp_path / "wd",
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",  # not the recorded one, which is gone
        stop_grace_seconds=5,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise()
    assert (record.status, record.final_reason) == ("finished", "training finished")
    new = json.loads((lineage_dir / "lineage.json").read_text())
    assert set(old) <= set(new)  # no key of the old format lost
    for before, after in zip(old["segments"], new["segments"], strict=False):
        # The old segments as they were; an interrupted one gets the decision the resume took about it.
        decided = (
            {"decision"} if before["outcome"] == "interrupted" and before.get("decision") is None else set()
        )
        assert {k: v for k, v in after.items() if k not in decided} == {
            k: v for k, v in before.items() if k not in decided
        }
        assert all(after[k]["action"] == "resume" for k in decided)
    assert len(new["segments"]) == len(old["segments"]) + 1 and new["segments"][-1]["outcome"] == "finished"
    assert set(new["segments"][-1]) == set(old["segments"][0])  # a new segment has the old keys, no others
    assert new["history"]["entries"][: len(old["history"]["entries"])] == old["history"]["entries"]
    assert LineageRecord.from_dict(new).to_dict() == new
