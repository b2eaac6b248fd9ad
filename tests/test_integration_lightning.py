"""The Lightning integration end to end: `examples/lightning_cnn.py` (a CNN with dropout, shuffled seeded data and a
warm-up schedule, supervised by one added callback) under the real supervisor, real signals and real faults.

An epoch of the example is 16 batches and a run here is 48 steps (three epochs); `lightning.yaml` checkpoints every
8 steps, so 16 and 32 are epoch ends. The reference run goes through `rollback-supervisor run`; resumes are compared
with it bit for bit, and the rollback by the dataset index of each step's first sample and by the logged LR.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from supervisor.orchestrator import LineageRunner, RunOptions, python_command
from tests.conftest import REPO
from tests.flowkit import assert_same_state, live_series, record

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

sys.path.insert(0, str(REPO / "examples"))
EXAMPLE = str(REPO / "examples" / "lightning_cnn.py")
POLICY = REPO / "tests" / "data" / "policies" / "lightning.yaml"
CLI = Path(sys.executable).parent / "rollback-supervisor"
STEPS = 48


def command(steps: int = STEPS, *extra: str) -> list[str]:
    return ["python", EXAMPLE, "--steps", str(steps), "--val-every", "20", "--batch-counter", *extra]


def final_state(checkpoints: Path, checkpoint_id: str) -> dict:
    """A checkpoint restored into a fresh module and optimizer through our store alone (no Lightning run)."""
    import lightning_cnn

    from supervisor.checkpoint import CheckpointManager, CheckpointOptions
    from supervisor.state import TrainingState

    module = lightning_cnn.ShapesCNN()
    opt = module.configure_optimizers()["optimizer"]
    state = TrainingState()
    state.register("model", module)
    state.register("optimizer", opt)
    with CheckpointManager(CheckpointOptions(directory=checkpoints, async_save=False), state) as manager:
        info = manager.restore(checkpoint_id)
    return {"step": info.step, "model": module.state_dict(), "optimizer": opt.state_dict()}


def checkpoint_infos(rec: dict) -> list:
    from supervisor.checkpoint import CheckpointManager, CheckpointOptions
    from supervisor.state import TrainingState

    options = CheckpointOptions(directory=Path(rec["storage"]["checkpoints"]), async_save=False)
    with CheckpointManager(options, TrainingState()) as manager:
        return manager.list()


def mlflow_run(rec: dict) -> dict:
    return {"tracking_uri": rec["mlflow"]["tracking_uri"], "mlflow_run_id": rec["mlflow"]["run_id"]}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One workdir for every lineage here: one MLflow store, created once."""
    return tmp_path_factory.mktemp("lightning") / "work"


