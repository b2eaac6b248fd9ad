"""The Hugging Face Trainer under supervision (`examples/hf_tiny_gpt.py`, one added callback), end to end.

A tiny GPT-2 built from a config (no download), dropout on, the Trainer's shuffled order and warm-up
schedule, on CPU. 256 windows at batch 8 make an epoch of 32 steps; a run of 60 crosses one. The reference
for every comparison is the same script run stand-alone, uninterrupted: supervision, a SIGKILL, a SIGTERM and
their relaunches must not change one bit of the model or optimizer, nor one logged loss after the resume.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient

from supervisor import exitcodes
from supervisor.checkpoint import CheckpointManager, CheckpointOptions, open_store
from supervisor.errors import UserError
from supervisor.flatten import flatten
from supervisor.orchestrator import LineageRunner, RunOptions, python_command
from supervisor.rng import capture_rng, restore_rng
from supervisor.runtime.faults import FAULTS_ENV
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan
from supervisor.state import TrainingState
from tests.conftest import REPO
from tests.flowkit import history, live_series, record

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing can be fetched here; the model is built from a config

HF = str(REPO / "examples" / "hf_tiny_gpt.py")
HF_POLICY = REPO / "tests" / "data" / "policies" / "hf-fast.yaml"
HF_SYNC_POLICY = REPO / "tests" / "data" / "policies" / "hf-sync.yaml"  # saves committed before the next step
CLI = Path(sys.executable).with_name("rollback-supervisor")
STEPS, SAMPLES, BATCH, SEED = 60, 256, 8, 0
PER_EPOCH = SAMPLES // BATCH
ARGS = ["--steps", str(STEPS), "--samples", str(SAMPLES), "--batch-size", str(BATCH), "--threads", "1"]
COMMAND = ["python", HF, *ARGS]


# -- helpers ----------------------------------------------------------------------------------------------


class _Collected:
    """Receives one part's saved state from a restore, as it was stored."""

    def __init__(self) -> None:
        self.saved: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Any) -> None:
        self.saved = state


def checkpoint_state(directory: Path, checkpoint_id: str) -> dict[str, Any]:
    """A checkpoint's step, data position and every model and optimizer tensor (by key path), read back."""
    state, parts = TrainingState(), {name: _Collected() for name in ("model", "optimizer", "data")}
    for name, part in parts.items():
        state.register(name, part)
    rng = capture_rng()  # the restore sets this process's RNG streams: put them back
    try:
        with CheckpointManager(CheckpointOptions(directory=directory, async_save=False), state) as manager:
            info = manager.restore(checkpoint_id)
    finally:
        restore_rng(rng)
    tensors = flatten({"model": parts["model"].saved, "optimizer": parts["optimizer"].saved})[1]
    return {"step": info.step, "data": parts["data"].saved, "tensors": tensors}


def assert_bit_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"] and a["data"] == b["data"]
    assert a["tensors"].keys() == b["tensors"].keys()
    assert any(k.startswith("optimizer.state.") for k in a["tensors"])  # Adam's moments, not just the weights
    different = [k for k, t in a["tensors"].items() if not torch.equal(t, b["tensors"][k])]
    assert not different, different


def supervise(workdir: Path, faults: str, policy: Path = HF_POLICY) -> dict[str, Any]:
    """The supervisor core (no Prefect) on the example until it finishes; the lineage record."""
    options = RunOptions(
        command=python_command(COMMAND),
        policy_path=str(policy),
        lineage="hf",
        workdir=workdir,
        stop_grace_seconds=10,
        env={FAULTS_ENV: faults},
        max_segments=5,
    )
    with LineageRunner(options, sleep=lambda s: None) as runner:
        return runner.supervise().to_dict()


def lineage_result(rec: dict[str, Any]) -> dict[str, str]:
    return {"tracking_uri": rec["mlflow"]["tracking_uri"], "mlflow_run_id": rec["mlflow"]["run_id"]}


