"""A stuck rank under the supervisor: two gloo ranks under torchrun, rank 1 stuck before the step's agreement
all_reduce (`stuck@4:rank1`) while rank 0 waits inside it. The hang detector fires, and before the segment is
stopped the record holds both ranks' stacks, rank 0's inside torch.distributed; `status` says where each was.

Short on purpose (issue 30): a tiny model, a 4 s hang limit (12 s for start-up: 3 s here unloaded), and a
policy that stops on a hang (no relaunch).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from supervisor.cli import main
from supervisor.launcher import TorchrunLauncher, TorchrunOptions
from supervisor.orchestrator import LineageRunner, RunOptions
from tests.flowkit import CHARLM

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POLICY = """\
version: 1
name: hang-stacks
checkpoint: {every_steps: 100, keep_last: 1, async: false, storage: ./checkpoints}
monitor:
  poll_seconds: 0.25
  detectors:
    - {type: hang, seconds: 4}
rules:
  - when: [hang]
    action: stop
"""


def test_a_stuck_rank_gives_a_hang_event_holding_both_ranks_stacks(tmp_path: Path, capsys):
    policy = tmp_path / "hang.yaml"
    policy.write_text(POLICY)
    command = (CHARLM, "--steps", "40", "--batch-size", "4", "--eval-every", "100", "--threads", "1")
    options = RunOptions(
        command=command,
        policy_path=str(policy),
        lineage="stuck",
        workdir=tmp_path / "work",
        stop_grace_seconds=2,
        env={"OMP_NUM_THREADS": "1", "ROLLBACK_SUPERVISOR_FAULTS": "stuck@4:rank1"},
        launcher=TorchrunLauncher(TorchrunOptions(nproc_per_node=2)),
        max_segments=1,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        rec = runner.supervise().to_dict()

    (seg,) = rec["segments"]
    assert seg["event"]["type"] == "hang", seg["event"]
    stacks = seg["stacks"]
    host = socket.gethostname()
    assert stacks["missing"] == [] and [(r["rank"], r["host"]) for r in stacks["ranks"]] == [
        (0, host),
        (1, host),
    ]
    assert len({r["pid"] for r in stacks["ranks"]}) == 2
    assert stacks["seconds"] < 5.0
    waiting, stuck = stacks["ranks"]
    # Rank 0 waits inside the agreement's all_reduce; rank 1 sleeps in the drill's fault, outside any collective.
    main_frames = {r["rank"]: _main_frames(r) for r in stacks["ranks"]}
    assert any("torch/distributed/" in f["file"] for f in main_frames[0]), main_frames[0]
    assert not any("torch/distributed/" in f["file"] for f in main_frames[1]), main_frames[1]
    assert waiting["where"].startswith("torch/distributed/"), waiting["where"]
    assert stuck["where"].startswith("supervisor/runtime/faults.py:") or stuck["where"].startswith(
        "faults.py:"
    )
    # The event says where each rank was in one line, as the record's summary does.
    assert seg["event"]["evidence"]["stacks"] == stacks["summary"]
    assert stacks["summary"] == f"rank 0: {waiting['where']}; rank 1: {stuck['where']}"

    workdir = str(tmp_path / "work")
    assert main(["status", "--workdir", workdir, "--json"]) == 0
    (lineage,) = json.loads(capsys.readouterr().out)["lineages"]
    assert lineage["hangs"] == [
        {
            "segment": 0,
            "summary": stacks["summary"],
            "where": {"0": waiting["where"], "1": stuck["where"]},
            "missing": [],
            "nccl_traces": [],
        }
    ]
    assert main(["status", "--workdir", workdir, "--width", "160"]) == 0
    text = capsys.readouterr().out
    assert f"rank 0: {waiting['where']}" in text and f"rank 1: {stuck['where']}" in text


def _main_frames(rank: dict) -> list[dict]:
    threads = rank["threads"]
    main = [t for t in threads if t["thread_id"] == rank["main_thread"]]
    return (main or threads[-1:])[0]["frames"]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