@pytest.fixture(scope="module")
def uninterrupted(prefect_harness, work):
    """The reference run, through `rollback-supervisor run` in a subprocess (on the test harness's Prefect API)."""
    from prefect.settings import PREFECT_API_URL

    root = work.parent
    argv = [str(CLI), "run", "--policy", str(POLICY), "--lineage", "cli", "--workdir", str(work), "--"]
    proc = subprocess.run(
        [*argv, *command()],
        cwd=root,
        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = record(work, "cli")
    series = {
        key: live_series(mlflow_run(rec), key) for key in ("loss", "sample", "lr", "batches", "val_loss")
    }
    return rec, final_state(Path(rec["storage"]["checkpoints"]), rec["final_checkpoint"]), series


@pytest.fixture(scope="module")
def faulted(uninterrupted, work):
    """A NaN at step 11, SIGTERM at step 21 (mid-epoch 2), SIGKILL at step 43 (mid-epoch 3), one lineage.

    Its policy rolls the NaN back in process without a skip or an LR change, so the run can still end exactly
    where the uninterrupted one did, and writes checkpoints synchronously, so the one at step 40 (mid-epoch 3)
    is the newest committed when step 43 is killed.
    """
    policy = work.parent / "replay.yaml"
    policy.write_text(
        POLICY.read_text()
        .replace("skip_batches: 5", "skip_batches: 0")
        .replace("lr_scale: 0.5", "lr_scale: 1.0")
        .replace("async: true", "async: false")
    )
    options = RunOptions(
        command=python_command(command()),
        policy_path=str(policy),
        lineage="faulted",
        workdir=work,
        stop_grace_seconds=20,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "nan@11,term@21,kill@43"},
        max_segments=5,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        rec = runner.supervise().to_dict()
    return rec, final_state(runner.layout.checkpoints, rec["final_checkpoint"])


def test_runs_through_the_cli(uninterrupted):
    rec, final, series = uninterrupted
    assert rec["status"] == "finished" and [s["outcome"] for s in rec["segments"]] == ["finished"]
    assert final["step"] == STEPS and rec["final_checkpoint"].startswith(f"{STEPS:010d}-")
    assert sorted(series["loss"]) == sorted(series["sample"]) == list(range(1, STEPS + 1))


def test_sigkill_mid_epoch_then_relaunch_is_bit_identical(uninterrupted, faulted):
    _, clean, series = uninterrupted
    rec, final = faulted
    killed, last = rec["segments"][1:]
    assert killed["returncode"] == -9 and killed["event"]["type"] == "unknown_exit"
    # The relaunch resumed from the newest checkpoint committed before the kill: step 40, mid-epoch 3 (an epoch
    # is 16 batches), written synchronously.
    assert last["restore"]["checkpoint_id"].startswith("0000000040-") and last["start_step"] == 40
    assert last["outcome"] == "finished"
    # Validation runs after step 40 (every 20): the step's decision waited for it, so checkpoint 40 carries the
    # val_loss of step 40's weights (the value logged at 40), and was taken after validation, so the relaunch
    # resumed through Lightning's "restarted after validation" path without validating again.
    (at40,) = [c for c in checkpoint_infos(rec) if c.step == 40]
    assert at40.metrics["val_loss"] == series["val_loss"][40] and set(series["val_loss"]) == {20, 40}
    assert sorted(live_series(mlflow_run(rec), "val_loss")) == [20, 40]
    assert_same_state(clean, final)
    resumed = live_series(mlflow_run(rec), "loss")
    assert [resumed[s] for s in range(1, STEPS + 1)] == [series["loss"][s] for s in range(1, STEPS + 1)]
    # BatchCounter's state_dict went through the checkpoint: after the relaunch it counts on from 40, not from 0.
    counted = live_series(mlflow_run(rec), "batches")
    assert [counted[s] for s in range(41, STEPS + 1)] == [float(s) for s in range(41, STEPS + 1)]
    assert series["batches"][STEPS] == float(STEPS)
    # The comparison can fail: training moved the weights, and there is optimizer state to compare.
    import lightning_cnn

    torch.manual_seed(0)
    assert final["optimizer"]["state"]
    assert not torch.equal(final["model"]["head.weight"], lightning_cnn.ShapesCNN().head.weight)


def test_sigterm_writes_an_emergency_checkpoint_exits_75_and_the_relaunch_resumes_there(
    faulted,
):
    rec, _ = faulted
    first, second = rec["segments"][:2]
    assert first["returncode"] == 75 and first["event"]["type"] == "preemption"
    # Step 21 is not on the every-8 cadence: only the emergency checkpoint holds it.
    assert second["restore"]["checkpoint_id"].startswith("0000000021-")
    assert second["start_step"] == 21


def test_in_process_rollback_without_skip_or_lr_scale_replays_bit_identically(uninterrupted, faulted):
    """The in-process rollback restores everything a step depends on: module, optimizer, scheduler, the loop's
    counters, every RNG stream (dropout) and the loader's position; replayed, steps 9.. are the same steps."""
    _, clean, series = uninterrupted
    rec, final = faulted
    (incident,) = rec["segments"][0]["in_process"]
    assert incident["event"]["type"] == "non_finite" and incident["event"]["onset_step"] == 12
    assert incident["decision"]["target_step"] == 8 and incident["tier"] == "memory"
    replayed = live_series(mlflow_run(rec), "loss")
    assert [replayed[s] for s in range(9, 21)] == [series["loss"][s] for s in range(9, 21)]
    assert_same_state(clean, final)


def test_nan_in_the_prefect_flow_rolls_back_in_process_skipping_5_batches_at_half_the_lr(
    uninterrupted, work, tmp_path: Path
):
    """Through the Prefect flow, with the Trainer's own MLFlowLogger also logging into the lineage's run."""
    from flows.supervised import supervised_training

    _, _, clean = uninterrupted
    # Checkpoints every 10 steps: the NaN at 33 (onset 34) rolls back to 30, two batches before an epoch end,
    # so the skip of 5 crosses into the third epoch.
    policy = tmp_path / "every10.yaml"
    policy.write_text(POLICY.read_text().replace("every_steps: 8", "every_steps: 10"))
    result = supervised_training(
        command=command(STEPS, "--mlflow-logger"),
        policy=str(policy),
        lineage="flow",
        workdir=str(work),
        stop_grace_seconds=20,
        env={"ROLLBACK_SUPERVISOR_FAULTS": "nan@33"},
    )
    assert result["status"] == "finished", result
    rec = record(work, "flow")
    assert [s["outcome"] for s in rec["segments"]] == ["finished"]  # no relaunch
    (incident,) = rec["segments"][0]["in_process"]
    assert incident["event"]["type"] == "non_finite" and incident["event"]["onset_step"] == 34
    decision = incident["decision"]
    assert (decision["target_step"], decision["skip_batches"], decision["lr_scale"]) == (30, 5, 0.5)

    sample, lr = live_series(result, "sample"), live_series(result, "lr")
    assert sorted(sample) == sorted(lr) == list(range(1, STEPS + 1))
    # Up to the target the same batches; after it the data stream 5 batches further on (the uninterrupted run's
    # batches of steps 36..48 at steps 31..43), and the LR of the same step halved (exactly: x0.5).
    assert [sample[s] for s in range(1, 31)] == [clean["sample"][s] for s in range(1, 31)]
    assert [sample[s] for s in range(31, 44)] == [clean["sample"][s] for s in range(36, 49)]
    assert len({sample[s] for s in range(31, 44)}) == 13  # distinct batches: the comparison is not vacuous
    assert [lr[s] for s in range(1, 31)] == [clean["lr"][s] for s in range(1, 31)]
    assert [lr[s] for s in range(31, STEPS + 1)] == [clean["lr"][s] * 0.5 for s in range(31, STEPS + 1)]

    # The Trainer's MLFlowLogger (lineage_mlflow_logger) wrote into the lineage's run, under its prefix.
    # Every 5th of Lightning's logging steps (counted from 0), each once and finite: the thrown-away step 34
    # (a NaN, logged at the target's step 29 before the fix) never reached it.
    client = MlflowClient(tracking_uri=result["tracking_uri"])
    history = client.get_metric_history(result["mlflow_run_id"], "lightning-loss")
    assert sorted(m.step for m in history) == list(range(4, STEPS, 5))
    assert all(math.isfinite(m.value) for m in history)


def test_stand_alone_script_runs_and_exits_0(tmp_path: Path, monkeypatch):
    """No plan in the environment: local defaults (a run directory, a local MLflow store), and `main()` returns 0."""
    import lightning_cnn

    monkeypatch.delenv("ROLLBACK_SUPERVISOR_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)
    assert lightning_cnn.main(["--steps", "12", "--val-every", "6", "--workdir", str(tmp_path)]) == 0
    (run_dir,) = (tmp_path / "standalone").iterdir()
    assert any(p.name.startswith("ckpt-0000000012-") for p in (run_dir / "checkpoints").iterdir())
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rollback-supervisor").experiment_id])
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 13))
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")] == [6, 12]


