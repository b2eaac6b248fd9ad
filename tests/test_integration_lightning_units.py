"""Fast, in-process checks of the Lightning callback: hand-written launch plans, `examples/lightning_cnn.py`'s
module, a few steps each (no supervisor process)."""

from __future__ import annotations

import copy
import logging
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from supervisor.checkpoint import CheckpointManager, CheckpointOptions
from supervisor.integrations.lightning import RollbackSupervisor
from supervisor.integrations.lightning_loops import (
    SUPPORTED_LIGHTNING,
    LightningVersionError,
    check_private_apis,
)
from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import lightning_cnn  # noqa: E402

POLICY = REPO / "tests" / "data" / "policies" / "lightning.yaml"


@pytest.fixture
def policy(tmp_path: Path) -> Path:
    """lightning.yaml with synchronous saves (every checkpoint committed when its step ends)."""
    path = tmp_path / "sync.yaml"
    path.write_text(POLICY.read_text().replace("async: true", "async: false"))
    return path


def segment(tmp_path: Path, policy: Path, monkeypatch, n: int, restore: RestoreSpec) -> Path:
    """Segment `n` of one lineage under tmp_path, per a hand-written plan; its checkpoint directory."""
    run = tmp_path / "run"
    plan = LaunchPlan(
        lineage="units",
        workdir=str(run),
        checkpoint_dir=str(run / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        policy_path=str(policy),
        segment=n,
        restore=restore,
        supervised=False,
    )
    monkeypatch.setenv(PLAN_ENV, str(plan.write(tmp_path / f"plan-{n}.json")))
    return run / "checkpoints"


def trainer_for(*argv: str, callback: RollbackSupervisor | None = None, **trainer_kwargs):
    """The example's Trainer and module (with BatchCounter); `callback` replaces its RollbackSupervisor."""
    import lightning_cnn

    trainer, model = lightning_cnn.build(lightning_cnn.parse_args(["--batch-counter", *argv]))
    if callback is not None:
        trainer.callbacks[:] = [
            callback if isinstance(c, RollbackSupervisor) else c for c in trainer.callbacks
        ]
    for key, value in trainer_kwargs.items():
        setattr(trainer, key, value)
    return trainer, model


def infos(checkpoints: Path) -> dict[int, dict[str, float]]:
    """Each committed checkpoint's metrics, by step (read through our store alone)."""
    from supervisor.state import TrainingState

    with CheckpointManager(CheckpointOptions(directory=checkpoints, async_save=False), TrainingState()) as m:
        return {info.step: info.metrics for info in m.list()}


def test_a_step_validated_after_its_batch_is_decided_and_checkpointed_with_its_val_metrics(
    tmp_path: Path, policy: Path, monkeypatch
):
    """Validation after steps 8 and 12 (the last): each checkpoint carries the val_loss the module logged at
    its own step, computed on that step's weights."""
    import lightning.pytorch as L

    class ValSpy(L.Callback):  # what Lightning hands to callbacks after each validation, by step
        def __init__(self):
            self.seen: dict[int, float] = {}

        def on_validation_end(self, trainer, pl_module):
            self.seen[trainer.global_step] = float(trainer.callback_metrics["val_loss"])

    checkpoints = segment(tmp_path, policy, monkeypatch, 0, RestoreSpec())
    trainer, model = trainer_for("--steps", "12", "--val-every", "4")
    spy = ValSpy()
    trainer.callbacks.insert(0, spy)
    trainer.fit(model)
    assert sorted(spy.seen) == [4, 8, 12]
    metrics = infos(checkpoints)
    assert sorted(metrics) == [8, 12]  # every 8 steps, and the final one
    for step in (8, 12):
        assert metrics[step]["val_loss"] == spy.seen[step] and "loss" in metrics[step]
    assert len(set(spy.seen.values())) == 3  # the weights moved: a value from another step would differ


def test_check_private_apis_names_the_missing_attribute_and_the_supported_range(tmp_path: Path):
    import lightning
    import lightning.pytorch as L

    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    check_private_apis(trainer)  # the installed Lightning has every one
    del trainer.fit_loop.epoch_loop._skip_next_val
    with pytest.raises(LightningVersionError) as refused:
        check_private_apis(trainer)
    message = str(refused.value)
    assert "epoch_loop._skip_next_val" in message and SUPPORTED_LIGHTNING in message
    assert lightning.__version__ in message and "_restarting" not in message


def test_a_checkpoint_without_the_lightning_part_restores_with_callbacks_starting_fresh(
    tmp_path: Path, policy: Path, monkeypatch, caplog
):
    """A checkpoint written before callbacks' state was checkpointed (no 'lightning' part) still restores."""

    class Before22da26f(RollbackSupervisor):
        def _register(self, trainer, pl_module):
            core = self.core
            real = core.register
            core.register = lambda name, obj, **kw: None if name == "lightning" else real(name, obj, **kw)
            try:
                super()._register(trainer, pl_module)
            finally:
                core.register = real

    checkpoints = segment(tmp_path, policy, monkeypatch, 0, RestoreSpec())
    trainer, model = trainer_for("--steps", "8", "--val-every", "100", callback=Before22da26f())
    trainer.fit(model)
    assert sorted(infos(checkpoints)) == [8]

    segment(tmp_path, policy, monkeypatch, 1, RestoreSpec())  # the latest: step 8
    trainer, model = trainer_for("--steps", "12", "--val-every", "100")
    with caplog.at_level(logging.INFO, logger="rollback_supervisor"):
        trainer.fit(model)
    assert "has no 'lightning' part" in caplog.text and "start fresh" in caplog.text
    assert trainer.global_step == 12
    counter = next(c for c in trainer.callbacks if type(c).__name__ == "BatchCounter")
    assert counter.batches == 4  # started fresh at the restored step 8
    assert sorted(infos(checkpoints)) == [8, 12]


class Samples(L.Callback):
    """Each trained batch's sample indices, in order, with the step it belongs to."""

    def __init__(self):
        self.batches: list[tuple[int, list[int]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append((trainer.global_step + 1, batch[2].tolist()))


def ids_by_step(checkpoints: Path) -> dict[int, str]:
    from supervisor.state import TrainingState

    with CheckpointManager(CheckpointOptions(directory=checkpoints, async_save=False), TrainingState()) as m:
        return {info.step: info.id for info in m.list()}


def test_a_skip_under_gradient_accumulation_is_rounded_up_to_an_optimizer_step_boundary(
    tmp_path: Path, monkeypatch, caplog
):
    """accumulate_grad_batches=2: a relaunch from step 4 (8 batches into the epoch) told to skip 3 batches skips
    4, so its first step accumulates batches 12 and 13 of the epoch, as the sample indices show."""
    every4 = tmp_path / "every4.yaml"
    every4.write_text(
        POLICY.read_text().replace("async: true", "async: false").replace("every_steps: 8", "every_steps: 4")
    )
    checkpoints = segment(tmp_path, every4, monkeypatch, 0, RestoreSpec())
    first = Samples()
    trainer, model = trainer_for("--steps", "8", "--val-every", "100", accumulate_grad_batches=2)
    trainer.callbacks.insert(0, first)
    trainer.fit(model)
    assert len(first.batches) == 16  # one epoch: 8 steps of 2 batches

    at4 = ids_by_step(checkpoints)[4]
    segment(tmp_path, every4, monkeypatch, 1, RestoreSpec(checkpoint_id=at4, skip_batches=3))
    second = Samples()
    trainer, model = trainer_for("--steps", "6", "--val-every", "100", accumulate_grad_batches=2)
    trainer.callbacks.insert(0, second)
    with caplog.at_level(logging.WARNING, logger="rollback_supervisor"):
        trainer.fit(model)
    assert "skipping 4 batches instead of the plan's 3" in caplog.text
    # Steps 5 and 6 train on batches 12-15 of the epoch (the first run's steps 7 and 8), two batches each.
    assert second.batches[:4] == [(5, first.batches[12][1]), (5, first.batches[13][1])] + [
        (6, first.batches[14][1]),
        (6, first.batches[15][1]),
    ]
    assert first.batches[12][0] == 7 and first.batches[15][0] == 8


def test_earlystopping_modelcheckpoint_and_timer_state_survive_a_relaunch(
    tmp_path: Path, policy: Path, monkeypatch
):
    """The relaunched callbacks start from the state the final checkpoint holds, which is their state at the end
    of the first segment (the Timer: its training time, which it goes on counting from)."""
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, Timer

    def builtins() -> list[L.Callback]:
        return [
            EarlyStopping(monitor="val_loss", patience=100),
            ModelCheckpoint(dirpath=tmp_path / "lightning-ckpts", monitor="val_loss", save_top_k=2),
            Timer(),
        ]

    checkpoints = segment(tmp_path, policy, monkeypatch, 0, RestoreSpec())
    trainer, model = trainer_for("--steps", "12", "--val-every", "4")
    first = builtins()
    trainer.callbacks.extend(first)
    trainer.fit(model)
    ended = {type(cb).__name__: cb.state_dict() for cb in first}
    assert len(ended["ModelCheckpoint"]["best_k_models"]) == 2 and ended["EarlyStopping"]["wait_count"] >= 0
    assert sorted(infos(checkpoints)) == [8, 12]

    class AfterRestore(L.Callback):  # runs after RollbackSupervisor's on_fit_start, which restored
        def on_fit_start(self, trainer, pl_module):
            self.states = copy.deepcopy({type(cb).__name__: cb.state_dict() for cb in second})

    segment(tmp_path, policy, monkeypatch, 1, RestoreSpec())
    trainer, model = trainer_for("--steps", "16", "--val-every", "4")
    second = builtins()
    spy = AfterRestore()
    trainer.callbacks.extend([*second, spy])
    trainer.fit(model)
    restored = spy.states
    for name in ("EarlyStopping", "ModelCheckpoint"):
        assert restored[name].keys() == ended[name].keys()
        for key, value in ended[name].items():
            if (
                key == "current_score"
            ):  # ModelCheckpoint.load_state_dict() leaves it (as Lightning's own resume)
                continue
            got = restored[name][key]
            if isinstance(value, dict):  # best_k_models: path -> score tensor
                assert got.keys() == value.keys() and all(torch.equal(got[k], v) for k, v in value.items())
            else:
                assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, (
                    name,
                    key,
                )
    # The Timer's training time at the checkpoint (taken at the first segment's end, before the Timer stopped).
    saved = restored["Timer"]["time_elapsed"]["train"]
    assert 0 < saved <= ended["Timer"]["time_elapsed"]["train"]
    assert second[2].time_elapsed("train") > saved  # it counted on from there


class Plateau(lightning_cnn.ShapesCNN):
    """The example's CNN with a step-interval ReduceLROnPlateau on the training loss instead of the warm-up."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=100)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": plateau, "monitor": "loss", "interval": "step"},
        }


def test_a_reduce_lr_on_plateau_scheduler_through_an_in_process_rollback_with_a_skip(
    tmp_path: Path, policy: Path, monkeypatch
):
    """A NaN at step 11 (onset 12) rolls back to step 8, skipping 5 batches at half the LR. The plateau scheduler
    is restored with the rest and never steps on the thrown-away batch; the optimizer's LR is halved; the data go
    on 5 batches further."""

    def fit(faults: str) -> tuple[L.Trainer, Samples]:
        monkeypatch.setattr(lightning_cnn, "ShapesCNN", Plateau)
        trainer, model = trainer_for("--steps", "16", "--val-every", "100")
        monkeypatch.setattr(lightning_cnn, "ShapesCNN", Plateau.__mro__[1])
        samples = Samples()
        trainer.callbacks.insert(0, samples)
        if faults:
            monkeypatch.setenv("ROLLBACK_SUPERVISOR_FAULTS", faults)
        trainer.fit(model)
        monkeypatch.delenv("ROLLBACK_SUPERVISOR_FAULTS", raising=False)
        return trainer, samples

    segment(tmp_path / "clean", policy, monkeypatch, 0, RestoreSpec())
    clean, clean_samples = fit("")
    segment(tmp_path / "nan", policy, monkeypatch, 0, RestoreSpec())
    trainer, samples = fit("nan@11")

    callback = next(c for c in trainer.callbacks if isinstance(c, RollbackSupervisor))
    assert callback.core.rollbacks_in_process == 1
    plateau = trainer.lr_scheduler_configs[0].scheduler
    # One plateau step fewer than the uninterrupted run: the thrown-away step 12 takes none, and the restored
    # step 8's own is not replayed (its checkpoint was taken at its batch's end, before Lightning steps plateau
    # schedulers; Lightning's own resume from such a checkpoint has the same gap: module docstring).
    assert trainer.global_step == 16
    assert plateau.last_epoch == clean.lr_scheduler_configs[0].scheduler.last_epoch - 1
    base = clean.optimizers[0].param_groups[0]["lr"]
    assert trainer.optimizers[0].param_groups[0]["lr"] == base * 0.5  # patience=100: no reduction of its own
    by_step = dict(samples.batches)  # the steps trained after the rollback replace the thrown-away ones
    clean_by_step = dict(clean_samples.batches)
    assert [by_step[s] for s in (9, 10, 11)] == [clean_by_step[s] for s in (14, 15, 16)]


class ValidationCounter(L.Callback):
    """State updated in on_validation_end (as EarlyStopping's and ModelCheckpoint's is)."""

    def __init__(self):
        self.validations = 0

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations += 1

    def state_dict(self) -> dict:
        return {"validations": self.validations}

    def load_state_dict(self, state: dict) -> None:
        self.validations = int(state["validations"])


def saved_callbacks(checkpoints: Path, step: int) -> dict:
    """The callbacks' state a checkpoint holds (its "lightning" part, read through our store alone)."""
    from supervisor.state import TrainingState

    class Saved:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            self.state = state

    checkpoint_id = ids_by_step(checkpoints)[step]
    saved = Saved()
    state = TrainingState()
    state.register("lightning", saved)
    with CheckpointManager(CheckpointOptions(directory=checkpoints, async_save=False), state) as manager:
        manager.restore(checkpoint_id)
    return saved.state["callbacks"]


def test_a_checkpoint_after_validation_holds_what_callbacks_after_ours_updated_in_on_validation_end(
    tmp_path: Path, policy: Path, monkeypatch
):
    """Validation after steps 4 and 8; checkpoint 8 is taken after it. A callback listed after RollbackSupervisor
    counts validations in on_validation_end: the checkpoint holds 2 (both), and a relaunch from it goes on from 2."""
    checkpoints = segment(tmp_path, policy, monkeypatch, 0, RestoreSpec())
    trainer, model = trainer_for("--steps", "10", "--val-every", "4")
    counter = ValidationCounter()
    trainer.callbacks.append(counter)  # after ours
    assert trainer.callbacks.index(counter) > next(
        i for i, c in enumerate(trainer.callbacks) if isinstance(c, RollbackSupervisor)
    )
    trainer.fit(model)
    assert counter.validations == 2
    assert saved_callbacks(checkpoints, 8)["ValidationCounter"] == {"validations": 2}

    segment(tmp_path, policy, monkeypatch, 1, RestoreSpec(checkpoint_id=ids_by_step(checkpoints)[8]))
    trainer, model = trainer_for("--steps", "12", "--val-every", "4")
    relaunched = ValidationCounter()
    trainer.callbacks.append(relaunched)
    trainer.fit(model)
    assert relaunched.validations == 3  # 2 restored, then step 12's (the relaunch does not validate 8 again)


@pytest.mark.parametrize(
    ("strategy", "expected"),
    [
        ("ddp_spawn", 'strategy "ddp_spawn" starts its ranks with multiprocessing spawn'),
        ("ddp_fork", 'strategy "ddp_fork" starts its ranks with multiprocessing fork'),
        ("fsdp1", "Trainer(strategy=FSDPStrategy) over 2 processes is not supported"),
    ],
)
def test_a_strategy_of_several_processes_it_cannot_follow_is_refused_saying_what_to_use(strategy, expected):
    """FSDP1's FSDPStrategy needs a GPU accelerator to be built into a Trainer, so it is checked on its own."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import FSDPStrategy

    from supervisor.integrations.lightning import LightningSetupError, check_strategy

    if strategy == "fsdp1":
        chosen = FSDPStrategy()
    else:
        chosen = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False).strategy
    with pytest.raises(LightningSetupError) as refused:
        check_strategy(chosen, 2)
    message = str(refused.value)
    assert expected in message, message
    if strategy == "fsdp1":
        assert (
            "ModelParallelStrategy" in message and "FSDP1 (FSDPStrategy) and DeepSpeed are refused" in message
        )
    else:
        assert 'use strategy="ddp"' in message and "torchrun" in message
    check_strategy(chosen, 1)  # one process: no strategy of several to follow


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_over_several_processes_are_accepted(strategy):
    import lightning.pytorch as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    from supervisor.integrations.lightning import check_strategy

    chosen = (
        ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        if strategy == "fsdp2"
        else strategy
    )
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=chosen, logger=False)
    assert trainer.world_size == 2
    check_strategy(trainer.strategy, trainer.world_size)  # no error