def expected_first_samples(positions: list[int]) -> list[float]:
    """The first sample index of each batch position in the Trainer's own order: accelerate's seedable
    sampler draws epoch e's permutation from a generator seeded with seed + e."""
    from torch.utils.data import RandomSampler

    out = []
    for position in positions:
        epoch, within = divmod(position, PER_EPOCH)
        order = list(RandomSampler(range(SAMPLES), generator=torch.Generator().manual_seed(SEED + epoch)))
        out.append(float(order[within * BATCH]))
    return out


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    """The example stand-alone (no supervisor, no plan), uninterrupted: the reference run."""
    workdir = tmp_path_factory.mktemp("standalone")
    proc = subprocess.run(
        [sys.executable, *COMMAND[1:], "--workdir", str(workdir)],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (store,) = workdir.glob("standalone/hf-tiny-gpt-*/checkpoints")
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rollback-supervisor").experiment_id])
    return {"proc": proc, "store": store, "result": {"tracking_uri": uri, "mlflow_run_id": run.info.run_id}}


# -- fast checks of the parts ------------------------------------------------------------------------------


def test_the_order_continues_the_trainers_shuffle_across_epochs():
    from accelerate.data_loader import SeedableRandomSampler
    from torch.utils.data import BatchSampler

    from supervisor.integrations.transformers import DataPosition, ResumableOrder

    sampler = SeedableRandomSampler(range(SAMPLES), generator=torch.Generator(), data_seed=SEED)
    order = ResumableOrder(BatchSampler(sampler, BATCH, drop_last=False), DataPosition(PER_EPOCH))
    order.position.batches = 30  # two batches before the end of epoch 0
    batches = list(order)
    assert len(batches) == PER_EPOCH
    assert [b[0] for b in batches] == expected_first_samples(list(range(30, 30 + PER_EPOCH)))
    assert order.consumed(30) == batches[0] and order.consumed(32) == batches[2] and 31 not in order.issued


def test_a_checkpoint_of_another_batch_count_is_refused_with_its_numbers():
    from supervisor.errors import CheckpointError
    from supervisor.integrations.transformers import DataPosition

    with pytest.raises(
        CheckpointError, match="written with 40 batches per epoch, this Trainer has 32"
    ) as err:
        DataPosition(32).load_state_dict({"batches": 7, "batches_per_epoch": 40})
    assert isinstance(err.value, UserError)  # a user's mistake: exit 2, one line, no traceback


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"train_sampling_strategy": "group_by_length"},
            "sampler is LengthGroupedSampler, whose order a resume",
        ),
        ({"gradient_accumulation_steps": 3}, "gradient_accumulation_steps=3 does not divide the 32 batches"),
    ],
    ids=["unseedable-order", "accumulation-across-epochs"],
)
def test_a_trainer_that_cannot_resume_exactly_is_refused_before_anything_starts(
    tmp_path, capsys, change, message
):
    sys.path.insert(0, str(REPO / "examples"))
    import hf_tiny_gpt

    trainer = hf_tiny_gpt.build(hf_tiny_gpt.parse_args([*ARGS, "--workdir", str(tmp_path)]))
    for key, value in change.items():
        setattr(trainer.args, key, value)
    with pytest.raises(SystemExit) as end:
        trainer.train()
    assert end.value.code == 2  # a user's mistake: one line on stderr, no traceback
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert message in line
    assert not (tmp_path / "standalone").exists()  # refused before the store was opened


