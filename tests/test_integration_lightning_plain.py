"""A plain torch `DataLoader` under the Lightning callback: resumed at the exact batch (`supervisor.integrations.order`).

`examples/lightning_cnn.py`'s module with `train_dataloader()` returning `DataLoader(shuffle=True)`, trained
through hand-written launch plans: 128 images in batches of 16 (8 batches an epoch), a checkpoint every 5 steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch

from supervisor.runtime.plan import PLAN_ENV, LaunchPlan, RestoreSpec

# Not from tests.conftest: the killed segment imports this module, and conftest drops the drill's variable.
REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(REPO / "examples"))
import lightning_cnn  # noqa: E402

POLICY = REPO / "tests" / "data" / "policies" / "lightning.yaml"

#: The killed segment: `fit_plain()` in a process of its own, per a JSON config (argv[1]) and the plan in the env.
SCRIPT = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.test_integration_lightning_plain import fit_plain
fit_plain(json.loads(sys.argv[1]))
"""


class PlainLoader(lightning_cnn.ShapesCNN):
    """The example's CNN on a plain shuffled DataLoader of 128 images (`loader` holds its extra arguments)."""

    loader: dict = {}

    def train_dataloader(self):
        options = dict(self.loader)
        if options.pop("generator", False):
            options["generator"] = torch.Generator().manual_seed(7)
        data = lightning_cnn.Shapes(self.hparams.train_size, self.hparams.seed)
        return torch.utils.data.DataLoader(data, batch_size=self.hparams.batch_size, shuffle=True, **options)


def fit_plain(
    config: dict, *callbacks: L.Callback, built: list | None = None
) -> tuple[L.Trainer, PlainLoader]:
    """Train `PlainLoader` for config["steps"] on one intra-op thread (the killed segment's and the others' alike)."""
    PlainLoader.loader = {k: config[k] for k in ("num_workers", "generator", "drop_last") if k in config}
    argv = [
        "--steps",
        str(config["steps"]),
        "--val-every",
        str(config.get("val_every", 100)),
        "--train-size",
        "128",
        "--batch-size",
        str(config.get("batch_size", 16)),
    ]
    threads = torch.get_num_threads()
    original = lightning_cnn.ShapesCNN
    lightning_cnn.ShapesCNN = PlainLoader  # build() makes the example's module by this name
    try:
        trainer, model = lightning_cnn.build(lightning_cnn.parse_args(argv))
    finally:
        lightning_cnn.ShapesCNN = original
    trainer.callbacks[:0] = list(callbacks)
    if built is not None:  # the Trainer, for a test whose fit() ends with SystemExit
        built.append(trainer)
    torch.set_num_threads(1)
    try:
        trainer.fit(model)
    finally:
        torch.set_num_threads(threads)
    return trainer, model


