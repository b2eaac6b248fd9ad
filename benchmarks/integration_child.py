"""Child processes of `bench rollback --integration`: the examples under our callbacks, and their frameworks' resumes.

Each child runs the example itself (examples/lightning_cnn.py, examples/hf_tiny_gpt.py) through its own
`build()` and `fit()`/`train()`; subclasses of the callbacks add clocks only. A `--size` above `tiny` widens
the example's model (the same module, Trainer and data; see SIZES).

`prepare`: trains under our callback to step AT_STEP and stops there, with our checkpoint of that step and
the framework's own of the same state: `trainer.save_checkpoint()` at the end of that batch (Lightning), the
Trainer's `save_strategy="steps"` checkpoint directory (HF).

`inprocess` (Lightning): the fault drill poisons step 3 + 2i (`nan@K`); the next step's loss is NaN, the
callback's core rolls back in process from the memory ring, and Lightning goes on. Measured per anomaly: from
the end of the anomalous step (the detector runs right after it) to the end of the first resumed step.

`relaunch`: a fresh process on a plan naming the prepared checkpoint, as the supervisor would start it;
wall-clock marks at import, build, the fit/train call, the callback's restore, the first step's start and end.

With `--world-size N` (the parent's) every child is started by torchrun with N ranks (Lightning: DDP with
a plain loader, which Lightning gives a DistributedSampler; the HF Trainer: DDP through accelerate), and
rank 0 writes the results.

`framework`: a fresh process doing the framework's own resume from its own checkpoint, with the supervisor
not imported at all (its callback is replaced by a clock): `trainer.fit(model, ckpt_path=...)`,
`trainer.train(resume_from_checkpoint=...)`. The same marks, up to the end of the first resumed step.

    python -m benchmarks.integration_child prepare --integration lightning --workdir W --out W/prepare.json -- [args]
    python -m benchmarks.integration_child inprocess --integration lightning --workdir W --anomalies 3 --out ...
    python -m benchmarks.integration_child relaunch --integration lightning --out W/relaunch-0.json -- [args]
    python -m benchmarks.integration_child framework --integration lightning --checkpoint C --out ... -- [args]
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402
from typing import Any  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
INTEGRATIONS = ("lightning", "transformers")
#: integration -> the example script it runs.
EXAMPLES = {"lightning": "lightning_cnn.py", "transformers": "hf_tiny_gpt.py"}
#: The prepared checkpoint's step: mid-epoch in both examples (an epoch is 16 batches for the CNN, ~3.7k for GPT).
AT_STEP = 10
#: The benchmark's default size: a 10M-parameter model of each example, each child well under 20 s on 2 cores.
DEFAULT_SIZE = "10M"
STEPS = 1000  # the schedules' length (the same in every child); never reached
#: size -> the example's model, widened: the CNN's channel multiplier (tiny: the example's own 8 and 16
#: channels), GPT-2's (n_embd, n_layer, n_head) (tiny: the example's own 64, 2, 4).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"lightning": 1, "transformers": (64, 2, 4)},
    "small": {"lightning": 29, "transformers": (128, 5, 4)},
    "10M": {"lightning": 93, "transformers": (384, 6, 6)},
    "100M": {"lightning": 295, "transformers": (768, 14, 12)},
}
#: The metrics the policy's non-finite detector watches, per integration (the names each example logs).
WATCHED = {"lightning": "[loss]", "transformers": "[loss, grad_norm]"}
POLICY = """\
version: 1
name: bench-integration
checkpoint: {{every_steps: {every}, keep_last: 3, async: true, memory_slots: 2, storage: ./checkpoints, verify: full}}
monitor:
  poll_seconds: 1
  detectors:
    - {{type: non_finite, metrics: {watched}}}
rules:
  - when: [non_finite]
    action: rollback
    target: {{select: latest}}
limits:
  max_rollbacks: 1000
  max_restarts: 1000
  backoff: {{initial_seconds: 0, max_seconds: 0, multiplier: 1, jitter: false}}
  escalation: null
