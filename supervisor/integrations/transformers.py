"""The Hugging Face Trainer under supervision: `Trainer(..., callbacks=[RollbackSupervisorCallback()])`.

`RollbackSupervisorCallback` drives a `TrainingCore` from the Trainer's events, as `Session.loop()` does from
its loop:

- **State.** Our store, never the Trainer's own checkpoints (nothing here reads them, so nothing is
  unpickled): the model, the optimizer, the LR scheduler, accelerate's grad scaler if any, the `TrainerState`
  (global step, epoch, FLOs, best metric, the recent log history, the exportable callbacks' attributes) as
  JSON, every RNG stream, and the data position.
- **Restore** at `on_train_begin`, per the launch plan: its checkpoint (or the latest valid one), then it
  skips batches and scales the LR of every optimizer param group and the scheduler's base LRs
  (`supervisor.runtime.lr_scale`), so the scale survives the warm-up schedule. Do not pass
  `resume_from_checkpoint` to `train()`.
- **Data position.** The Trainer's own resume cannot be used: it works out the batches to skip from the
  global step alone (so a plan's `skip_batches` has no place in it), it must be asked for in `train()` (not
  by a callback), and it reads its checkpoint with `torch.load`. So the callback counts the batches
  consumed (skips included) and replaces the train loader's batch sampler with one that continues the
  Trainer's own shuffled order (the sampler's order for each data epoch, set with `set_epoch`) from that
  count. The Trainer's epochs then only count its loop; `state.epoch` is set back to the data's epoch after
  every step. The loader draws its worker base seed from a generator of its own, so the global torch RNG,
  restored with the rest, sees only what training draws.
- **Decisions** (anomaly, save, stop) are taken once per optimizer step, on that step's metrics: after its
  training log (`on_log`), or after its evaluation (`on_evaluate`) when one is due at that step, so the
  detectors and the checkpoint see `eval_*` too; on a step with neither, at its end, on what there is. The
  detectors see the loss only at logged steps, so the callback asks the Trainer to log every step a save may
  be due at (`control.should_log`): no checkpoint is written unchecked. With `logging_steps` above the
  policy's `checkpoint.every_steps` an anomaly between logs is first seen at the next log or save (a
  warning at the start says so); with `logging_nan_inf_filter=True` (the Trainer's default) a NaN loss is
  logged as the running average and only `grad_norm` can show it (a warning too).
- **Saves** are written at the next quiet point after the decision: the start of the next step, or the end
  of the loop. Then the RNG streams are the ones the next step will use, an evaluation at that step
  included, and the checkpoint's metrics include that evaluation.
- **Metrics** from `on_log` (loss, grad_norm, learning_rate, evaluations) go to the core's `log()`: the
  in-process detectors and the lineage's MLflow run. Every optimizer step also logs `data.batch` (the
  absolute position of its first batch in the shuffled stream, epochs laid end to end) and `data.sample`
  (that batch's first sample index), which show what a skip did.
- **No in-process rollback** (`TrainingCore(in_process_rollback=False)`). The Trainer fixes its epoch and
  step ranges before `on_train_begin` and holds the epoch's iterator (one batch ahead in accelerate, more
  with workers) inside its loop, so a callback cannot rewind it. An anomaly is reported for the supervisor
  to decide, `train()` ends with `SystemExit(76)`, and the supervisor relaunches with the plan (restore,
  skip, LR scale): one process start.
- **Stops.** SIGTERM or a preemption notice: an emergency checkpoint, then `train()` ends with
  `SystemExit(75)`; SIGUSR2: `SystemExit(3)`. The process must end with that code, so the rest of the user's
  script does not run. A run that finishes writes its final checkpoint and returns from `train()` normally;
  so does a segment restored at `max_steps` (the order hands out no batch, the loop ends without a step),
  and the user's `save_model()` or `push_to_hub()` after `train()` runs.
- **Mistakes** in the set-up (a Trainer that cannot resume exactly, a checkpoint of another epoch size, a
  second `train()`) end the process with one `error: ...` line on stderr and exit 2, no traceback.
- **Several processes** (torchrun or `accelerate launch`, DDP): accelerate hands each rank a
  `BatchSamplerShard` of the Trainer's order, which the callback follows per rank; the `TrainingCore` runs
  its DDP machinery (rank 0 writes the checkpoint with every rank's RNG streams and data position, one
  `all_reduce` per step agrees on stops, saves and anomalies, and whether a save may be due, so every rank
  asks the Trainer to log the same steps). An anomaly stops every rank for a relaunch of the group, as in
  one process (`tests/test_hf_ddp.py`).
- **Warnings** at the start for what costs without helping: the Trainer's own checkpoints
  (`save_strategy` other than "no": pickled, never read here, unbounded without `save_total_limit`) and
  `report_to` with "mlflow" (a separate MLflow run per segment; the lineage's run already has every metric).

Private APIs used, all in this one list (supported transformers: `SUPPORTED_TRANSFORMERS`). The Trainer's
counters are checked before they are set: a missing one raises `TrainerSetupError` naming that range; the
others are read with `getattr` and a fallback (the plain torch loader and optimizer, no exportable callbacks):

- `Trainer._globalstep_last_logged`, `Trainer._initial_global_step`, `Trainer._initial_num_input_tokens_seen`:
  after a restore these counters, taken before `on_train_begin` from the fresh TrainerState, are set to the
  restored values, or the first logged loss would be averaged over every step since 0;
- the calling `Trainer`, found up the stack (`sys._getframe`): callbacks are not given it;
- accelerate's `DataLoaderShard.base_dataloader` (the torch loader), whose `batch_sampler` is replaced past
  `DataLoader.__setattr__`'s guard (`object.__setattr__`) and put back at the end;
- accelerate's `AcceleratedOptimizer.optimizer` and `.scaler` (the torch optimizer and the grad scaler);
- `Trainer.callback_handler.callbacks` (the `ExportableState` callbacks whose attributes are saved).

Not exact: random draws inside the dataset's `__getitem__` (the Trainer's own resume has the same limit),
data workers' random streams, and evaluations with `eval_strategy="epoch"`, which follow the Trainer's
epochs. Refused: FSDP and DeepSpeed over several processes (DDP is supported), and a `gradient_accumulation_steps` that does not
divide the batches of an epoch (the Trainer's short last step of an epoch is counted from where its loop
started, so a resume would group batches into steps differently).

Stand-alone (no plan in the environment) it runs on local defaults, as `Session.attach` does; an anomaly then
exits 76 with nobody to relaunch.
"""

