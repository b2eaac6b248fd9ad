"""Replay on real training processes (issue 28, item 1): examples/charlm.py under a launch plan and a metric spool,
without the supervisor, with `monitor.replay` on. Each run costs a process start and a few steps.

- `sdc@4` (a bit flipped once) makes step 5's loss wrong; the replay from the snapshot of step 4 computes it
  right: `hardware_fault` with evidence `replay_mismatch`, no rollback of the policy's, no data skipped, and
  the run ends bit-identical to one that never had the fault.
- `sdc_persistent@4` (a device wrong every time) gives the same wrong loss in the replay:
  `reproducible_on_same_device`, and the policy's rule (rollback, skip) applies.
- Under torchrun, `sdc@4:rank1` is seen on rank 1 (every rank's detectors watch its own values), every rank
  replays, and the verdict names rank 1.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

import pytest

from supervisor import exitcodes
from supervisor.spool import SpoolReader
from tests.test_faults_hardware_e2e import segment

pytestmark = [pytest.mark.e2e]

STEPS = 8

POLICY = """\
version: 1
name: replay
checkpoint: {every_steps: 2, keep_last: 4, memory_slots: 3, storage: ./checkpoints}
monitor:
  detectors:
    - {type: non_finite, metrics: [loss]}
    - {type: threshold, metric: loss, above: 100}
  replay: {enabled: true, max_steps: 4, when: [non_finite, threshold]}
rules:
  - when: [non_finite, threshold]
    action: rollback
    target: {select: latest}
    skip_batches: 2
