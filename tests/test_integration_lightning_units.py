"""Fast, in-process checks of the Lightning callback: hand-written launch plans, `examples/lightning_cnn.py`'s
module, a few steps each (no supervisor process)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

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