from __future__ import annotations

import atexit
import functools
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from transformers import TrainerCallback

from supervisor import exitcodes
from supervisor.errors import UserError
from supervisor.integrations.hf_data import BatchCountMismatch, DataPosition, ResumableOrder
from supervisor.integrations.hf_state import LOG_HISTORY_KEPT, TRAINER_STATE_FIELDS, TrainerStatePart
from supervisor.runtime.actions import SaveDue, Stop
from supervisor.runtime.core import TrainingCore
from supervisor.runtime.distributed import Distributed, job_plan
from supervisor.runtime.wiring import load_session_policy
from supervisor.state import TrainingState

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

    from policies.plain import PolicyView
    from policies.schema import Policy

__all__ = [
    "LOG_HISTORY_KEPT",
    "TRAINER_STATE_FIELDS",
    "BatchCountMismatch",
    "DataPosition",
    "ResumableOrder",
    "RollbackSupervisorCallback",
    "TrainerSetupError",
    "TrainerStatePart",
]

log = logging.getLogger("rollback_supervisor.transformers")

#: The transformers versions whose Trainer privates (module docstring) this callback was checked against.
SUPPORTED_TRANSFORMERS = ">=5.24,<5.25"
#: The Trainer's counters a restore sets (module docstring), with the restored value's TrainerState field.
TRAINER_COUNTERS = {
    "_globalstep_last_logged": "global_step",
    "_initial_global_step": "global_step",
    "_initial_num_input_tokens_seen": "num_input_tokens_seen",
}

#: TrainingArguments logged as the run's parameters.
CONFIG_ARGS = (
    "seed",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
)


class TrainerSetupError(UserError):
    """The Trainer is set up in a way the supervisor cannot resume exactly."""


_Event = TypeVar("_Event", bound=Callable[..., None])


