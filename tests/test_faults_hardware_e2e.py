"""The hardware drill on real training processes (issue 28): the example under a launch plan with a metric spool,
without the supervisor (its segments are started here), so each run costs a process start and a few steps.

- `slow@3:rank1` under torchrun (2 gloo ranks) becomes a `straggler` event naming rank 1 and its host, reported
  by rank 0 from the per-step agreement that carries every rank's step time.
- `sdc@4` makes step 5's logged loss differ from the replay of the same steps after the in-process rollback (a
  replay equals an uninterrupted run: resumes are bit-identical); `sdc_persistent@4` gives the same wrong value,
  bit for bit, on every run of step 4: the in-process replay and a relaunched process.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor import exitcodes
from supervisor.spool import SpoolReader
from tests.segmentkit import segment_env

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "0" * 32  # the spool names the run; the training process never opens MLflow
EXAMPLE = ["--size", "tiny", "--batch-size", "4", "--eval-every", "1000", "--threads", "1"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]

STRAGGLER_POLICY = """\
version: 1
name: straggler
checkpoint: {every_steps: 2, keep_last: 2, storage: ./checkpoints}
monitor:
  detectors:
    - {type: straggler, factor: 2.5, patience: 3, min_gap_seconds: 0.1}
rules:
  - when: [straggler]
    action: resume
    target: {select: latest}
"""
#: A wrong loss (non-finite or huge) rolls back in process to the checkpoint of step 3, once.
SDC_POLICY = """\
version: 1
name: sdc
checkpoint: {every_steps: 3, keep_last: 3, async: true, storage: ./checkpoints}
monitor:
  detectors:
    - {type: non_finite, metrics: [loss]}
    - {type: threshold, metric: loss, above: 100}
rules:
  - when: [non_finite, threshold]
    action: rollback
    target: {select: latest}
limits: {max_rollbacks: 1}
"""


def segment(
    workdir: Path, faults: str, policy: str, steps: int, *, ranks: int = 1
) -> subprocess.CompletedProcess:
    """The next segment of the lineage in `workdir`: the example for `steps` steps under the drill `faults`."""
    env = segment_env(workdir, RUN_ID, f"sqlite:///{workdir / 'unused.db'}", faults)
    (workdir / "policy.yaml").write_text(policy)
    env["OMP_NUM_THREADS"] = "1"
    head = TORCHRUN if ranks > 1 else [sys.executable]
    return subprocess.run(
        [*head, "examples/charlm.py", *EXAMPLE, "--steps", str(steps)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def losses(workdir: Path, segment: int) -> list[tuple[int, float]]:
    points, _ = SpoolReader(workdir / "metrics" / f"{segment}.jsonl").pending(limit=100_000)
    return [(step, value) for key, value, _, step in points if key == "loss"]


def bits(value: float) -> bytes:
    return struct.pack("<d", value)


@pytest.mark.e2e
@pytest.mark.slow
def test_a_slow_rank_becomes_a_straggler_event_naming_it_and_its_host(tmp_path: Path):
    # 0.6 s a step against the ~0.03 s of a step of the tiny example: 2.5 x holds on a loaded machine too
    proc = segment(tmp_path, "slow@3:rank1:0.6s", STRAGGLER_POLICY, 20, ranks=2)
    assert "injecting slow@3:rank1:0.6s on rank 1" in proc.stderr
    reports = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert len(reports) == 1, reports
    event = reports[0]["event"]
    assert event["type"] == "straggler" and event["source"] == "in_process"
    evidence = event["evidence"]
    assert evidence["rank"] == 1 and evidence["host"] == socket.gethostname()
    assert evidence["step_s"] >= 0.6 and evidence["step_s"] >= 2.5 * evidence["median_s"]
    assert event["onset_step"] == 3 and event["step"] == 5  # three slow steps in a row: patience 3
    assert reports[0]["decision"]["action"] == "resume" and not reports[0]["handled_in_process"]
    assert proc.returncode != 0  # every rank stopped (exit 76) for the supervisor to relaunch
    # Every rank's step times reached the spool too (for the plot and the supervisor's own monitor).
    points, _ = SpoolReader(tmp_path / "metrics" / "0.jsonl").pending(limit=100_000)
    slowest = {step: value for key, value, _, step in points if key == "ranks/slowest_rank"}
    assert [slowest[s] for s in (3, 4, 5)] == [1.0, 1.0, 1.0]


@pytest.mark.e2e
def test_sdc_changes_the_logged_value_and_a_replay_does_not_reproduce_it(tmp_path: Path):
    proc = segment(tmp_path, "sdc@4", SDC_POLICY, 6)
    assert proc.returncode == exitcodes.EXIT_OK, proc.stderr[-3000:]
    assert "injecting sdc@4 on rank 0" in proc.stderr
    # Step 5 ran twice: with the flipped element, then replayed from the checkpoint of step 3 without it.
    runs = [value for step, value in losses(tmp_path, 0) if step == 5]
    assert len(runs) == 2, losses(tmp_path, 0)
    faulty, replayed = runs
    assert bits(faulty) != bits(replayed)
    assert not math.isfinite(faulty) or faulty > 100
    assert math.isfinite(replayed) and replayed < 100


@pytest.mark.e2e
def test_sdc_persistent_gives_the_same_wrong_value_on_every_run_of_its_rank_relaunches_included(
    tmp_path: Path,
):
    first = segment(tmp_path, "sdc_persistent@4", SDC_POLICY, 6)
    assert first.returncode == exitcodes.EXIT_ANOMALY, first.stderr[-3000:]  # it came back: max_rollbacks
    relaunch = segment(tmp_path, "sdc_persistent@4", SDC_POLICY, 6)
    assert relaunch.returncode == exitcodes.EXIT_ANOMALY, relaunch.stderr[-3000:]
    assert relaunch.stderr.count("injecting sdc_persistent@4 on rank 0") == 2  # the relaunch, then its replay
    step5 = [value for segment in (0, 1) for step, value in losses(tmp_path, segment) if step == 5]
    assert len(step5) == 4 and len({bits(v) for v in step5}) == 1, step5
    fired = tmp_path / "faults-fired.json"
    assert "sdc_persistent" not in (fired.read_text() if fired.exists() else "")  # never recorded as fired
    step4 = {bits(value) for segment in (0, 1) for step, value in losses(tmp_path, segment) if step == 4}
    assert len(step4) == 1  # the same state before the flip every time: only the flip makes step 5 wrong