def test_a_setup_mistake_exits_2_with_one_error_line_and_no_traceback(tmp_path):
    # 3 does not divide the 32 batches of an epoch: refused inside train(), before anything starts.
    proc = subprocess.run(
        [sys.executable, HF, *ARGS, "--grad-accum", "3", "--workdir", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "gradient_accumulation_steps=3 does not divide" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert not (tmp_path / "standalone").exists()


def _tiny_trainer(tmp_path: Path, *extra: str) -> Any:
    sys.path.insert(0, str(REPO / "examples"))
    import hf_tiny_gpt

    argv = ["--steps", "4", "--samples", "64", "--batch-size", "8", "--threads", "1", "--warmup", "2"]
    return hf_tiny_gpt.build(hf_tiny_gpt.parse_args([*argv, *extra, "--workdir", str(tmp_path)]))


def test_a_segment_restored_at_max_steps_returns_from_train_and_the_script_goes_on(
    tmp_path, monkeypatch, capsys
):
    plan = LaunchPlan(
        lineage="hf-end",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "work" / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        policy_path=str(HF_POLICY),
        supervised=False,
    )
    monkeypatch.setenv(PLAN_ENV, str(plan.write(tmp_path / "plan.json")))
    first = _tiny_trainer(tmp_path)
    first.train()
    trained = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    # The relaunch of a segment that ended at max_steps: nothing to train, and train() returns.
    again = _tiny_trainer(tmp_path, "--seed", "1")  # other initial weights: the restore must replace them
    again.train()
    assert again.state.global_step == 4
    again.save_model(str(tmp_path / "saved"))  # what a user's script does after train()
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    restored = again.model.state_dict()
    assert all(torch.equal(restored[k], t) for k, t in trained.items())
    # A relaunch with another batch size cannot continue that data position: exit 2, one error line.
    capsys.readouterr()
    other = _tiny_trainer(tmp_path, "--batch-size", "16")
    with pytest.raises(SystemExit) as end:
        other.train()
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: data.batches_per_epoch: the checkpoint was written with 8 batches per epoch, this Trainer "
        "has 4; resume with the dataset, batch size and drop_last it was written with"
    ]


def _policy(tmp_path: Path, detectors: str, rules: str = "[{when: [non_finite], action: stop}]") -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(
        "version: 1\nname: hf-unit\ncheckpoint: {every_steps: 4, keep_last: 10, async: false}\n"
        f"monitor: {{detectors: {detectors}}}\nrules: {rules}\n"
    )
    return path


def test_every_step_a_save_may_be_due_at_is_logged_so_no_checkpoint_is_written_unchecked(tmp_path, caplog):
    policy = _policy(tmp_path, "[{type: non_finite, metrics: [loss, grad_norm]}]")
    trainer = _tiny_trainer(tmp_path, "--steps", "6", "--policy", str(policy))
    trainer.args.logging_steps = 100  # the Trainer alone would log no step of this run
    trainer.args.logging_nan_inf_filter = True
    with caplog.at_level("WARNING", logger="rollback_supervisor.transformers"):
        trainer.train()
    # Step 4 (every_steps) and step 6 (the final checkpoint) were logged, so the detectors saw their loss.
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [4, 6]
    (store,) = tmp_path.glob("standalone/hf-tiny-gpt-*/checkpoints")
    saved = {info.step: info.metrics for info in open_store(store).list()}
    assert sorted(saved) == [4, 6] and all("loss" in m and "grad_norm" in m for m in saved.values())
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "logging_steps=100, checkpoint.every_steps=4" in warned
    assert "set logging_nan_inf_filter=False" in warned


def test_an_evaluation_due_at_a_step_reaches_the_detectors_before_the_decision(tmp_path):
    # eval_loss is always above 0: the anomaly is seen only if the decision waits for the evaluation.
    policy = _policy(
        tmp_path,
        "[{type: threshold, metric: eval_loss, above: 0}]",
        "[{when: [threshold], action: rollback, target: {select: latest}}]",
    )
    trainer = _tiny_trainer(tmp_path, "--steps", "4", "--eval-every", "2", "--policy", str(policy))
    with pytest.raises(SystemExit) as end:
        trainer.train()
    assert end.value.code == exitcodes.EXIT_ANOMALY
    assert [e["step"] for e in trainer.state.log_history if "eval_loss" in e] == [2]  # stopped at the first
    (events,) = tmp_path.glob("standalone/hf-tiny-gpt-*/events.jsonl")
    (report,) = [json.loads(line) for line in events.read_text().splitlines()]
    assert report["event"]["type"] == "threshold" and report["event"]["step"] == 2


# -- end to end --------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.slow
def test_standalone_runs_to_the_end_and_exits_zero(standalone):
    proc = standalone["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    latest = open_store(standalone["store"]).latest()
    assert latest is not None and latest.step == STEPS
    loss = live_series(standalone["result"], "loss")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert sum(loss[s] for s in range(51, 61)) < sum(loss[s] for s in range(1, 11))  # it learns
    # Each step trained on the next batch of the Trainer's own shuffled order, across the epoch boundary.
    batches = live_series(standalone["result"], "data.batch")
    assert [batches[s] for s in range(1, STEPS + 1)] == [float(p) for p in range(STEPS)]
    samples = live_series(standalone["result"], "data.sample")
    assert [samples[s] for s in range(1, STEPS + 1)] == expected_first_samples(list(range(STEPS)))


@pytest.mark.e2e
@pytest.mark.slow
def test_sigkill_mid_epoch_then_relaunch_is_bit_identical(standalone, tmp_path: Path):
    # Killed in epoch 1 at step 37; the relaunch restores step 30 (epoch 0) and crosses the boundary at 32.
    # Synchronous saves: step 30's checkpoint is committed before step 31 starts, however loaded the machine.
    rec = supervise(tmp_path, "kill@37", HF_SYNC_POLICY)
    first, second = rec["segments"]
    assert first["returncode"] == -9 and first["event"]["type"] == "unknown_exit"
    assert second["restore"]["checkpoint_id"].startswith("0000000030-") and second["outcome"] == "finished"
    final = checkpoint_state(tmp_path / "checkpoints" / "hf", rec["final_checkpoint"])
    reference = checkpoint_state(standalone["store"], open_store(standalone["store"]).latest().id)
    assert_bit_identical(final, reference)
    # Every logged value after the resume point too: the loss (the Trainer averages it since its last log),
    # the data epoch (not the Trainer's loop count), the schedule, the batches.
    for key in ("loss", "grad_norm", "learning_rate", "epoch", "data.batch", "data.sample"):
        resumed, clean = live_series(lineage_result(rec), key), live_series(standalone["result"], key)
        assert [resumed[s] for s in range(31, STEPS + 1)] == [clean[s] for s in range(31, STEPS + 1)], key


@pytest.mark.e2e
@pytest.mark.slow
def test_nan_rolls_back_with_skip_and_lr_scale_through_the_prefect_flow(
    standalone, prefect_harness, tmp_path
):
    from flows.supervised import supervised_training

    result = supervised_training(
        command=COMMAND,
        policy=str(HF_POLICY),
        lineage="hf",
        workdir=str(tmp_path),
        stop_grace_seconds=10,
        env={FAULTS_ENV: "nan@25"},
    )
    assert result["status"] == "finished", result
    first, second = record(tmp_path, "hf")["segments"]
    # NaN weights after step 25's update: the loss of step 26 is NaN; the Trainer cannot roll back in process,
    # so the segment exits 76 and the supervisor relaunches from step 20 (the latest before onset - 1).
    assert first["returncode"] == 76 and first["event"]["type"] == "non_finite"
    assert second["restore"] == {
        "checkpoint_id": second["restore"]["checkpoint_id"],
        "skip_batches": 5,
        "lr_scale": 0.5,
        "from_scratch": False,
        "rollback": True,
    }
    assert second["restore"]["checkpoint_id"].startswith("0000000020-")
    # Steps 21.. trained on batches 25.. of the same shuffled order: five skipped, across the epoch boundary.
    batches = live_series(result, "data.batch")
    positions = list(range(20)) + list(range(25, STEPS + 5))
    assert [batches[s] for s in range(1, STEPS + 1)] == [float(p) for p in positions]
    samples = live_series(result, "data.sample")
    assert [samples[s] for s in range(1, STEPS + 1)] == expected_first_samples(positions)
    # The warm-up schedule went on at half the learning rate (exactly: a power of two), the steps before
    # the rollback target untouched; the abandoned attempt at step 21 ran at the full rate.
    lr, clean = live_series(result, "learning_rate"), live_series(standalone["result"], "learning_rate")
    assert [lr[s] for s in range(1, 21)] == [clean[s] for s in range(1, 21)]
    assert [lr[s] for s in range(21, STEPS + 1)] == [clean[s] * 0.5 for s in range(21, STEPS + 1)]
    assert min((t, v) for s, v, t in history(result, "learning_rate") if s == 21)[1] == clean[21]
    assert live_series(result, "rollback.skip_batches")[20] == 5


@pytest.mark.e2e
@pytest.mark.slow
def test_cli_run_sigterm_saves_exits_75_and_the_relaunch_resumes_bit_identical(
    standalone, prefect_harness, tmp_path: Path
):
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), FAULTS_ENV: "term@33"}
    proc = subprocess.run(
        [str(CLI), "run", "--policy", str(HF_POLICY), "--lineage", "hf", "--workdir", str(tmp_path / "w"),
         "--stop-grace", "10", "--", *COMMAND],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = record(tmp_path / "w", "hf")
    first, second = rec["segments"]
    # SIGTERM after step 33 (one step into epoch 1): the emergency checkpoint is that step, no step is lost.
    assert first["returncode"] == 75 and first["event"]["type"] == "preemption"
    assert second["restore"]["checkpoint_id"].startswith("0000000033-") and second["outcome"] == "finished"
    final = checkpoint_state(tmp_path / "w" / "checkpoints" / "hf", rec["final_checkpoint"])
    reference = checkpoint_state(standalone["store"], open_store(standalone["store"]).latest().id)
    assert_bit_identical(final, reference)
    resumed, clean = live_series(lineage_result(rec), "loss"), live_series(standalone["result"], "loss")
    assert [resumed[s] for s in range(34, STEPS + 1)] == [clean[s] for s in range(34, STEPS + 1)]


@pytest.mark.parametrize("kind", ["fsdp", "deepspeed"])
def test_fsdp_or_deepspeed_over_several_processes_is_refused_saying_ddp_works(kind):
    from supervisor.integrations.transformers import TrainerSetupError, check_parallelism

    with pytest.raises(
        TrainerSetupError, match=rf"TrainingArguments\({kind}=...\) over 2 processes.*drop {kind}="
    ):
        check_parallelism(2, fsdp=kind == "fsdp", deepspeed=kind == "deepspeed")
    check_parallelism(1, fsdp=kind == "fsdp", deepspeed=kind == "deepspeed")  # one process: nothing to shard
    check_parallelism(2, fsdp=False, deepspeed=False)  # DDP


def test_a_ranks_share_of_the_order_is_followed_unless_accelerate_splits_each_batch():
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler

    from supervisor.integrations.transformers import TrainerSetupError, _check_loader, _Holder

    batches = BatchSampler(SequentialSampler(range(16)), 4, drop_last=False)
    shard = BatchSamplerShard(batches, num_processes=2, process_index=1)
    assert _check_loader(_Holder(shard)) is shard  # each rank's order is its shard of the Trainer's
    split = BatchSamplerShard(batches, num_processes=2, process_index=1, split_batches=True)
    with pytest.raises(TrainerSetupError, match="split_batches=True"):
        _check_loader(_Holder(split))
    drawn = BatchSamplerShard(BatchSampler(RandomSampler(range(16)), 4, drop_last=False), 2, 0)
    with pytest.raises(TrainerSetupError, match="sampler is RandomSampler"):
        _check_loader(_Holder(drawn))  # a sampler without set_epoch: refused in a shard as alone