def test_a_loader_over_an_iterable_dataset_is_refused_in_one_line_with_exit_2(
    tmp_path: Path, capsys, monkeypatch
):
    """A plain DataLoader is made resumable (tests/test_integration_lightning_plain.py), but one over an
    IterableDataset has no sampler order to replay: refused before anything starts."""
    import lightning_cnn

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(lightning_cnn.Shapes(64, 0))

    class StreamLoader(lightning_cnn.ShapesCNN):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(Stream(), batch_size=16)

    monkeypatch.delenv("ROLLBACK_SUPERVISOR_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)
    trainer = lightning_cnn.build(lightning_cnn.parse_args(["--steps", "4", "--workdir", str(tmp_path)]))[0]
    with pytest.raises(SystemExit) as exited:
        trainer.fit(StreamLoader())
    assert exited.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error" in line.lower()]
    assert "Traceback" not in err
    assert line.startswith("error: RollbackSupervisor: the train loader reads an IterableDataset (Stream)")
    assert "StatefulDataLoader" in line  # how to fix it
    assert not (tmp_path / "standalone").exists()  # nothing was started


def refused(tmp_path: Path, capsys, monkeypatch, module, **trainer_kwargs) -> str:
    """fit() a stand-alone example Trainer; it must end with exit 2 and one `error:` line, no traceback."""
    import lightning_cnn

    monkeypatch.delenv("ROLLBACK_SUPERVISOR_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)
    trainer = lightning_cnn.build(lightning_cnn.parse_args(["--steps", "2", "--workdir", str(tmp_path)]))[0]
    with pytest.raises(SystemExit) as exited:
        trainer.fit(module)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    return line


def test_manual_optimization_is_refused(tmp_path: Path, capsys, monkeypatch):
    """Several optimizer steps per batch would move trainer.global_step by more than 1: not supported yet
    (several optimizers need manual optimization: Lightning refuses them under automatic optimization)."""
    import lightning_cnn

    class Manual(lightning_cnn.ShapesCNN):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    line = refused(tmp_path, capsys, monkeypatch, Manual())
    assert line.startswith("error: RollbackSupervisor: Manual.automatic_optimization is False")
    assert "not supported yet" in line
    assert not (tmp_path / "standalone").exists()  # nothing was started


def test_a_second_fit_with_the_same_callback_is_refused(tmp_path: Path, capsys, monkeypatch):
    import lightning_cnn

    monkeypatch.delenv("ROLLBACK_SUPERVISOR_PLAN", raising=False)
    monkeypatch.chdir(tmp_path)
    trainer, model = lightning_cnn.build(
        lightning_cnn.parse_args(["--steps", "2", "--val-every", "2", "--workdir", str(tmp_path)])
    )
    trainer.fit(model)
    capsys.readouterr()
    (run_dir,) = (tmp_path / "standalone").iterdir()
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    with pytest.raises(SystemExit) as exited:
        trainer.fit(model)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert "already supervised a trainer.fit()" in line
    assert [p.name for p in (tmp_path / "standalone").iterdir()] == [run_dir.name]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before  # no step-0 checkpoint


CUSTOM_SAMPLER_SCRIPT = """
import sys, torch
sys.path.insert(0, {examples!r})
import lightning_cnn

class EveryOther(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n
    def __iter__(self):
        return iter(torch.randperm(self.n)[::2].tolist())
    def __len__(self):
        return self.n // 2

class CustomSampler(lightning_cnn.ShapesCNN):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(lightning_cnn.Shapes(64, 0), batch_size=16, sampler=EveryOther(64))

trainer = lightning_cnn.build(lightning_cnn.parse_args(["--steps", "4", "--workdir", {workdir!r}]))[0]
trainer.fit(CustomSampler())
"""


def test_a_refusal_in_a_real_process_is_one_error_line_and_exit_2(tmp_path: Path):
    """The process a user runs: exit code 2, one `error:` line on stderr, no traceback. A sampler of the user's
    own draws its order in ways a resume cannot replay."""
    script = CUSTOM_SAMPLER_SCRIPT.format(examples=str(REPO / "examples"), workdir=str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "ROLLBACK_SUPERVISOR_PLAN"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(
        "error: RollbackSupervisor: the train loader's sampler is EveryOther, whose order a resume"
    )
    assert "set_epoch(epoch)" in line and "StatefulDataLoader" in line