def _user_errors(event: _Event) -> _Event:
    """A set-up mistake ends the process with one `error:` line on stderr and exit 2, no traceback.

    Raised inside `train()` it would otherwise end the user's script with a traceback and exit 1.
    """

    @functools.wraps(event)
    def handled(self: RollbackSupervisorCallback, *args: Any, **kwargs: Any) -> None:
        try:
            event(self, *args, **kwargs)
        except UserError as exc:
            self._abandon(exc.exit_code)
            print(f"error: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(exc.exit_code) from None

    return handled  # type: ignore[return-value]


class RollbackSupervisorCallback(TrainerCallback):
    """A `TrainerCallback` that puts `trainer.train()` under rollback-supervisor (see the module docstring).

    `workdir` and `policy` apply stand-alone only (a supervised run takes both from its launch plan); `config`
    is added to the run's parameters. One `train()` per callback. Not thread-safe: the Trainer calls it from
    its training thread.
    """

    def __init__(
        self,
        *,
        workdir: Path | str | None = None,
        policy: Path | str | None = None,
        run_name: str = "hf-trainer",
        config: dict[str, Any] | None = None,
    ):
        self.workdir = Path(workdir) if workdir else None
        self.policy = Path(policy) if policy else None
        self.run_name = run_name
        self.config = dict(config or {})
        self.core: TrainingCore | None = None
        self._position: DataPosition | None = None
        self._order: ResumableOrder | None = None
        self._loader: Any = None
        self._loader_saved: tuple[Any, Any] | None = None
        self._ended: int | None = None  # the last step that ended and was not yet decided on
        self._metrics: dict[str, float] = {}  # the last step's metrics (training log, evaluations)
        self._save_due: int | None = None
        self._stop: Stop | None = None
        self._step_start, self._step_sample = 0, -1  # the step's first batch: its position, its first sample
        self._finished = False
        self._closed = False

    # -- the Trainer's events ----------------------------------------------------------------------

    @_user_errors
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.core is not None:
            raise TrainerSetupError(
                "RollbackSupervisorCallback: train() was called a second time; a callback supervises one "
                "train() (one segment): build a new Trainer and callback for another"
            )
        _check_args(args)
        loader = kw.get("train_dataloader")
        base = getattr(loader, "base_dataloader", loader)
        inner = _check_loader(base)
        _check_accumulation(args.gradient_accumulation_steps, len(inner))
        # The Trainer (accelerate) has set up the process group by now: our collectives get a group of their own.
        dist = Distributed.detect() if args.world_size > 1 else None
        plan = job_plan(self.run_name, self.workdir, self.policy, dist)
        policy = load_session_policy(plan)
        config = {
            k: _param(v) for k, v in ({k: getattr(args, k, None) for k in CONFIG_ARGS} | self.config).items()
        }
        # The Trainer's loop cannot be rewound from a callback (module docstring): the supervisor decides.
        state_ = TrainingState()
        state_.rank = dist.rank if dist is not None else 0
        core = TrainingCore(
            plan,
            policy,
            state_,
            config=config,
            run_name=self.run_name,
            dist=dist,
            in_process_rollback=False,
        )
        self.core = core
        self._position = DataPosition(len(inner))
        trainer = _calling_trainer()
        for name, part in self._parts(state, kw, trainer):
            core.register(name, part)
        core.install_signal_handlers()
        atexit.register(self._abandon)
        core.restore()
        core.state.step = state.global_step
        core.state.epoch = self._position.epoch_of(self._position.batches)[0]
        if state.global_step:
            _set_trainer_counters(trainer, state)
        self._wrap_loader(base, inner, args.seed)
        epoch, within = self._position.epoch_of(self._position.batches)
        log.info(
            "Trainer at step %d: its shuffled order goes on at batch %d of data epoch %d (%d batches an epoch)",
            state.global_step,
            within,
            epoch,
            self._position.per_epoch,
        )
        _warn_about_args(args, state, policy)
        if state.max_steps and state.global_step >= state.max_steps:
            # The Trainer would still run a step before it checks: the order hands out no batch instead, so
            # its loop ends without a step and train() returns (the user's save_model() after it runs).
            log.info(
                "restored step %d is the last (max_steps %d): nothing to train; train() returns after the "
                "final checkpoint",
                state.global_step,
                state.max_steps,
            )
            self._need_order().ended = True
            control.should_training_stop = True

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        core = self._need()
        self._decide(control)
        if self._save_due is not None:
            core.save(self._save_due, self._metrics)
            self._save_due = None
        if self._stop is None and core.stopping() is not None:
            control.should_training_stop = True  # too late for this step, which runs; the loop ends after it
        self._metrics = {}
        self._step_start, self._step_sample = self._need_position().batches, -1
        # The step being started is the core's step until it ends (the drill's gradient faults read it).
        core.state.step = state.global_step + 1

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._consume()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        core = self._need()
        self._consume()
        position = self._need_position()
        epoch, within = position.epoch_of(position.batches)
        state.epoch = epoch + within / position.per_epoch
        core.state.step = state.global_step
        core.state.epoch = epoch
        core.log({"data.batch": float(self._step_start), "data.sample": float(self._step_sample)})
        self._ended = state.global_step
        if self._save_may_be_due(state.global_step, control):
            control.should_log = True  # the detectors see this step's loss before its checkpoint is written
        if not control.should_log and not control.should_evaluate:  # nothing more to come: decide now
            self._decide(control)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kw: Any,
    ) -> None:
        core = self._need()
        numeric = {
            k: float(v)
            for k, v in (logs or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if not numeric:
            return
        core.log(numeric)
        self._metrics.update(numeric)
        # With an evaluation due at this step, decide after it (on_evaluate), on its metrics too.
        if "loss" in numeric and self._ended == state.global_step and not control.should_evaluate:
            self._decide(control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self._ended == state.global_step:
            self._decide(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._decide(control)
        if control.should_training_stop and not self._finished:
            self._finish(state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        core = self._need()
        self._decide(control)
        if not self._finished:
            self._finish(state.global_step)
        self._close()
        if core.exit_code != exitcodes.EXIT_OK:
            # The process ends with this code (the rest of the script does not run): release the Trainer's
            # process group first, or gloo's threads can abort a rank during finalization (SIGABRT, exit -6),
            # and the supervisor would see a crash instead of the stop every rank agreed on.
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                _let_gloo_threads_finish()
                torch.distributed.destroy_process_group()
            raise SystemExit(core.exit_code)

    # -- driving the core --------------------------------------------------------------------------

    def _decide(self, control: TrainerControl) -> None:
        """Tell the core the last step ended (once) and act on its answer."""
        if self._ended is None:
            return
        core, step = self._need(), self._ended
        self._ended = None
        action = core.step_ended(step, self._metrics, final=control.should_training_stop)
        if isinstance(action, SaveDue):
            self._save_due = action.step
            action = core.stopping()
        if isinstance(action, Stop):
            self._stop = action
            control.should_training_stop = True

    def _save_may_be_due(self, step: int, control: TrainerControl) -> bool:
        """Whether `step` may be checkpointed: the last step (the final one), a stop's, or the cadence's."""
        return self._need().save_may_be_due(step, final=control.should_training_stop)

    def _finish(self, step: int) -> None:
        """The loop is over: the emergency checkpoint and the stop, or the final checkpoint."""
        core = self._need()
        self._finished = True
        stop = self._stop or core.stopping()
        if stop is not None:
            if not stop.checkpoint:
                core.stopped(stop)
                return
            t0 = time.monotonic()
            saved = core.save(step, self._metrics) and core.wait()
            core.stopped(stop, saved=saved, seconds=time.monotonic() - t0)
            return
        if core.exit_code == exitcodes.EXIT_OK and not (
            core.save(step, self._metrics, force=True) and core.wait()
        ):
            core.fail(f"the final checkpoint at step {step} was not written; the supervisor decides")

    def _consume(self) -> None:
        """One batch was trained on: advance the position (and note the step's first sample)."""
        position, order, core = self._need_position(), self._order, self._need()
        at = position.batches
        indices = order.consumed(at) if order is not None else []
        if at == self._step_start and indices:
            self._step_sample = indices[0]
        position.batches += 1
        core.state.samples_seen += len(indices)

    # -- set-up and tear-down ----------------------------------------------------------------------

    def _parts(self, state: TrainerState, kw: dict[str, Any], trainer: Trainer | None):
        model, optimizer, scheduler = kw.get("model"), kw.get("optimizer"), kw.get("lr_scheduler")
        if model is None or optimizer is None:
            raise TrainerSetupError(
                "RollbackSupervisorCallback: on_train_begin got no model or optimizer; expected the Trainer's "
                "(transformers 5.24 passes them to every callback)"
            )
        yield "model", model
        yield "optimizer", getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper: the torch one
        if scheduler is not None:
            yield "scheduler", scheduler
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None:
            yield "scaler", scaler
        exportable = []
        if trainer is not None:
            from transformers.trainer_callback import ExportableState, TrainerControl

            exportable = [
                cb
                for cb in trainer.callback_handler.callbacks
                if isinstance(cb, ExportableState) and not isinstance(cb, TrainerControl | type(self))
            ]
        yield "trainer_state", TrainerStatePart(state, exportable)
        yield "data", self._need_position()

    def _wrap_loader(self, base: Any, inner: Any, seed: int) -> None:
        self._order = ResumableOrder(inner, self._need_position())
        self._loader, self._loader_saved = base, (inner, base.generator)
        # DataLoader refuses a new batch_sampler once built; the wrapper keeps its length and its batches.
        object.__setattr__(base, "batch_sampler", self._order)
        base.generator = torch.Generator().manual_seed(seed)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._abandon)
        if self._loader is not None and self._loader_saved is not None:
            inner, generator = self._loader_saved
            object.__setattr__(self._loader, "batch_sampler", inner)
            self._loader.generator = generator
        core = self._need()
        try:
            core.close()
        finally:
            core.restore_signal_handlers()

    def _abandon(self, exit_code: int = exitcodes.EXIT_FAILED) -> None:
        """At exit after an exception escaped `train()` (or a set-up mistake: exit 2): the segment failed; close
        what it opened."""
        if self.core is not None and not self._closed:
            self.core.fail(exit_code=exit_code)
            self._close()

    def _need(self) -> TrainingCore:
        if self.core is None:
            raise TrainerSetupError(
                "RollbackSupervisorCallback: an event came before on_train_begin; pass the callback to the "
                "Trainer (callbacks=[...]) and call trainer.train()"
            )
        return self.core

    def _need_position(self) -> DataPosition:
        if self._position is None:
            self._need()
            raise AssertionError("no data position after on_train_begin")
        return self._position

    def _need_order(self) -> ResumableOrder:
        if self._order is None:
            self._need()
            raise AssertionError("no resumable order after on_train_begin")
        return self._order


def _param(value: Any) -> Any:
    value = getattr(value, "value", value)  # the Trainer's string enums
    return value if value is None or isinstance(value, int | float | str | bool) else str(value)


def _set_trainer_counters(trainer: Trainer | None, state: TrainerState) -> None:
    """Set the Trainer's counters taken before `on_train_begin` to the restored state (module docstring)."""
    import transformers

    missing = [name for name in TRAINER_COUNTERS if trainer is None or not hasattr(trainer, name)]
    if missing:
        where = (
            "no Trainer calls this callback"
            if trainer is None
            else f"the Trainer has no {', '.join(missing)}"
        )
        raise TrainerSetupError(
            f"RollbackSupervisorCallback: restored step {state.global_step}, but {where} (transformers "
            f"{transformers.__version__}); the callback supports transformers {SUPPORTED_TRANSFORMERS} called "
            "from Trainer.train(): install a supported version"
        )
    for name, field in TRAINER_COUNTERS.items():
        setattr(trainer, name, getattr(state, field))


def _warn_about_args(args: TrainingArguments, state: TrainerState, policy: Policy | PolicyView) -> None:
    """Warn, with what to set, about arguments that hide anomalies or cost without helping."""
    every = policy.checkpoint.every_steps
    logging_steps = state.logging_steps if _param(args.logging_strategy) == "steps" else None
    if every and (logging_steps is None or logging_steps > every):
        log.warning(
            "logging_strategy=%s, logging_steps=%s, checkpoint.every_steps=%d: the detectors see the training "
            "loss only at logged steps (the callback also logs every step it may checkpoint), so an anomaly "
            "between them is seen up to %s steps late; set logging_steps <= %d to see it sooner",
            _param(args.logging_strategy),
            logging_steps,
            every,
            logging_steps or "many",
            every,
        )
    if args.logging_nan_inf_filter:
        log.warning(
            "logging_nan_inf_filter=True (the Trainer's default) logs a NaN or inf loss as the running average, "
            "so the detectors see a NaN only in grad_norm and a diverging loss not at all; set "
            "logging_nan_inf_filter=False"
        )
    if _param(args.save_strategy) != "no":
        log.warning(
            "save_strategy=%s: the Trainer also writes its own checkpoints to %s (a pickled optimizer.pt, "
            "kept without limit unless save_total_limit is set); the supervisor never reads them; set "
            "save_strategy='no'",
            _param(args.save_strategy),
            args.output_dir,
        )
    if "mlflow" in (args.report_to or []):
        log.warning(
            "report_to includes 'mlflow': the Trainer's MLflowCallback opens a separate MLflow run in every "
            "segment, while the supervisor logs every metric to the lineage's one run; set report_to='none' "
            "(or leave 'mlflow' out)"
        )


def check_parallelism(world_size: int, *, fsdp: bool, deepspeed: bool) -> None:
    """Several processes are supported under DDP only, for now (TrainerSetupError saying what to drop)."""
    if world_size > 1 and (fsdp or deepspeed):
        what = "fsdp" if fsdp else "deepspeed"
        raise TrainerSetupError(
            f"RollbackSupervisorCallback: TrainingArguments({what}=...) over {world_size} processes: the "
            "callback supervises the Trainer under DDP (torchrun, accelerate launch) for now, whose model and "
            f"optimizer are whole on every rank; drop {what}= to train with DDP"
        )


def _check_args(args: TrainingArguments) -> None:
    check_parallelism(args.world_size, fsdp=bool(args.fsdp), deepspeed=bool(args.deepspeed))
    if args.auto_find_batch_size:
        raise TrainerSetupError(
            "RollbackSupervisorCallback: auto_find_batch_size restarts the loop with another batch size, which "
            "changes the data position; set per_device_train_batch_size and auto_find_batch_size=False"
        )


def _check_loader(base: Any) -> Any:
    """The train loader's batch sampler, if its order per epoch can be reproduced; else a clear error."""
    from torch.utils.data import BatchSampler, SequentialSampler

    inner = getattr(base, "batch_sampler", None)
    sharded = _unsharded(inner)
    if sharded is not inner:
        _check_loader_shard(inner)
        _check_loader(_Holder(sharded))
        return inner
    sampler = getattr(inner, "sampler", None)
    if not isinstance(inner, BatchSampler) or not (
        isinstance(sampler, SequentialSampler) or callable(getattr(sampler, "set_epoch", None))
    ):
        found = type(sampler if isinstance(inner, BatchSampler) else inner).__name__
        raise TrainerSetupError(
            f"RollbackSupervisorCallback: the train loader's sampler is {found}, whose order a resume cannot "
            "reproduce; expected a map-style dataset with the Trainer's seedable random sampler (the default, "
            "accelerator_config use_seedable_sampler=True) or train_sampling_strategy='sequential'"
        )
    return inner


class _Holder:
    """A loader-like holder of a batch sampler (what `_check_loader` reads)."""

    def __init__(self, batch_sampler: Any):
        self.batch_sampler = batch_sampler


def _unsharded(batch_sampler: Any) -> Any:
    """Under DDP accelerate gives each rank a `BatchSamplerShard` over the Trainer's batch sampler: that one."""
    from accelerate.data_loader import BatchSamplerShard

    return batch_sampler.batch_sampler if isinstance(batch_sampler, BatchSamplerShard) else batch_sampler


def _check_loader_shard(shard: Any) -> None:
    """A rank's share of every epoch must be the same batches whenever its order is replayed."""
    if shard.split_batches:
        raise TrainerSetupError(
            "RollbackSupervisorCallback: accelerator_config split_batches=True splits each batch across the "
            "ranks; the callback follows whole batches per rank: leave split_batches=False"
        )


def _check_accumulation(steps: int, per_epoch: int) -> None:
    """Every optimizer step takes `steps` batches, or a resume would group batches differently (see below)."""
    if steps > 1 and per_epoch % steps:
        raise TrainerSetupError(
            f"RollbackSupervisorCallback: gradient_accumulation_steps={steps} does not divide the {per_epoch} "
            "batches of an epoch, so the Trainer's last step of an epoch takes fewer batches, counted from where "
            "its loop started; after a resume mid-epoch it would group batches into steps differently. Use a "
            f"dataset size and batch size that give a multiple of {steps} batches per epoch (dataloader_drop_last "
            "may help), or gradient_accumulation_steps=1"
        )


def _calling_trainer() -> Trainer | None:
    """The Trainer whose `train()` is calling this callback, found up the stack."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None


#: How long the main thread lets go of the GIL before the Trainer's process group is released.
GLOO_SETTLE_SECONDS = 0.05


def _let_gloo_threads_finish() -> None:
    """Let a gloo worker thread free the tensors of the Trainer's last collective before the group can go.

    The Trainer's last all_gather (its FLOs count, just before `on_train_end`) is freed on a gloo thread, and
    freeing its tensors takes the GIL. When the DDP model is destroyed as SystemExit unwinds, its Reducer drops
    the group with the GIL held, and the group's destructor joins that thread: a deadlock (pytorch#56297) in
    which the rank never exits. Sleeping releases the GIL, so a thread still freeing can take it and finish:
    this narrows the window, it cannot close it (the destructor is torch's).
    """
    time.sleep(GLOO_SETTLE_SECONDS)