"""


def fault_spec(anomalies: int) -> str:
    """`nan@3,nan@5,...`: each fault fires once, after the rollback that undid the previous one."""
    return ",".join(f"nan@{3 + 2 * i}" for i in range(anomalies))


@dataclass(frozen=True)
class Workload:
    """One integration's example at one size: the same arguments in every child (same config, so it restores)."""

    integration: str
    size: str = DEFAULT_SIZE
    batch_size: int | None = None  # None: the example's default
    threads: int | None = None
    world_size: int = 1  # > 1: every child is started by torchrun with this many ranks (DDP, gloo)

    def example_args(self) -> list[str]:
        out = ["--steps", str(STEPS)]
        if self.integration == "lightning":
            out += ["--val-every", str(10 * STEPS)]  # no validation inside the measured steps
            if (
                self.world_size > 1
            ):  # DDP over the ranks torchrun started, each reading its share of a plain loader
                out += ["--devices", str(self.world_size), "--strategy", "ddp", "--plain-loader"]
        else:
            out += ["--cpu"]  # as the Lightning example does (accelerator="cpu"), on any machine
        if self.batch_size:
            out += ["--batch-size", str(self.batch_size)]
        return out + (["--threads", str(self.threads)] if self.threads else [])

    def options(self) -> list[str]:
        """What every child takes: the integration, the size, then the example's own arguments."""
        return ["--integration", self.integration, "--size", self.size, "--", *self.example_args()]


def write_plan(
    workdir: Path, integration: str, *, run_id: str, every: int, checkpoint_id: str | None = None
) -> Path:
    """A launch plan as `rollback-supervisor run` writes it: the lineage's MLflow run, a metric spool and the
    validated policy.

    The training process appends metrics to the spool and never imports MLflow; the benchmark (untimed) ships
    the spool afterwards. With a checkpoint id the plan restores that checkpoint.
    """
    from policies import load_policy
    from policies.plain import policy_data
    from supervisor.runtime.plan import LaunchPlan, RestoreSpec

    workdir.mkdir(parents=True, exist_ok=True)
    policy = workdir / "policy.yaml"
    policy.write_text(POLICY.format(every=every, watched=WATCHED[integration]))
    name = "plan-relaunch" if checkpoint_id else "plan"
    plan = LaunchPlan(
        lineage=f"bench-integration-{integration}",
        workdir=str(workdir),
        checkpoint_dir=str(workdir / "checkpoints"),
        tracking_uri=f"sqlite:///{workdir.parent / 'mlflow.db'}",
        run_id=run_id,
        policy_path=str(policy),
        policy=policy_data(load_policy(policy)),  # validated here, as the supervisor does
        restore=RestoreSpec(checkpoint_id=checkpoint_id),
        metrics_spool=str(workdir / "metrics" / f"{name}.jsonl"),
    )
    return plan.write(workdir / f"{name}.json")


# -- the examples, at a size ---------------------------------------------------------------------------


def load_example(integration: str, size: str, *, plain: bool = False) -> ModuleType:
    """Import the integration's example script as a module, its model widened to `size`.

    `plain`: the supervisor is not imported; its callback is replaced by `Plain`, which the framework child
    swaps for its clock (the example as it would be without the one added line).
    """
    if plain:
        _stub_supervisor(integration)
    name = EXAMPLES[integration].removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / EXAMPLES[integration])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    (_widen_cnn if integration == "lightning" else _widen_gpt)(module, SIZES[size][integration])
    return module


def _stub_supervisor(integration: str) -> None:
    if integration == "lightning":
        from lightning.pytorch import Callback

        stub = types.SimpleNamespace(RollbackSupervisor=Callback, lineage_mlflow_logger=None)
        sys.modules["supervisor.integrations.lightning"] = stub  # type: ignore[assignment]
    else:
        from transformers import TrainerCallback

        stub = types.SimpleNamespace(RollbackSupervisorCallback=TrainerCallback)
        sys.modules["supervisor.integrations.transformers"] = stub  # type: ignore[assignment]