def plan_for(tmp_path: Path, lineage: str, n: int, policy: Path, restore: RestoreSpec | None = None) -> Path:
    """Segment `n` of `lineage` under tmp_path, per a hand-written plan; the plan's path."""
    run = tmp_path / lineage
    plan = LaunchPlan(
        lineage=lineage,
        workdir=str(run),
        checkpoint_dir=str(run / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        policy_path=str(policy),
        segment=n,
        restore=restore or RestoreSpec(),
        supervised=False,
    )
    return plan.write(tmp_path / f"plan-{lineage}-{n}.json")


@pytest.fixture
def every5(tmp_path: Path) -> Path:
    path = tmp_path / "every5.yaml"
    path.write_text(
        POLICY.read_text().replace("async: true", "async: false").replace("every_steps: 8", "every_steps: 5")
    )
    return path


def train(plan: Path, cwd: Path, config: dict, faults: str = "") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ROLLBACK_SUPERVISOR_FAULTS"}
    env[PLAN_ENV] = str(plan)
    if faults:
        env["ROLLBACK_SUPERVISOR_FAULTS"] = faults
    script = SCRIPT.format(repo=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", script, json.dumps(config)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def latest_state(checkpoints: Path) -> dict:
    """The newest checkpoint restored into a fresh module and optimizer through our store alone."""
    import lightning_cnn

    from supervisor.checkpoint import CheckpointManager, CheckpointOptions
    from supervisor.state import TrainingState

    module = lightning_cnn.ShapesCNN()
    opt = module.configure_optimizers()["optimizer"]
    state = TrainingState()
    state.register("model", module)
    state.register("optimizer", opt)
    with CheckpointManager(CheckpointOptions(directory=checkpoints, async_save=False), state) as manager:
        info = manager.restore("latest")
    return {"step": info.step, "model": module.state_dict(), "optimizer": opt.state_dict()}


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    assert a["optimizer"]["state"], "no optimizer state to compare"
    for index, slots in a["optimizer"]["state"].items():
        for key, value in slots.items():
            other = b["optimizer"]["state"][index][key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (
                index,
                key,
            )


@pytest.mark.parametrize(
    "loader",
    [{"num_workers": 0}, {"num_workers": 2, "generator": True}],
    ids=["global-rng-no-workers", "own-generator-2-workers"],
)
def test_a_plain_shuffled_loader_killed_mid_epoch_resumes_bit_identically(
    tmp_path: Path, every5: Path, monkeypatch, loader: dict
):
    """SIGKILL at step 13 (mid-epoch 2) in a process of its own; the relaunch restores checkpoint 10 (batch 2 of
    epoch 2) and ends with every model and optimizer tensor equal to an uninterrupted run's."""
    config = {"steps": 20, **loader}
    killed = train(plan_for(tmp_path, "killed", 0, every5), tmp_path, config, faults="kill@13")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert sorted(steps(tmp_path / "killed" / "checkpoints")) == [5, 10]

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLAN_ENV, str(plan_for(tmp_path, "killed", 1, every5)))
    fit_plain(config)
    monkeypatch.setenv(PLAN_ENV, str(plan_for(tmp_path, "clean", 0, every5)))
    fit_plain(config)

    assert sorted(steps(tmp_path / "killed" / "checkpoints")) == [5, 10, 15, 20]
    reference = latest_state(tmp_path / "clean" / "checkpoints")
    assert reference["step"] == 20
    assert_bit_identical(reference, latest_state(tmp_path / "killed" / "checkpoints"))


def steps(checkpoints: Path) -> list[int]:
    from supervisor.checkpoint import CheckpointManager, CheckpointOptions
    from supervisor.state import TrainingState

    with CheckpointManager(CheckpointOptions(directory=checkpoints, async_save=False), TrainingState()) as m:
        return [info.step for info in m.list()]


class BatchSpy(L.Callback):
    """Notes each step's sample indices."""

    def __init__(self):
        self.seen: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen[trainer.global_step + 1] = batch[2].tolist()


def test_a_run_that_never_resumed_trains_on_what_it_would_without_the_supervisor(
    tmp_path: Path, every5: Path, monkeypatch
):
    """Same batches at every step and the same final weights, bit for bit: the callback's sampler hands out the
    loader's own order and the global RNG streams see the same draws (the shuffle, the workers' base seed)."""
    from supervisor.integrations.lightning import RollbackSupervisor

    config = {"steps": 20, "val_every": 6, "drop_last": False}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLAN_ENV, str(plan_for(tmp_path, "never", 0, every5)))
    spy = BatchSpy()
    _, model = fit_plain(config, spy)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    monkeypatch.delenv(PLAN_ENV)
    plain_spy = BatchSpy()
    real_fit = L.Trainer.fit

    def unsupervised(trainer, module, *args, **kwargs):
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, RollbackSupervisor)]
        return real_fit(trainer, module, *args, **kwargs)

    monkeypatch.setattr(L.Trainer, "fit", unsupervised)
    _, plain_model = fit_plain(config, plain_spy)
    assert sorted(spy.seen) == list(range(1, 21)) and spy.seen == plain_spy.seen
    assert spy.seen[1] != list(range(16))  # shuffled
    assert all(torch.equal(weights[k], v) for k, v in plain_model.state_dict().items())


def test_a_checkpoint_whose_data_position_does_not_fit_this_loader_ends_with_exit_2(
    tmp_path: Path, every5: Path, monkeypatch, capsys
):
    """Written with 8 batches an epoch, relaunched with batch_size=32 (4 an epoch): the restore refuses in one
    `error:` line, exit 2, no traceback, and the segment's core records exit 2 (a set-up mistake, not a crash)."""
    from supervisor.integrations.lightning import RollbackSupervisor

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(PLAN_ENV, str(plan_for(tmp_path, "resized", 0, every5)))
    fit_plain({"steps": 5})
    capsys.readouterr()

    monkeypatch.setenv(PLAN_ENV, str(plan_for(tmp_path, "resized", 1, every5)))
    built: list[L.Trainer] = []
    with pytest.raises(SystemExit) as exited:
        fit_plain({"steps": 10, "batch_size": 32}, built=built)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert line == (
        "error: data.batches_per_epoch: the checkpoint was written with 8 batches per epoch, this train loader has "
        "4; resume with the dataset, batch_size and drop_last it was written with"
    )
    (callback,) = [c for c in built[0].callbacks if isinstance(c, RollbackSupervisor)]
    assert callback.core.exit_code == 2
    assert steps(tmp_path / "resized" / "checkpoints") == [5]  # nothing written by the refused segment
