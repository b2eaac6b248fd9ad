"""Bit-exact resume of the example workload after SIGKILL at several points (mid-epoch and across an epoch).

The supervisor core (LineageRunner, no Prefect) relaunches the killed run from its latest checkpoint; the
final parameters, optimizer state and per-step losses after the resume point must equal an uninterrupted
run's bit for bit, with dropout on and the data shuffled. The example runs on a 30 KB slice of its corpus
at batch 8 (`SMALL`), so an epoch is 52 steps and a run of 70 crosses one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.orchestrator import LineageRunner, RunOptions, python_command
from tests.flowkit import CHARLM, FAST_POLICY, SMALL, assert_same_state, live_series, load_final_state

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 70


def supervise(workdir: Path, faults: str) -> tuple[dict, LineageRunner]:
    options = RunOptions(
        command=python_command(["python", CHARLM, "--steps", str(STEPS), "--eval-every", "20", *SMALL]),
        policy_path=str(FAST_POLICY),
        lineage="exact",
        workdir=workdir,
        stop_grace_seconds=10,
        env={"ROLLBACK_SUPERVISOR_FAULTS": faults} if faults else {},
        max_segments=5,
    )

    def only_resumes(decision, record) -> None:
        assert decision is None or decision.action == "resume", decision.reason

    with LineageRunner(options, sleep=lambda s: None) as runner:
        record = runner.supervise(on_decision=only_resumes).to_dict()
    result = {"tracking_uri": record["mlflow"]["tracking_uri"], "mlflow_run_id": record["mlflow"]["run_id"]}
    return {**record, "result": result}, runner


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    record, runner = supervise(tmp_path_factory.mktemp("clean"), "")
    assert len(record["segments"]) == 1 and record["segments"][0]["outcome"] == "finished"
    final = load_final_state(runner.layout.checkpoints, record["final_checkpoint"], STEPS, SMALL)
    return final, live_series(record["result"], "loss")


@pytest.mark.parametrize(
    ("kill_at", "resume_step"),
    [(33, 20), (47, 40), (65, 60)],
    ids=["mid-epoch-1", "resume-then-cross-epoch", "mid-epoch-2"],
)
def test_sigkill_then_resume_is_bit_identical(uninterrupted, tmp_path: Path, kill_at: int, resume_step: int):
    final, losses = uninterrupted
    record, runner = supervise(tmp_path, f"kill@{kill_at}")
    first, second = record["segments"][:2]
    assert first["returncode"] == -9 and first["event"]["type"] == "unknown_exit"
    assert second["restore"]["checkpoint_id"].startswith(f"{resume_step:010d}-")
    assert record["segments"][-1]["outcome"] == "finished"
    assert_same_state(
        final, load_final_state(runner.layout.checkpoints, record["final_checkpoint"], STEPS, SMALL)
    )
    resumed = live_series(record["result"], "loss")
    assert [resumed[s] for s in range(resume_step + 1, STEPS + 1)] == [
        losses[s] for s in range(resume_step + 1, STEPS + 1)
    ]


def test_the_cases_straddle_an_epoch_boundary():
    """The ids mean what they say: the second case resumes before an epoch ends, the third after one ended."""
    import charlm

    loader = charlm.build(charlm.parse_args(["--steps", str(STEPS), *SMALL]))[3]
    assert len(loader) == 52
    assert 47 < len(loader) < 60 < STEPS