def _widen_cnn(module: ModuleType, width: int) -> None:
    """The example's ShapesCNN with `width` times its channels (1: the example's own model)."""
    if width == 1:
        return
    import torch.nn as nn

    base = module.ShapesCNN

    class WideShapesCNN(base):  # type: ignore[misc, valid-type]
        def __init__(
            self,
            lr: float = 3e-3,
            warmup: int = 20,
            dropout: float = 0.2,
            batch_size: int = 16,
            train_size: int = 256,
            seed: int = 0,
            plain_loader: bool = False,
        ):
            super().__init__(lr, warmup, dropout, batch_size, train_size, seed, plain_loader)
            c1, c2 = 8 * width, 16 * width
            self.features = nn.Sequential(
                nn.Conv2d(1, c1, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Conv2d(c1, c2, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            )
            self.head = nn.Linear(c2 * (module.SIZE // 4) ** 2, module.CLASSES)

    module.ShapesCNN = WideShapesCNN


def _widen_gpt(module: ModuleType, dims: tuple[int, int, int]) -> None:
    """The example's GPT-2 config with (n_embd, n_layer, n_head) = `dims`."""
    n_embd, n_layer, n_head = dims
    config = module.GPT2Config

    def sized(**kwargs: Any) -> Any:
        return config(**{**kwargs, "n_embd": n_embd, "n_layer": n_layer, "n_head": n_head})

    module.GPT2Config = sized


def _training_arguments(module: ModuleType, **overrides: Any) -> None:
    """The example's TrainingArguments with `overrides` (where the Trainer writes, whether it saves)."""
    base = module.TrainingArguments

    def patched(**kwargs: Any) -> Any:
        return base(**{**kwargs, **overrides})

    module.TrainingArguments = patched


def _quiet() -> None:
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    for pattern in (".*does not have many workers.*", ".*set_vital.*", ".*treespec.*"):
        warnings.filterwarnings("ignore", pattern)


# -- prepare: our checkpoint and the framework's, same state, same step -----------------------------------


def prepare(integration: str, size: str, workdir: Path, run_id: str, argv: list[str]) -> dict[str, Any]:
    """Train to AT_STEP under our callback; both checkpoints of that step; the steps' durations."""
    from supervisor.checkpoint.catalog import open_store
    from supervisor.runtime.plan import PLAN_ENV

    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[PLAN_ENV] = str(write_plan(workdir, integration, run_id=run_id, every=AT_STEP))
    example = load_example(integration, size)
    _quiet()
    steps: list[float] = []
    if integration == "lightning":
        framework_ckpt, params = _prepare_lightning(example, workdir, argv, steps)
        framework_bytes = framework_ckpt.stat().st_size
    else:
        framework_ckpt, params = _prepare_transformers(example, workdir, argv, steps)
        framework_bytes = sum(p.stat().st_size for p in framework_ckpt.rglob("*") if p.is_file())
    ours = [i for i in open_store(workdir / "checkpoints").list() if i.step == AT_STEP]
    if not ours or not framework_ckpt.exists():
        raise SystemExit(f"prepare: no checkpoint of step {AT_STEP} (ours: {ours}, theirs: {framework_ckpt})")
    info = max(ours, key=lambda i: i.seq)
    return {
        "checkpoint_id": info.id,
        "checkpoint_step": info.step,
        "checkpoint_bytes": info.nbytes,
        "framework_checkpoint": str(framework_ckpt),
        "framework_checkpoint_bytes": framework_bytes,
        "params": params,
        "steps_s": steps,
    }


def _prepare_lightning(
    example: ModuleType, workdir: Path, argv: list[str], steps: list[float]
) -> tuple[Path, int]:
    from supervisor.exitcodes import EXIT_STOPPED

    ckpt = workdir / "lightning" / f"step={AT_STEP}.ckpt"
    base = example.RollbackSupervisor

    class Prepare(base):  # type: ignore[misc, valid-type]
        last: float | None = None

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            now = time.monotonic()
            if self.last is not None:
                steps.append(now - self.last)
            if trainer.global_step == AT_STEP:
                trainer.save_checkpoint(ckpt)  # Lightning's own, of the state our save below writes
            super().on_train_batch_end(trainer, pl_module, *args)
            if trainer.global_step == AT_STEP:
                # After our save (a stop pending at a step's end skips its periodic save): fit ends next step.
                self.core.request_stop("benchmark: prepared")
            self.last = time.monotonic()

    example.RollbackSupervisor = Prepare
    trainer, model = _build(example, "lightning", argv)
    code = _train("lightning", trainer, model)
    if code != EXIT_STOPPED:
        raise SystemExit(f"prepare (lightning): fit() ended with exit {code}, expected {EXIT_STOPPED}")
    return ckpt, _params(model)


def _prepare_transformers(
    example: ModuleType, workdir: Path, argv: list[str], steps: list[float]
) -> tuple[Path, int]:
    output = workdir / "hf-trainer"
    # The Trainer's own checkpoint at AT_STEP, as `save_strategy="steps"` writes it.
    _training_arguments(example, output_dir=str(output), save_strategy="steps", save_steps=AT_STEP)
    base = example.RollbackSupervisorCallback

    class Prepare(base):  # type: ignore[misc, valid-type]
        last: float | None = None

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.monotonic()
            if self.last is not None:
                steps.append(now - self.last)
            if state.global_step == AT_STEP:
                control.should_training_stop = True  # our final checkpoint is then AT_STEP's
            super().on_step_end(args, state, control, **kw)
            self.last = time.monotonic()

    example.RollbackSupervisorCallback = Prepare
    trainer, model = _build(example, "transformers", argv)
    code = _train("transformers", trainer, model)
    if code != 0:
        raise SystemExit(f"prepare (transformers): train() ended with exit {code}, expected 0")
    return output / f"checkpoint-{AT_STEP}", _params(model)


# -- in process (Lightning) ----------------------------------------------------------------------------


def inprocess(size: str, workdir: Path, run_id: str, anomalies: int, argv: list[str]) -> dict[str, Any]:
    """Train until `anomalies` in-process rollbacks are done; their timings and what they restored."""
    from supervisor.exitcodes import EXIT_STOPPED
    from supervisor.runtime.actions import Rollback
    from supervisor.runtime.faults import FAULTS_ENV
    from supervisor.runtime.plan import PLAN_ENV

    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[PLAN_ENV] = str(write_plan(workdir, "lightning", run_id=run_id, every=2))
    os.environ[FAULTS_ENV] = fault_spec(anomalies)
    example = load_example("lightning", size)
    _quiet()
    timed: list[dict[str, float]] = []
    steps: list[float] = []
    base = example.RollbackSupervisor

    class Timed(base):  # type: ignore[misc, valid-type]
        """Clocks around the callback's batch end: the detector, the rollback and the first resumed step."""

        prev: float | None = None
        resume: tuple[float, float] | None = None
        action: Any = None

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            super().on_fit_start(trainer, pl_module)
            core = self.core
            step_ended = core.step_ended

            def seen(*a: Any, **k: Any) -> Any:
                self.action = step_ended(*a, **k)
                return self.action

            core.step_ended = seen  # the action the callback acts on, kept for the clock

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            done = time.monotonic()
            if self.resume is not None:
                detected, restored = self.resume
                self.resume = None
                timed.append(
                    {"total_s": done - detected, "handler_s": restored - detected, "step_s": done - restored}
                )
                if len(timed) >= anomalies:
                    self.core.request_stop("benchmark done")
            elif self.prev is not None:
                steps.append(done - self.prev)
            self.action = None
            super().on_train_batch_end(trainer, pl_module, *args)
            if isinstance(self.action, Rollback):  # rolled back within that call; the loop goes on from it
                self.resume = (done, time.monotonic())
            self.prev = time.monotonic()

    example.RollbackSupervisor = Timed
    trainer, model = _build(example, "lightning", argv)
    code = _train("lightning", trainer, model)
    reports = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines() if line]
    if code != EXIT_STOPPED or len(timed) != anomalies or len(reports) != anomalies:
        raise SystemExit(
            f"in-process run: expected {anomalies} in-process rollbacks and exit {EXIT_STOPPED}, got "
            f"{len(reports)} reported, {len(timed)} timed, exit {code}; see {workdir}"
        )
    for timing, report in zip(timed, reports, strict=True):
        timing.update(
            restore_s=report["restore_s"],
            tier=report["tier"],
            target=report["decision"]["target_id"],
            target_step=report["decision"]["target_step"],
            event=report["event"]["type"],
        )
    return {"anomalies": timed, "steps_s": steps}


# -- a fresh process: our relaunch, the framework's resume -----------------------------------------------


def relaunch(integration: str, size: str, argv: list[str]) -> dict[str, Any]:
    """The example on the plan in the environment, until its first step is done; the wall-clock marks."""
    example = load_example(integration, size)
    marks: dict[str, Any] = {"started": STARTED, "imported": time.time()}
    _quiet()
    if integration == "lightning":
        base = example.RollbackSupervisor

        class Probe(base):  # type: ignore[misc, valid-type]
            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                marks["hook"] = time.time()
                super().on_fit_start(trainer, pl_module)
                marks["restored"], marks["restored_step"] = time.time(), self.core.state.step

            def on_train_batch_start(self, *args: Any) -> None:
                marks.setdefault("step_start", time.time())
                super().on_train_batch_start(*args)

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                marks["done"], marks["step"] = time.time(), trainer.global_step
                self.core.request_stop("benchmark done")
                super().on_train_batch_end(trainer, *args)

        example.RollbackSupervisor = Probe
    else:
        _training_arguments(example, output_dir=str(Path.cwd() / "hf-trainer"))
        base = example.RollbackSupervisorCallback

        class HFProbe(base):  # type: ignore[misc, valid-type]
            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                marks["hook"] = time.time()
                super().on_train_begin(args, state, control, **kw)
                marks["restored"], marks["restored_step"] = time.time(), state.global_step

            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                marks.setdefault("step_start", time.time())
                super().on_step_begin(args, state, control, **kw)

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                marks["done"], marks["step"] = time.time(), state.global_step
                self.core.request_stop("benchmark done")
                super().on_step_end(args, state, control, **kw)

        example.RollbackSupervisorCallback = HFProbe
    trainer, model = _build(example, integration, argv)
    marks["built"] = time.time()
    marks["exit"] = _train(integration, trainer, model)
    return marks


def framework(integration: str, size: str, checkpoint: Path, argv: list[str]) -> dict[str, Any]:
    """The framework's own resume from its own checkpoint, up to the end of its first step; the marks."""
    example = load_example(integration, size, plain=True)
    marks: dict[str, Any] = {"started": STARTED, "imported": time.time()}
    _quiet()
    if integration == "lightning":
        from lightning.pytorch import Callback

        class Clock(Callback):
            def __init__(self, **_: Any):
                super().__init__()

            def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
                marks["hook"] = marks["restored"] = time.time()

            def on_train_batch_start(self, *args: Any) -> None:
                marks.setdefault("step_start", time.time())

            def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
                marks["done"], marks["step"] = time.time(), trainer.global_step
                trainer.should_stop = True

        example.RollbackSupervisor = Clock
    else:
        from transformers import TrainerCallback

        _training_arguments(example, output_dir=str(Path.cwd() / "hf-trainer"))

        class HFClock(TrainerCallback):
            def __init__(self, **_: Any):
                super().__init__()

            def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                marks["hook"] = marks["restored"] = time.time()

            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                marks.setdefault("step_start", time.time())

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                marks["done"], marks["step"] = time.time(), state.global_step
                control.should_training_stop = True

        example.RollbackSupervisorCallback = HFClock
    trainer, model = _build(example, integration, argv)
    marks["built"] = time.time()
    marks["exit"] = _train(integration, trainer, model, checkpoint)
    return marks


def _build(example: ModuleType, integration: str, argv: list[str]) -> tuple[Any, Any]:
    """The Trainer and the model, as the example's `main()` builds them."""
    args = example.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if integration == "lightning":
        return example.build(args)
    example.deterministic()
    trainer = example.build(args)
    return trainer, trainer.model


#: The trainers and models of this process, kept until it leaves with os._exit (see `_leave_together`).
_KEEP: list[Any] = []


def _train(integration: str, trainer: Any, model: Any, checkpoint: Path | None = None) -> int:
    """`fit()`/`train()`, with the framework's own resume from `checkpoint` if given; the exit code."""
    _KEEP.extend((trainer, model))
    try:
        if integration == "lightning":
            trainer.fit(model, ckpt_path=None if checkpoint is None else str(checkpoint))
        else:
            trainer.train(resume_from_checkpoint=None if checkpoint is None else str(checkpoint))
    except SystemExit as exc:  # the callback ends a supervised segment with its exit code
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def _params(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    modes = {m: sub.add_parser(m) for m in ("prepare", "inprocess", "relaunch", "framework")}
    for mode, a in modes.items():
        a.add_argument("--integration", choices=INTEGRATIONS, required=True)
        a.add_argument("--size", choices=tuple(SIZES), default=DEFAULT_SIZE)
        a.add_argument("--out", type=Path, required=True)
        if mode in ("prepare", "inprocess"):
            a.add_argument("--workdir", type=Path, required=True)
            a.add_argument("--run-id", required=True)
        a.add_argument("example_args", nargs=argparse.REMAINDER)
    modes["inprocess"].add_argument("--anomalies", type=int, default=3)
    modes["framework"].add_argument("--checkpoint", type=Path, required=True)
    a = p.parse_args(argv)
    rest = [x for x in a.example_args if x != "--"]
    if a.mode == "prepare":
        result = prepare(a.integration, a.size, a.workdir.resolve(), a.run_id, rest)
    elif a.mode == "inprocess":
        if a.integration != "lightning":
            p.error("inprocess: only the Lightning integration rolls back in process")
        result = inprocess(a.size, a.workdir.resolve(), a.run_id, a.anomalies, rest)
    elif a.mode == "relaunch":
        result = relaunch(a.integration, a.size, rest)
    else:
        result = framework(a.integration, a.size, a.checkpoint, rest)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0's clocks and results
        a.out.write_text(json.dumps(result, indent=2))
    _leave_together()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave_together() -> None:
    """Under torchrun, leave the process group together once the clocks are read: a rank whose gloo pair is
    torn down by a peer that exited first can abort ("terminate called without an active exception"). The
    HF Trainer leaves its group up after train(); our callback's own group is already gone.

    The process then leaves with os._exit, its trainer and DDP model never destroyed (`_KEEP`): destroying
    a DDP Reducer drops its gloo process group with the GIL held, and the group's destructor joins a worker
    thread that may still be freeing a finished collective's tensors, which needs the GIL (pytorch#56297).
    A relaunch child of the HF Trainer under torchrun hung there once in the suite, for the test's 600 s."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
