"""PyTorch Lightning under supervision: `Trainer(callbacks=[RollbackSupervisor()])` is the one added line.

`RollbackSupervisor` drives a `TrainingCore` from Lightning's hooks, as `Session.loop()` does from its loop:

- **State.** Our store, never Lightning's `.ckpt` files (nothing here reads them, so nothing is unpickled): the
  LightningModule, the optimizer, LR schedulers and the precision plugin's grad scaler, the fit loop's
  progress (so a resume lands mid-epoch, through Lightning's own restart logic), every RNG stream, the
  train loader's position, every other callback's `state_dict()` (Timer, EarlyStopping, ModelCheckpoint), the
  datamodule's `state_dict()` and what the module's `on_save_checkpoint()` adds (see `_ExtrasPart`).
  `train_dataloader()` returns one loader: a torchdata `StatefulDataLoader` (`supervisor.data.ResumableLoader`
  is one) saves its own position; a plain torch `DataLoader` (shuffled or not, any batch size, `drop_last`,
  workers) is made resumable by `supervisor.integrations.order.PlainOrder`, which replays each epoch's order
  from the RNG state it was drawn from, so a run that never resumed draws exactly what it would without the
  callback (one over an `IterableDataset`, or with a sampler of its own, is refused; see that module). With
  `enable_checkpointing=True` (Lightning's default) Lightning still writes its own pickled `.ckpt` files: a
  warning at fit start says so; pass `Trainer(enable_checkpointing=False)`.
- **Saves** happen at the end of a training batch that stepped the optimizer, when the policy says so.
- **Restore** at fit start, per the launch plan: its checkpoint (or the latest valid one), then the skip and
  the LR scale of every optimizer and scheduler. A skip moves the loop's batch counters along with the loader,
  so the loop's epochs end where the loader's do (see `_TrainData`). With `accumulate_grad_batches=k` a skip
  is rounded up to the next batch position in the epoch that is a multiple of k (or the epoch's last batch),
  so the next optimizer step still accumulates k batches; the warning names both counts (k=2, restored 8
  batches into an epoch, a plan's skip of 3 skips 4: the first step trains on batches 12 and 13, counted
  from 0). `fit(ckpt_path=...)` is refused, but only once
  the callback runs: Lightning has already loaded (unpickled) that file by then, so do not pass it.
- **Metrics** logged with `self.log` during a training step reach the core (the in-process detectors and the
  lineage's MLflow run) at that step. When validation runs after a batch (`val_check_interval`, an epoch's
  end), that step's decision (detectors, a due save, a rollback) waits for the validation, as Lightning's
  ModelCheckpoint does: the detectors see the step's val metrics with its training metrics, and its checkpoint
  carries both and is taken after every callback's and the module's `on_validation_end` (so what a callback
  placed after ours, or Lightning's ModelCheckpoint, which it always puts last, updates there is in it), at
  the loop's plateau-scheduler update that follows (the RNG streams as the next training step finds them; a
  relaunch from it resumes through Lightning's own "restarted after validation" path, without validating
  again). A time-based `val_check_interval` cannot be told in advance: there validation metrics join the next
  step's. A user's `MLFlowLogger` logs to the lineage's run when built with `lineage_mlflow_logger()`.
- **In-process rollback.** The core rolls the state back (module, optimizers, schedulers, loop counters, RNG,
  loader, callbacks' state) at the end of a batch; the callback restarts the loop's iterator over the loader,
  drops what the thrown-away batch logged (Lightning's loggers and callback metrics never see it, on-epoch
  aggregates start over from the restored step), skips that batch's validation and ReduceLROnPlateau step,
  and Lightning goes on as if the restored batch had just ended. Not replayed: the restored step's own step of
  a step-interval `ReduceLROnPlateau`, which Lightning takes after the batch's end and its validation, where
  the checkpoint was taken (a relaunch misses it too, as Lightning's own resume from such a checkpoint does):
  such a scheduler counts one step fewer per restore. A rollback decided after validation comes
  after Lightning has handed that batch's metrics to its loggers (each `log_every_n_steps`) and the
  validation's to its loggers and callbacks; the callbacks' state is rolled back with the rest.
- **Stops.** SIGTERM or a preemption notice: an emergency checkpoint, then `fit()` ends with `SystemExit(75)`;
  SIGUSR2: `SystemExit(3)`; an anomaly left to the supervisor: `SystemExit(76)` (Lightning's own SIGTERM
  handling also ends `fit()` with a `SystemExit`). A run that finishes returns from `fit()` normally.

- **Several processes.** `strategy="ddp"` (a `DDPStrategy`, started by Lightning's own launcher, which runs
  the script again for each other local rank, or by torchrun/SLURM) and `ModelParallelStrategy` (FSDP2:
  `fully_shard` in `configure_model()`) run under the `TrainingCore`'s DDP machinery, as `Session` does under
  torchrun: rank 0 writes the replicated state with every rank's RNG streams and data position (a plain loader
  with Lightning's `DistributedSampler` included), FSDP2's DTensor state goes through the sharded store (each
  rank its own shards, one commit), one `all_reduce` per step agrees on stops, saves and anomalies, and an
  anomaly is rolled back in process on every rank (`tests/test_lightning_ddp.py`, `test_lightning_fsdp.py`).

Stand-alone (no plan in the environment) it runs on local defaults, as `Session.attach` does (every rank on
rank 0's). Refused, with a message saying why (one `error:` line, exit 2): other strategies over several
processes (`ddp_spawn`/`ddp_fork`, whose ranks the supervisor cannot signal or relaunch as one group; FSDP1's
`FSDPStrategy`; DeepSpeed; XLA), manual optimization (not supported yet; so neither is more
than one optimizer, which Lightning allows only there), `reload_dataloaders_every_n_epochs`, a
`limit_train_batches` that cuts the loader's epochs short, a second `fit()` with the same callback, and a
Lightning outside `lightning>=2.6,<2.7` whose loops lack a private attribute the callback drives (listed in
`supervisor.integrations.lightning_loops`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from supervisor import exitcodes
from supervisor.data import loader_part
from supervisor.errors import UserError
from supervisor.flatten import flatten
from supervisor.integrations.lightning_loops import (
    after_validation,
    align_batch_progress,
    aligned_skip,
    check_private_apis,
    count_skipped_batch,
    discard_batch,
    restart_data,
    rng_kept,
    settle_loops,
    unpatch,
    validation_follows,
)
from supervisor.integrations.order import PlainOrder, check_plain, deferred_iterators, is_plain
from supervisor.rng import capture_rng, restore_rng
from supervisor.runtime.actions import Rollback, SaveDue, Stop
from supervisor.runtime.core import TrainingCore
from supervisor.runtime.distributed import Distributed, job_plan
from supervisor.runtime.wiring import load_session_policy
from supervisor.state import TrainingState

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger("rollback_supervisor.lightning")


class LightningSetupError(UserError):
    """The Trainer is set up in a way the supervisor cannot resume exactly."""


class RollbackSupervisor(Callback):
    """A Lightning callback that puts `trainer.fit()` under rollback-supervisor (see the module docstring).

    `workdir` and `policy` apply stand-alone only (a supervised run takes both from its launch plan);
    `config` defaults to the LightningModule's hyperparameters. Not thread-safe: Lightning calls it from its
    training thread.
    """

    def __init__(
        self,
        *,
        workdir: Path | str | None = None,
        policy: Path | str | None = None,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ):
        self.workdir = Path(workdir) if workdir else None
        self.policy = Path(policy) if policy else None
        self.run_name = run_name
        self.config = config
        self.core: TrainingCore | None = None
        self._data: _TrainData | None = None
        self._metrics = _NewMetrics()
        self._carry: dict[str, float] = {}  # validation metrics no step waited for, joined to the next step's
        self._pending: _Pending | None = None  # a step whose decision waits for its validation
        self._last: dict[str, float] = {}  # the last step's metrics, for the final checkpoint
        self._rng_after_restore: dict[str, Any] | None = None
        self._signals = False
        self._closed = False
        self._used = False  # one fit() per callback

    # -- fit start: build, register, restore --------------------------------------------------

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Set-up and restore refuse a user's mistake the same way: one `error:` line, exit 2, no traceback.
        with _user_errors():
            if self._used:
                raise LightningSetupError(
                    "RollbackSupervisor: this callback already supervised a trainer.fit(); a second fit() would "
                    "checkpoint the trained model as step 0 of a new segment; build a new Trainer and "
                    "RollbackSupervisor for each fit()"
                )
            check_private_apis(trainer)
            _check_trainer(trainer, pl_module)
            _warn_lightning_checkpoints(trainer)
            # The loop builds the train loader now rather than at its start, so the restore below reaches it; a
            # plain loader's first iterator is opened at on_train_start, where the loop would open it.
            with deferred_iterators():
                trainer.fit_loop.setup_data()
            self._data = _TrainData(trainer, _train_loader(trainer))
            run_name = self.run_name or _class_name(pl_module)
            # Lightning's strategy has set up the process group by now: our collectives get a group of their own.
            dist = Distributed.detect() if trainer.world_size > 1 else None
            plan = job_plan(run_name, self.workdir, self.policy, dist)
            config = self.config if self.config is not None else _hparams(pl_module)
            state = _LightningState()
            state.rank = dist.rank if dist is not None else 0
            self._used = True
            self.core = core = TrainingCore(
                plan, load_session_policy(plan), state, config=config, run_name=run_name, dist=dist
            )
            self._closed = False
            try:
                self._register(trainer, pl_module)
                _check_mlflow_loggers(trainer, plan.run_id)
                info = core.restore()
            except BaseException as exc:
                core.fail(exit_code=exc.exit_code if isinstance(exc, UserError) else exitcodes.EXIT_FAILED)
                self._close()
                raise
        if info is not None or core.plan.restore.skip_batches:
            # What the checkpoint's RNG streams hold, set again just before the first step (see on_train_start).
            self._rng_after_restore = capture_rng()

    def _register(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        core = self.core
        assert core is not None
        core.register("model", pl_module)
        for name, opt in _named("optimizer", trainer.optimizers):
            core.register(name, opt, grads_in_closure=True)
        for name, config in _named("scheduler", trainer.lr_scheduler_configs):
            core.register(name, config.scheduler)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            core.register("scaler", scaler)
        core.register("loop", _FitLoopPart(trainer))
        core.register("data", self._data)
        extras = _ExtrasPart(trainer, pl_module, self)
        try:
            flatten(
                extras.state_dict(), "lightning"
            )  # refused now, in one line, rather than at the first save
        except UserError as exc:
            raise LightningSetupError(
                f"RollbackSupervisor: a callback's state_dict(), the datamodule's state_dict() or the "
                f"LightningModule's on_save_checkpoint() holds a value the store cannot keep without pickle: {exc}"
            ) from None
        core.register("lightning", extras)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The loop is about to fetch its first batch: from the restored position, then SIGTERM is ours."""
        core = self.core
        assert core is not None
        data = self._data
        assert data is not None
        if data.plain is not None:
            if self._rng_after_restore is not None:
                restore_rng(self._rng_after_restore)
                self._rng_after_restore = None
            # A replayed epoch spends no draw; a new one draws from the restored streams, as the loop would.
            data.reopen(keep_fetched=False, draw=True)
        elif self._rng_after_restore is not None:
            restart_data(trainer, keep_fetched=False)  # the loop fetches from the loader's restored position
            # The sanity check and the loop's set-up ran since the restore; the first step must draw exactly
            # what the interrupted run would have.
            restore_rng(self._rng_after_restore)
            self._rng_after_restore = None
        # Lightning registered its SIGTERM handler after on_fit_start; ours replaces it for the run (Lightning's
        # would end fit() with its own SystemExit before the emergency checkpoint) and is undone at close.
        core.install_signal_handlers()
        self._signals = True
        if getattr(trainer, "received_sigterm", False):
            core.request_stop("SIGTERM before the first step", checkpoint=True)

    # -- steps ---------------------------------------------------------------------------------

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        core = self.core
        assert core is not None
        self._flush_pending(trainer)
        core.state.step = trainer.global_step + 1  # the step under way: the drill's faults are keyed by it
        unpatch(trainer)  # a previous rollback's one-shot patch, if its batch ended early

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        core = self.core
        assert core is not None
        core.gradients_ready(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        core = self.core
        assert core is not None
        state = core.state
        state.samples_seen += _batch_len(batch)
        step = trainer.global_step
        if step != state.step:  # accumulating gradients: no optimizer step in this batch
            state.step = step
            return
        state.epoch = trainer.current_epoch
        metrics = self._metrics.take(trainer.callback_metrics)
        core.log(metrics)
        metrics = {**self._carry, **metrics}
        self._carry = {}
        final = _final(trainer, step)
        if validation_follows(trainer):
            self._pending = _Pending(step, metrics, final)  # decided after the validation
            return
        self._decide(trainer, step, metrics, final, batch_ended=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        core = self.core
        if core is None or trainer.sanity_checking or self._closed:
            return
        metrics = self._metrics.take(trainer.callback_metrics)
        if metrics:
            core.log(metrics)
        pending, self._pending = self._pending, None
        if pending is None:  # a validation not told in advance (time-based): its metrics join the next step's
            self._carry.update(metrics)
            self._last = {**self._last, **metrics}
            return
        metrics = {**pending.metrics, **metrics}

        def decide() -> bool:
            before = core.rollbacks_in_process
            self._decide(trainer, pending.step, metrics, pending.final, batch_ended=False)
            return core.rollbacks_in_process != before

        # After every callback's on_validation_end (ours may come before theirs): their updates are checkpointed.
        after_validation(trainer, decide)

    def _decide(
        self, trainer: pl.Trainer, step: int, metrics: dict[str, float], final: bool, *, batch_ended: bool
    ) -> None:
        """The step's decision: at its batch's end, or after the validation that followed it."""
        core = self.core
        assert core is not None
        self._last = metrics
        action = core.step_ended(step, metrics, final=final)
        if isinstance(action, SaveDue):
            core.save(step, metrics)
        elif isinstance(action, Rollback):
            settle_loops(trainer.fit_loop)
            align_batch_progress(trainer, batch_ended=batch_ended)
            assert self._data is not None
            self._data.reopen(keep_fetched=True, draw=False)
            discard_batch(trainer, validated=not batch_ended)  # its logs, validation and plateau step
            log.warning(
                "in-process rollback to %s: Lightning resumes at step %d (skipped %d batches, lr x%g)",
                action.target_id,
                action.step,
                action.skip_batches,
                action.lr_scale,
            )
        stop = action if isinstance(action, Stop) else core.stopping()
        if stop is not None:
            self._stop(stop, metrics)

    def _flush_pending(self, trainer: pl.Trainer) -> None:
        """A step waited for a validation that did not run (none was due after all): decide it now."""
        pending, self._pending = self._pending, None
        if pending is not None:
            log.info(
                "step %d: the validation expected after it did not run; deciding without it", pending.step
            )
            self._decide(trainer, pending.step, pending.metrics, pending.final, batch_ended=False)

    # -- the end -------------------------------------------------------------------------------

    def _stop(self, stop: Stop, metrics: dict[str, float]) -> None:
        """Carry out a stop at the end of a batch: emergency checkpoint if asked, close, leave fit()."""
        core = self.core
        assert core is not None
        if stop.checkpoint:
            t0 = time.monotonic()
            saved = core.save(core.state.step, metrics) and core.wait()
            core.stopped(stop, saved=saved, seconds=time.monotonic() - t0)
        else:
            core.stopped(stop)
        self._close()
        raise SystemExit(core.exit_code)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._closed:
            self._flush_pending(trainer)
        self._finish()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()  # the loop may be skipped altogether (a restore at max_steps): no on_train_end then

    def _finish(self) -> None:
        """The final checkpoint, close; a code other than 0 (the final checkpoint failed) leaves fit()."""
        core = self.core
        if core is None or self._closed:
            return
        if core.exit_code == exitcodes.EXIT_OK and not (
            core.save(core.state.step, self._last, force=True) and core.wait()
        ):
            core.fail(
                f"the final checkpoint at step {core.state.step} was not written; the supervisor decides"
            )
        self._close()
        if core.exit_code != exitcodes.EXIT_OK:
            raise SystemExit(core.exit_code)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        core = self.core
        if core is None or self._closed:
            return
        if isinstance(exception, SIGTERMException):
            # A SIGTERM that reached Lightning's handler before ours was installed (the loop had not started):
            # no consistent state to save here, so the supervisor resumes from the latest checkpoint.
            core.stopped(Stop("SIGTERM", exitcodes.EXIT_PREEMPTED, checkpoint=True), saved=False)
            self._close()
            raise SystemExit(core.exit_code)  # Lightning's own exception would exit 0
        core.fail(
            exit_code=exception.exit_code if isinstance(exception, UserError) else exitcodes.EXIT_FAILED
        )
        self._close()

    def _close(self) -> None:
        core = self.core
        if core is None or self._closed:
            return
        self._closed = True
        try:
            core.close()
        finally:
            if self._data is not None:
                self._data.close()
            if self._signals:
                core.restore_signal_handlers()
                self._signals = False


# -- the registered parts Lightning owns ------------------------------------------------------


class _FitLoopPart:
    """The fit loop's progress counters (epochs, batches, optimizer and scheduler steps), not its loaders'."""

    def __init__(self, trainer: pl.Trainer):
        self._trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        state = self._trainer.fit_loop.state_dict()
        own = dict(state.get("state_dict") or {})
        own.pop("combined_loader", None)  # the train loader's position is the "data" part's (exact generator)
        return {**state, "state_dict": own}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trainer.fit_loop.load_state_dict(state)


class _ExtrasPart:
    """What Lightning's own checkpoint would hold besides the module, optimizers and loops: every other
    callback's `state_dict()` (by `state_key`: Timer, EarlyStopping, ModelCheckpoint, ...), the datamodule's
    `state_dict()`, and what the LightningModule's `on_save_checkpoint(checkpoint)` adds to a checkpoint dict
    (an EMA, a counter; `on_load_checkpoint` gets that dict back, without Lightning's own keys). Values must be
    tensors, numbers, strings, bools, None, lists, tuples or dicts: the store never pickles."""

    def __init__(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ours: Callback):
        self._trainer = trainer
        self._module = pl_module
        self._ours = ours

    def _callbacks(self) -> list[Callback]:
        return [cb for cb in self._trainer.callbacks if cb is not self._ours]

    def state_dict(self) -> dict[str, Any]:
        callbacks = {}
        for cb in self._callbacks():
            state = cb.state_dict()
            if state:
                callbacks[cb.state_key] = state
        module: dict[str, Any] = {}
        self._module.on_save_checkpoint(module)
        datamodule = getattr(self._trainer, "datamodule", None)
        out: dict[str, Any] = {"callbacks": callbacks, "module": module}
        if datamodule is not None:
            out["datamodule"] = datamodule.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state is _NO_EXTRAS:
            log.warning(
                "the checkpoint has no 'lightning' part (written before callbacks' state was checkpointed): the "
                "other callbacks, the datamodule and on_load_checkpoint() start fresh"
            )
            return
        saved = state.get("callbacks") or {}
        log.info(
            "restored the state of callbacks %s%s and the LightningModule's on_save_checkpoint() keys %s",
            sorted(saved),
            " and the datamodule" if state.get("datamodule") else "",
            sorted(state.get("module") or {}),
        )
        for cb in self._callbacks():
            if cb.state_key in saved:
                cb.load_state_dict(saved[cb.state_key])
        datamodule = getattr(self._trainer, "datamodule", None)
        if datamodule is not None and state.get("datamodule"):
            datamodule.load_state_dict(state["datamodule"])
        self._module.on_load_checkpoint(dict(state.get("module") or {}))


_NO_EXTRAS: dict[
    str, Any
] = {}  # what a checkpoint without the "lightning" part restores (compared by identity)


class _LightningState(TrainingState):
    """The training state, where a checkpoint written before the "lightning" part existed (22da26f) still
    restores: that part alone starts fresh (logged)."""

    def load_state_dict(self, nested: dict[str, Any], *, prefixes: Any = None) -> None:
        if prefixes is None and "lightning" in self.names and "lightning" not in nested and "model" in nested:
            nested = {**nested, "lightning": _NO_EXTRAS}
        super().load_state_dict(nested, prefixes=prefixes)


class _Pending:
    """A step whose decision waits for the validation that runs after its batch."""

    def __init__(self, step: int, metrics: dict[str, float], final: bool):
        self.step, self.metrics, self.final = step, metrics, final


class _TrainData:
    """The train loader's position (a plain DataLoader's `PlainOrder`, else its registered form,
    `supervisor.data.loader_part`), and a skip that moves Lightning's loop along with it.

    Skipping `n` batches advances the loader and the fit loop's batch counters together, as if the batches had
    been fetched and not trained on: the loop's epoch then ends where the loader's does, and a skip past an
    epoch's end starts the next epoch (stepping the epoch-interval LR schedulers the passed end would have
    stepped; that end's other hooks and an epoch-end validation do not run). The global RNG streams are left
    as they were.
    """

    def __init__(self, trainer: pl.Trainer, loader: Any):
        self._trainer = trainer
        self.plain: PlainOrder | None = None
        if is_plain(loader):
            epoch_loop = trainer.fit_loop.epoch_loop
            self.plain = PlainOrder(
                loader,
                fetched=lambda: epoch_loop.batch_progress.current.ready,
                epoch_now=lambda: trainer.fit_loop.epoch_progress.current.processed,
            )
            self.plain.install()
            _explain_plain(loader, self.plain)
        self.part = self.plain if self.plain is not None else loader_part("data", loader)
        self.batches_skipped = 0

    def reopen(self, *, keep_fetched: bool, draw: bool) -> None:
        """Restart the loop's iterator over the loader from its loaded position (see `PlainOrder.reopen`)."""
        if self.plain is None:
            restart_data(self._trainer, keep_fetched=keep_fetched)
            return
        self.plain.reopen(
            lambda kept: restart_data(self._trainer, keep_fetched=keep_fetched, kept=kept), draw=draw
        )

    def close(self) -> None:
        if self.plain is not None:
            self.plain.uninstall()

    def state_dict(self) -> dict[str, Any]:
        return self.part.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.part.load_state_dict(state)

    def skip_batches(self, n: int) -> None:
        skip = getattr(self.part, "skip_batches", None)
        if skip is None:
            raise LightningSetupError(
                f"the plan asks to skip {n} batches, but the train loader ({type(self.part).__name__}) cannot "
                "skip; return a torchdata StatefulDataLoader (or supervisor.data.ResumableLoader) from "
                "train_dataloader()"
            )
        aligned = aligned_skip(self._trainer, n)
        if aligned != n:
            log.warning(
                "skipping %d batches instead of the plan's %d: Trainer(accumulate_grad_batches=%d) steps the "
                "optimizer every %d batches, and a skip that ended between two steps would make the next step "
                "accumulate fewer batches",
                aligned,
                n,
                self._trainer.accumulate_grad_batches,
                self._trainer.accumulate_grad_batches,
            )
            n = aligned
        with rng_kept():
            skip(n)
        for _ in range(n):
            count_skipped_batch(self._trainer)
        self.batches_skipped += n


# -- helpers ------------------------------------------------------------------------------------


class _NewMetrics:
    """The scalar metrics logged since the last look. Lightning keeps every value logged so far and hands out a
    fresh view of each on every read; a new `self.log` call stores a new tensor, so new values are told apart by
    their storage (the views kept here keep the old storage alive, so its address is never reused meanwhile)."""

    def __init__(self) -> None:
        self._seen: dict[str, Any] = {}

    def take(self, metrics: Mapping[str, Any]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in metrics.items():
            if _same(self._seen.get(key), value):
                continue
            self._seen[key] = value
            scalar = _scalar(value)
            if scalar is not None:
                out[key] = scalar
        return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.device == b.device and a.shape == b.shape and a.data_ptr() == b.data_ptr()
    return a is b


def _scalar(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return float(value.detach().item()) if value.numel() == 1 else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _check_trainer(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    if not pl_module.automatic_optimization:
        raise LightningSetupError(
            f"RollbackSupervisor: {type(pl_module).__name__}.automatic_optimization is False; manual optimization "
            "is not supported yet (steps are told apart by trainer.global_step); use automatic optimization"
        )
    # More than one optimizer needs manual optimization: Lightning refuses it under automatic optimization.
    check_strategy(trainer.strategy, trainer.world_size)
    if trainer.reload_dataloaders_every_n_epochs:
        raise LightningSetupError(
            "RollbackSupervisor: Trainer(reload_dataloaders_every_n_epochs="
            f"{trainer.reload_dataloaders_every_n_epochs}) builds a new train loader, whose position the "
            "checkpoints would not follow; leave it at 0"
        )
    if trainer.ckpt_path is not None:
        raise LightningSetupError(
            f"RollbackSupervisor: trainer.fit(ckpt_path={trainer.ckpt_path!r}): the supervisor restores from its "
            "own checkpoint store per the launch plan; drop ckpt_path"
        )


#: The strategies a run of several processes may use: DDP started by Lightning's own launcher (it runs the
#: script again for each other local rank) or by torchrun/SLURM, and FSDP2 through `ModelParallelStrategy`.
SUPPORTED_STRATEGIES = 'strategy="ddp" (DDPStrategy) and ModelParallelStrategy (FSDP2 in configure_model())'


def check_strategy(strategy: Any, world_size: int) -> None:
    """Refuse a strategy of several processes whose state or launch the supervisor cannot follow."""
    from lightning.pytorch.strategies import (
        DDPStrategy,
        DeepSpeedStrategy,
        ModelParallelStrategy,
        XLAStrategy,
    )

    if world_size <= 1:
        return
    name = type(strategy).__name__
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, DeepSpeedStrategy | XLAStrategy):
        start = getattr(strategy, "_start_method", "popen")
        if start != "popen":
            raise LightningSetupError(
                f'RollbackSupervisor: strategy "ddp_{start}" starts its ranks with multiprocessing {start}, which '
                'the supervisor cannot stop, signal or relaunch as one group; use strategy="ddp" (Lightning runs '
                "the script again for each rank) or launch with torchrun"
            )
        return
    if isinstance(strategy, ModelParallelStrategy):
        return
    raise LightningSetupError(
        f"RollbackSupervisor: Trainer(strategy={name}) over {world_size} processes is not supported (its "
        f"state is not the module's and optimizers' own, or it is sharded in a way the store does not follow); "
        f"supported with several processes: {SUPPORTED_STRATEGIES}; FSDP1 (FSDPStrategy) and DeepSpeed are "
        "refused: use ModelParallelStrategy with fully_shard() in configure_model() for FSDP2"
    )


def _warn_lightning_checkpoints(trainer: pl.Trainer) -> None:
    if trainer.checkpoint_callbacks:
        log.warning(
            "Trainer(enable_checkpointing=True) (Lightning's default) also writes Lightning's own pickled .ckpt "
            "files; the supervisor neither needs nor reads them: pass Trainer(enable_checkpointing=False)"
        )


def _check_mlflow_loggers(trainer: pl.Trainer, run_id: str | None) -> None:
    """Say so when a user's MLFlowLogger writes to a run other than the lineage's (it works, in two places)."""
    from lightning.pytorch.loggers import MLFlowLogger

    for logger in trainer.loggers:
        if run_id and isinstance(logger, MLFlowLogger) and logger.run_id != run_id:
            log.warning(
                "the Trainer's MLFlowLogger logs to run %s, not to the lineage's run %s; build it with "
                "supervisor.integrations.lightning.lineage_mlflow_logger() to log into the lineage's run",
                logger.run_id,
                run_id,
            )


def _train_loader(trainer: pl.Trainer) -> Any:
    loader = trainer.train_dataloader
    if isinstance(loader, Mapping | list | tuple):
        raise LightningSetupError(
            f"RollbackSupervisor: train_dataloader() returned {type(loader).__name__} of loaders; it supports "
            "one StatefulDataLoader"
        )
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise LightningSetupError(
            f"RollbackSupervisor: train_dataloader() returned {type(loader).__name__}; expected a torch DataLoader "
            "or a torchdata StatefulDataLoader (or supervisor.data.ResumableLoader), whose position can be "
            "checkpointed"
        )
    if is_plain(loader):
        try:
            check_plain(loader)
        except UserError as exc:
            raise LightningSetupError(f"RollbackSupervisor: {exc}") from None
    if trainer.num_training_batches != len(loader):
        raise LightningSetupError(
            f"RollbackSupervisor: Trainer(limit_train_batches={trainer.limit_train_batches!r}) ends each epoch after "
            f"{trainer.num_training_batches} of the loader's {len(loader)} batches, so the loader's position and "
            "the loop's epochs part ways; give the loader the data you want per epoch and leave the limit at 1.0"
        )
    return loader


def _explain_plain(loader: torch.utils.data.DataLoader, order: PlainOrder) -> None:
    """Log how a plain loader is made resumable, and what stays inexact."""
    log.info(
        "train loader: a plain DataLoader (%s, %d batches an epoch); each epoch's order is noted as the RNG state "
        "it is drawn from, so a resume replays it and goes on at the exact batch",
        order.sampler_name,
        order.per_epoch,
    )
    # Lightning warns that a loader without state_dict() resumes mid-epoch unreliably; this one does not.
    warnings.filterwarnings(
        "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
    )
    if loader.num_workers > 0:
        log.warning(
            "train loader: num_workers=%d; the worker processes' RNG streams are not checkpointed, so random draws "
            "inside the dataset's __getitem__ differ after a resume (the batches' indices do not); "
            "supervisor.data.ResumableLoader saves them",
            loader.num_workers,
        )


def _final(trainer: pl.Trainer, step: int) -> bool:
    if trainer.max_steps is not None and trainer.max_steps >= 0 and step >= trainer.max_steps:
        return True
    max_epochs = trainer.fit_loop.max_epochs
    last_batch = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
    return bool(
        max_epochs is not None and max_epochs >= 0 and last_batch and trainer.current_epoch + 1 >= max_epochs
    )


def _named(prefix: str, items: list[Any]) -> list[tuple[str, Any]]:
    if len(items) == 1:
        return [(prefix, items[0])]
    return [(f"{prefix}_{i}", item) for i, item in enumerate(items)]


def _class_name(pl_module: pl.LightningModule) -> str:
    """The module's own class name: FSDP2's `fully_shard` swaps in a class of its making ("FSDP<name>")."""
    for cls in type(pl_module).__mro__:
        if not cls.__module__.startswith("torch.distributed."):
            return cls.__name__
    return type(pl_module).__name__


def _hparams(pl_module: pl.LightningModule) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in dict(getattr(pl_module, "hparams", {}) or {}).items():
        out[str(key)] = value if isinstance(value, str | int | float | bool) or value is None else str(value)
    return out


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1


@contextmanager
def _user_errors() -> Iterator[None]:
    """A setup mistake ends fit() with one line on stderr and exit 2, no traceback."""
    try:
        yield
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code) from None


def lineage_mlflow_logger(prefix: str = "lightning", **kwargs: Any) -> Any:
    """An `MLFlowLogger` that logs into the lineage's MLflow run under the supervisor (its own run stand-alone).

    Under the supervisor the launch plan names the run, and its `tracking_uri` and `run_id` override
    `kwargs`. Its keys carry `prefix` ("lightning-loss"), so they never mix with the series the supervisor
    watches (Lightning counts its logging steps from 0, the supervisor from 1). Lightning marks the run
    finished or failed when `fit()` ends; the supervisor sets the lineage's final status at its end.
    """
    from lightning.pytorch.loggers import MLFlowLogger

    from supervisor.runtime.plan import PLAN_ENV, LaunchPlan

    path = os.environ.get(PLAN_ENV)
    if path:
        plan = LaunchPlan.read(Path(path))
        if plan.run_id:
            kwargs = {**kwargs, "tracking_uri": plan.tracking_uri, "run_id": plan.run_id}
    return MLFlowLogger(prefix=prefix, **kwargs)