limits: {max_rollbacks: 1}
"""


def run(
    workdir: Path, faults: str, *, ranks: int = 1, exit_code: int = exitcodes.EXIT_OK
) -> subprocess.CompletedProcess:
    proc = segment(workdir, faults, POLICY, STEPS, ranks=ranks)
    if ranks > 1 and exit_code != exitcodes.EXIT_OK:  # torchrun exits 1 when a rank fails; each rank's code
        assert proc.returncode == 1 and f"exitcode  : {exit_code} " in proc.stderr, proc.stderr[-4000:]
    else:
        assert proc.returncode == exit_code, proc.stderr[-4000:]
    return proc


def reports(workdir: Path) -> list[dict[str, Any]]:
    path = workdir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses(workdir: Path) -> dict[int, bytes]:
    """The last logged loss of every step, as bits (a replayed step's second value replaces its first)."""
    points, _ = SpoolReader(workdir / "metrics" / "0.jsonl").pending(limit=100_000)
    return {step: struct.pack("<d", value) for key, value, _, step in points if key == "loss"}


def final_tensors(workdir: Path) -> dict[str, str]:
    """The final checkpoint's tensors by name, as the digests of their bytes (equal digests: equal bits)."""
    from supervisor.checkpoint import open_store

    store = open_store(workdir / "checkpoints")
    latest = store.latest()
    assert latest is not None and latest.step == STEPS
    return {name: ref.digest for name, ref in store.manifest(latest.id).tensors.items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("reference")
    run(workdir, "")
    assert reports(workdir) == []
    return workdir


def test_a_transient_bit_flip_is_a_hardware_fault_and_training_goes_on_from_the_replayed_state(
    tmp_path: Path, reference: Path
):
    proc = run(tmp_path, "sdc@4")
    assert "injecting sdc@4 on rank 0" in proc.stderr
    (report,) = reports(tmp_path)
    assert report["kind"] == "replay" and report["decision"] is None
    event, verdict = report["event"], report["replay"]
    assert event["type"] == "hardware_fault" and event["evidence"]["evidence"] == "replay_mismatch"
    assert event["evidence"]["ranks"] == [0] and event["evidence"]["hosts"] == [socket.gethostname()]
    assert event["evidence"]["device"] == "cpu" and event["evidence"]["anomaly"] in (
        "non_finite",
        "threshold",
    )
    # The snapshot of step 4 holds the flipped weight: the replay starts from step 2's (MIN_REPLAYED_STEPS).
    assert (verdict["verdict"], verdict["from_step"], verdict["onset_step"]) == ("replay_mismatch", 2, 5)
    assert verdict["first_diff_step"] == 5 and verdict["seconds"] > 0
    assert "a transient hardware fault; training goes on from the replayed state" in verdict["reason"]
    # Nothing skipped, no learning rate changed: every step's loss and the final state equal the reference's.
    assert losses(tmp_path) == losses(reference)
    assert final_tensors(tmp_path) == final_tensors(reference)


def test_a_fault_that_reproduces_on_the_same_device_leaves_the_rule_to_roll_back_and_skip(tmp_path: Path):
    # A device wrong on every run of step 4: the replay reproduces it, the rule rolls back past it and skips 2
    # batches, it strikes again at step 4, and the rollback budget (1) sends the run to its supervisor.
    run(tmp_path, "sdc_persistent@4", exit_code=exitcodes.EXIT_ANOMALY)
    replay, rollback, exhausted = reports(tmp_path)
    assert replay["kind"] == "replay" and replay["replay"]["verdict"] == "reproducible_on_same_device"
    assert replay["event"]["type"] in ("non_finite", "threshold")
    assert replay["replay"]["first_diff_step"] is None  # every replayed step the same, bit for bit
    decision = rollback["decision"]
    assert rollback["handled_in_process"] and decision["action"] == "rollback"
    # The target is the rule's (latest healthy: step 4's checkpoints hold the flipped weight), not the replay's.
    assert decision["skip_batches"] == 2 and decision["target_step"] == 2
    assert rollback["event"]["evidence"]["replay"]["verdict"] == "reproducible_on_same_device"
    assert (
        not exhausted["handled_in_process"] and "rollback budget exhausted" in exhausted["decision"]["reason"]
    )


@pytest.mark.slow
def test_under_ddp_the_replay_names_the_rank_whose_result_changed_first(tmp_path: Path):
    proc = run(tmp_path, "sdc@4:rank1", ranks=2)
    assert "injecting sdc@4:rank1 on rank 1" in proc.stderr
    (report,) = reports(tmp_path)
    verdict = report["replay"]
    assert verdict["verdict"] == "replay_mismatch"
    assert verdict["ranks"] == [1] and report["event"]["evidence"]["ranks"] == [1]
    # Rank 1's own loss went wrong (its detectors saw it: a NaN on any rank is an anomaly); rank 0's did not.
    assert verdict["first_diff_step"] == verdict["onset_step"] == 5 and verdict["from_step"] == 2
    assert math.isfinite(verdict["replayed"]) and not math.isfinite(verdict["original"])
    assert all(math.isfinite(struct.unpack("<d", v)[0]) for v in losses(tmp_path).values())  # rank 0's


@pytest.mark.slow
def test_under_ddp_a_device_wrong_every_time_reproduces_on_its_rank_but_not_on_the_next_ranks(tmp_path: Path):
    # Rank 1's process flips a weight after every run of step 4: the same device reproduces step 5's value; with
    # rank 1's batches computed on rank 0's device (and rank 0's on rank 1's) it differs: a faulty device.
    proc = run(tmp_path, "sdc_persistent@4:rank1", ranks=2, exit_code=exitcodes.EXIT_ANOMALY)
    assert "rank 1's batches on rank 0's device" in proc.stderr
    same, elsewhere, left = reports(tmp_path)
    assert same["kind"] == "replay" and same["replay"]["verdict"] == "reproducible_on_same_device"
    assert same["event"]["evidence"]["seen_on_rank"] == 1
    verdict = elsewhere["replay"]
    assert (verdict["verdict"], verdict["stage"], verdict["ranks"], verdict["other_rank"]) == (
        "persistent_mismatch",
        2,
        [1],
        0,
    )
    assert (verdict["from_step"], verdict["onset_step"], verdict["first_diff_step"]) == (2, 5, 5)
    # Rank 1's step-5 batch gives a finite loss on rank 0's device, and rank 0's goes wrong on rank 1's device.
    assert math.isfinite(verdict["replayed"]) and not math.isfinite(verdict["original"])
    assert verdict["differed"] == [0, 1] and verdict["seconds"] > 0
    event = elsewhere["event"]
    assert event["type"] == "hardware_fault" and event["evidence"]["evidence"] == "persistent_mismatch"
    assert event["evidence"]["hosts"] == [socket.gethostname()] and event["evidence"]["device"] == "cpu"
    stages = event["evidence"]["stages"]
    assert [s["verdict"] for s in stages] == ["reproducible_on_same_device", "persistent_mismatch"]
    assert all(s["seconds"] > 0 for s in stages)
    # Every rank stops; the supervisor decides on the hardware fault (and relaunches away from the host).
    assert not left["handled_in_process"] and left["event"]["type"] == "hardware_fault"


@pytest.mark.slow
def test_under_ddp_a_bad_batch_reproduces_on_another_ranks_device_so_the_rule_rolls_back_and_skips(
    tmp_path: Path,
):
    # Rank 1's batch of step 4 poisons the gradients of whichever process computes it: data, not a device.
    run(tmp_path, "bad_batch@4:rank1", ranks=2, exit_code=exitcodes.EXIT_ANOMALY)
    same, elsewhere, rollback, exhausted = reports(tmp_path)
    assert same["replay"]["verdict"] == "reproducible_on_same_device"
    verdict = elsewhere["replay"]
    assert (verdict["verdict"], verdict["stage"], verdict["other_rank"]) == (
        "reproducible_on_other_device",
        2,
        0,
    )
    # Bit for bit on every rank: rank 1's batches on rank 0's device and rank 0's on rank 1's.
    assert verdict["differed"] == [] and verdict["first_diff_step"] is None
    assert not math.isfinite(verdict["original"]) and not math.isfinite(verdict["replayed"])
    decision = rollback["decision"]
    assert rollback["handled_in_process"] and decision["action"] == "rollback"
    assert decision["skip_batches"] == 2 and decision["target_step"] <= 4
    stages = rollback["event"]["evidence"]["stages"]
    assert [s["verdict"] for s in stages] == ["reproducible_on_same_device", "reproducible_on_other_device"]
    # The drill's batch is bad at step 4 whatever the data: it strikes again, and the budget (1) hands over.
    assert not exhausted["handled_in_process"]


@pytest.mark.slow
def test_the_second_stage_hands_each_batch_over_with_the_streams_that_drew_it(tmp_path: Path):
    """Every draw of the data (noise added per sample) and of the model (dropout) comes from per-rank RNG
    streams: the second stage is the same bit for bit on every rank only if each rank draws its batch from its
    own streams and computes the other's with the other's."""
    from tests.segmentkit import segment_env
    from tests.test_faults_hardware_e2e import REPO, RUN_ID, TORCHRUN

    env = segment_env(tmp_path, RUN_ID, f"sqlite:///{tmp_path / 'unused.db'}", "bad_batch@4:rank1")
    (tmp_path / "policy.yaml").write_text(POLICY)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(
        [*TORCHRUN, "tests/scripts/train_noisy_ddp.py", str(STEPS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1 and f"exitcode  : {exitcodes.EXIT_ANOMALY} " in proc.stderr, proc.stderr[
        -3000:
    ]
    same, elsewhere, *_ = reports(tmp_path)
    assert same["replay"]["verdict"] == "reproducible_on_same_device"
    verdict = elsewhere["replay"]
    assert (verdict["verdict"], verdict["differed"]) == ("reproducible_on_other_device", [])


def fsdp_run(workdir: Path, faults: str) -> subprocess.CompletedProcess:
    """examples/fsdp_charlm.py (FSDP2, sharded checkpoints) on 2 gloo ranks under the replay policy."""
    from tests.segmentkit import segment_env
    from tests.test_faults_hardware_e2e import EXAMPLE, REPO, RUN_ID, TORCHRUN

    env = segment_env(workdir, RUN_ID, f"sqlite:///{workdir / 'unused.db'}", faults)
    (workdir / "policy.yaml").write_text(POLICY)
    env["OMP_NUM_THREADS"] = "1"
    command = [*TORCHRUN, "examples/fsdp_charlm.py", *EXAMPLE, "--steps", str(STEPS)]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_under_fsdp_every_rank_replays_its_shards_and_a_flip_all_gathered_everywhere_names_no_host(
    tmp_path_factory: pytest.TempPathFactory,
):
    clean, flipped, persistent = (tmp_path_factory.mktemp(n) for n in ("clean", "flipped", "persistent"))
    assert fsdp_run(clean, "").returncode == 0
    proc = fsdp_run(flipped, "sdc@4:rank1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = reports(flipped)
    verdict = report["replay"]
    assert (verdict["verdict"], verdict["from_step"], verdict["onset_step"]) == ("replay_mismatch", 2, 5)
    # Rank 1's shard is every rank's weight once all-gathered: both ranks' step 5 parts, so no host is blamed.
    assert (
        verdict["ranks"] == [0, 1] and verdict["hosts"] == [] and report["event"]["evidence"]["hosts"] == []
    )
    # Every rank restored its own shards of the snapshot: the run goes on as if the bit had never flipped.
    assert losses(flipped) == losses(clean)

    # A flip on every run of step 4 reproduces under FSDP; no second stage (a swap of batches cannot move a
    # shard), so the rule rolls every rank back in process and skips.
    proc = fsdp_run(persistent, "sdc_persistent@4:rank1")
    assert proc.returncode == 1 and f"exitcode  : {exitcodes.EXIT_ANOMALY} " in proc.stderr, proc.stderr[
        -3000:
    ]
    same, rollback, exhausted = reports(persistent)
    assert same["replay"]["verdict"] == "reproducible_on_same_device" and same["replay"]["stage"] == 1
    assert rollback["handled_in_process"] and rollback["decision"]["skip_batches"] == 2
    assert [s["verdict"] for s in rollback["event"]["evidence"]["stages"]] == ["reproducible_on_same_device"]
    assert not exhausted["handled_in_process"]


SUPERVISED_POLICY = """\
version: 1
name: replay-supervised
checkpoint: {every_steps: 2, keep_last: 20, memory_slots: 4, async: false, storage: ./checkpoints}
monitor:
  poll_seconds: 0.5
  detectors:
    - {type: non_finite, metrics: [loss]}
  replay: {enabled: true, max_steps: 6}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
    skip_batches: 3
  - when: [preemption, unknown_exit]
    action: resume
    target: {select: latest}
limits:
  backoff: {initial_seconds: 0.1, max_seconds: 1, multiplier: 2, jitter: false}
"""


def test_under_the_supervisor_a_replayed_fault_is_one_segment_and_every_view_shows_the_verdict(
    tmp_path: Path, capsys
):
    from supervisor.cli import main
    from supervisor.orchestrator import LineageRunner, RunOptions, python_command
    from supervisor.report.plot import draw_lineage
    from tests.test_status_real_run import TRAIN

    policy, script, workdir = tmp_path / "policy.yaml", tmp_path / "train.py", tmp_path / "wd"
    policy.write_text(SUPERVISED_POLICY)
    script.write_text(TRAIN)
    options = RunOptions(
        command=python_command(["python", str(script), "20"]),
        policy_path=str(policy),
        lineage="replay",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "sdc@13"},
        max_segments=2,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise().to_dict()
    # The supervisor's monitor also saw step 14's non-finite loss: the training process's report covers it.
    assert (record["status"], record["final_reason"]) == ("finished", "training finished")
    (segment,) = record["segments"]
    (entry,) = segment["in_process"]
    assert entry["kind"] == "replay" and entry["replay"]["verdict"] == "replay_mismatch"
    assert entry["event"]["type"] == "hardware_fault" and entry["anomaly"]["type"] == "non_finite"
    assert (entry["replay"]["from_step"], entry["replay"]["onset_step"]) == (12, 14)

    assert main(["status", "--workdir", str(workdir), "--json"]) == 0
    (view,) = json.loads(capsys.readouterr().out)["lineages"]
    (row,) = view["timeline"]
    assert (row["event"], row["action"], row["replay"]) == ("hardware_fault", "replay", "replay_mismatch")
    assert "transient hardware fault" in row["reason"]
    assert main(["status", "--workdir", str(workdir), "--width", "160"]) == 0
    text = capsys.readouterr().out
    assert "hardware_fault" in text and "replay_mismatch" in text

    _, drawn = draw_lineage(record, {})
    assert [(a["event"], a["replay"]) for a in drawn["anomalies"]] == [("hardware_fault", "replay_mismatch")]


@pytest.mark.slow
def test_under_the_supervisor_a_device_wrong_every_time_is_decided_there_and_shown_in_every_view(
    tmp_path: Path, capsys
):
    """torchrun with 2 ranks, rank 1's device wrong on every run of step 4: both stages replay in process, every
    rank stops, and the supervisor decides on the `hardware_fault` (here the local launcher cannot move away
    from this machine: the host goes to `not_excluded`, and the second segment strikes again)."""
    from supervisor.cli import main
    from supervisor.orchestrator import LineageRunner, RunOptions
    from supervisor.report.plot import draw_lineage
    from tests.test_faults_hardware_e2e import EXAMPLE, REPO, TORCHRUN

    policy, workdir = tmp_path / "policy.yaml", tmp_path / "wd"
    policy.write_text(
        POLICY.replace("limits: {max_rollbacks: 1}", "limits: {max_rollbacks: 1, max_restarts: 1}").replace(
            "rules:\n",
            "rules:\n  - when: [hardware_fault]\n    action: resume\n    target: {select: latest}\n",
        )
    )
    options = RunOptions(
        command=(*TORCHRUN, str(REPO / "examples" / "charlm.py"), *EXAMPLE, "--steps", str(STEPS)),
        policy_path=str(policy),
        lineage="persistent",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "sdc_persistent@4:rank1", "OMP_NUM_THREADS": "1"},
        max_segments=2,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise().to_dict()
    first = record["segments"][0]
    assert [e["replay"]["verdict"] for e in first["in_process"]] == [
        "reproducible_on_same_device",
        "persistent_mismatch",
    ]
    assert first["event"]["type"] == "hardware_fault"
    assert first["event"]["evidence"]["evidence"] == "persistent_mismatch"
    assert first["decision"]["action"] == "resume"
    assert [n["host"] for n in record["not_excluded"]] == [socket.gethostname()]

    assert main(["status", "--workdir", str(workdir), "--json"]) == 0
    (view,) = json.loads(capsys.readouterr().out)["lineages"]
    rows = [(r["event"], r["action"], r.get("replay")) for r in view["timeline"]][:3]
    assert rows == [
        ("non_finite", "replay", "reproducible_on_same_device"),
        ("hardware_fault", "replay", "persistent_mismatch"),
        ("hardware_fault", "resume", "persistent_mismatch"),  # the supervisor's decision, on that verdict
    ], view["timeline"]
    assert main(["status", "--workdir", str(workdir), "--width", "160"]) == 0
    text = capsys.readouterr().out
    assert "persistent_mismatch" in text and "reproducible_on_same_device" in text
    _, drawn = draw_lineage(record, {})
    assert ("hardware_fault", "persistent_mismatch") in [
        (a["event"], a["replay"]) for a in drawn["anomalies"]
    ]
