"""What `RollbackSupervisor` does to Lightning's loops, and the Lightning private APIs it relies on.

Lightning has no public API to move its fit loop (a skip, an in-process restore), so these helpers reach into
it. Every private attribute they read or write is listed in `PRIVATE_APIS`, and `check_private_apis()` checks
at fit start that each exists, so a Lightning release that renamed one is refused in one line instead of
silently gaining a new, unused attribute. Written against `SUPPORTED_LIGHTNING`.

| owner                         | private attribute              | use                                          |
|-------------------------------|--------------------------------|----------------------------------------------|
| every loop (fit, epoch, ...)  | `_restarting`                  | cleared after an in-process restore          |
| every loop                    | `_loaded_from_state_dict`      | cleared after an in-process restore          |
| every loop                    | `_resuming_from_checkpoint`    | cleared after an in-process restore          |
| fit loop                      | `_data_fetcher`                | restarted over the loader's restored position |
| fit loop's epoch loop         | `_skip_next_val`               | no validation for a thrown-away batch        |
| fit loop's epoch loop         | `_should_check_val_fx`         | whether validation runs after this batch     |
| trainer                       | `_val_check_time_interval`     | a time-based validation cannot be foreseen   |
| fit loop's epoch loop         | `_results`                     | the thrown-away batch's logged results       |
| trainer                       | `_logger_connector`            | its `reset_results()` and metric caches      |
| logger connector              | `_first_loop_iter`             | kept across `reset_results()`                |
| logger connector              | `_callback_metrics`, `_logged_metrics`, `_progress_bar_metrics` | the batch's values dropped |
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lightning.pytorch.loops import _Loop

from supervisor.errors import UserError
from supervisor.rng import capture_rng, restore_rng

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger("rollback_supervisor.lightning")

SUPPORTED_LIGHTNING = "lightning>=2.6,<2.7"

#: (where, attribute) for every Lightning private attribute the callback reads or writes.
PRIVATE_APIS: tuple[tuple[str, str], ...] = (
    ("fit_loop", "_restarting"),
    ("fit_loop", "_loaded_from_state_dict"),
    ("fit_loop", "_resuming_from_checkpoint"),
    ("fit_loop", "reset_restart_stage"),
    ("fit_loop", "_data_fetcher"),
    ("epoch_loop", "_restarting"),
    ("epoch_loop", "_loaded_from_state_dict"),
    ("epoch_loop", "_resuming_from_checkpoint"),
    ("epoch_loop", "_skip_next_val"),
    ("epoch_loop", "_should_check_val_fx"),
    ("trainer", "_val_check_time_interval"),
    ("epoch_loop", "_results"),
    ("epoch_loop", "scheduler_progress"),
    ("epoch_loop", "update_lr_schedulers"),
    ("trainer", "_logger_connector"),
    ("logger_connector", "_first_loop_iter"),
    ("logger_connector", "reset_results"),
    ("logger_connector", "_callback_metrics"),
    ("logger_connector", "_logged_metrics"),
    ("logger_connector", "_progress_bar_metrics"),
)


class LightningVersionError(UserError):
    """The installed Lightning lacks a private attribute the callback relies on."""


def check_private_apis(trainer: pl.Trainer) -> None:
    """Refuse a Lightning whose loops lack an attribute in `PRIVATE_APIS` (see the module docstring)."""
    import lightning

    owners = {
        "trainer": trainer,
        "fit_loop": trainer.fit_loop,
        "epoch_loop": trainer.fit_loop.epoch_loop,
        "logger_connector": getattr(trainer, "_logger_connector", None),
    }
    missing = [f"{where}.{name}" for where, name in PRIVATE_APIS if not hasattr(owners[where], name)]
    if missing:
        raise LightningVersionError(
            f"RollbackSupervisor: lightning {lightning.__version__} lacks {', '.join(missing)}, which the "
            f"callback drives; it supports {SUPPORTED_LIGHTNING}: pip install '{SUPPORTED_LIGHTNING}'"
        )


def count_skipped_batch(trainer: pl.Trainer) -> None:
    """One batch fetched and not trained on, in the fit loop's counters (as they stand at a batch's end)."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    batches = epoch_loop.batch_progress
    if batches.current.ready >= trainer.num_training_batches:  # the epoch's last batch is behind: next epoch
        batches.increment_completed()
        fit_loop.epoch_progress.increment_processed()
        fit_loop.epoch_progress.increment_completed()
        fit_loop.epoch_progress.increment_ready()
        fit_loop.epoch_progress.increment_started()
        batches.reset_on_run()
        epoch_loop.scheduler_progress.reset_on_run()
        epoch_loop.automatic_optimization.optim_progress.reset_on_run()
        batches.increment_ready()
        batches.increment_started()
        batches.increment_processed()
    else:
        batches.increment_completed()
        batches.increment_ready()
        batches.increment_started()
        batches.increment_processed()
    batches.is_last_batch = batches.current.ready >= trainer.num_training_batches
    if batches.is_last_batch:
        # What the loop does after an epoch's last batch (before that batch's end): step the epoch schedulers.
        epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)


def aligned_skip(trainer: pl.Trainer, n: int) -> int:
    """The smallest skip >= `n` after which the loop's batch position is an optimizer-step boundary.

    With `accumulate_grad_batches=k` the loop steps the optimizer when its batch position in the epoch is a
    multiple of k (or the epoch's last batch); a skip that lands elsewhere would make the next step accumulate
    fewer batches than k.
    """
    k = trainer.accumulate_grad_batches
    if k <= 1 or n <= 0:
        return n
    total = trainer.num_training_batches
    pos = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    skip = 0
    while True:
        pos = 1 if pos >= total else pos + 1
        skip += 1
        if skip >= n and (pos % k == 0 or pos >= total):
            return skip


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether the epoch loop validates right after the batch now ending (asked from `on_train_batch_end`).

    Lightning's own test, minus a time-based `val_check_interval` (its answer changes with the clock).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None or not trainer.enable_validation or epoch_loop._skip_next_val:
        return False
    if trainer._val_check_time_interval is not None:
        return False
    return bool(epoch_loop._should_check_val_fx(fetcher))


def align_batch_progress(trainer: pl.Trainer, *, batch_ended: bool) -> None:
    """After an in-process restore: the batch counters as the hook the loop is in expects them.

    A checkpoint is taken at a batch's end (the batch not yet counted completed) or after the validation
    that followed it (counted); Lightning counts the batch completed right after `on_train_batch_end`, and
    not again after `on_validation_end`.
    """
    batches = trainer.fit_loop.epoch_loop.batch_progress
    lag = 1 if batches.current.processed and batch_ended else 0
    batches.current.completed = batches.current.processed - lag
    batches.total.completed = batches.total.processed - (1 if batches.total.processed and batch_ended else 0)


def restart_data(trainer: pl.Trainer, *, keep_fetched: bool, kept: bool = True) -> None:
    """Restart the fit loop's iterator over the train loader, from the loader's (restored) position.

    `kept`: the global RNG streams are left as they were (else the loader draws from them, as its loop would).
    """
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None:
        return
    if kept:
        with rng_kept():
            iter(fetcher)
    else:
        iter(fetcher)
    if keep_fetched:  # mid-epoch: the epoch loop counts what this epoch has fetched from here
        fetcher.fetched = trainer.fit_loop.epoch_loop.batch_progress.current.ready


def settle_loops(loop: _Loop) -> None:
    """After an in-process restore: the loops go on from the restored counters, not through a restart."""
    loop._restarting = False
    loop._loaded_from_state_dict = False
    loop._resuming_from_checkpoint = False
    loop.reset_restart_stage()
    for child in vars(loop).values():
        if isinstance(child, _Loop):
            settle_loops(child)


def discard_batch(trainer: pl.Trainer, *, validated: bool = False) -> None:
    """The batch just ended was rolled back: what it logged must not reach Lightning's loggers or monitors.

    Called from `on_train_batch_end`, before Lightning moves the batch's results to its loggers
    (`update_train_step_metrics`) and runs `on_advance_end`, or (`validated`) from `on_validation_end`, after
    the validation that followed it (its results already went to the loggers). Drops the batch's values from
    the logger connector's caches, resets the epoch loop's result collection (so on-epoch aggregates start
    over from the rolled-back-to step: they cover the batches trained since), skips the validation this batch
    would have run and the plateau-scheduler step that follows it (the restored scheduler must not step on a
    thrown-away batch).
    """
    connector = trainer._logger_connector
    results = trainer.fit_loop.epoch_loop._results
    first = connector._first_loop_iter
    batch = results.metrics(on_step=True)
    for cache, kind in (
        (connector._callback_metrics, "callback"),
        (connector._logged_metrics, "log"),
        (connector._progress_bar_metrics, "pbar"),
    ):
        for key in batch[kind]:
            cache.pop(key, None)
    epoch_loop = trainer.fit_loop.epoch_loop
    if not validated:
        connector.reset_results()
        connector._first_loop_iter = first  # the loop's batch-end hooks expect a bool here
        epoch_loop._skip_next_val = True
    results.reset()
    _skip_next_plateau_step(epoch_loop)


def _skip_next_plateau_step(epoch_loop: Any) -> None:
    """Make the epoch loop's next `update_lr_schedulers("step", update_plateau_schedulers=True)` a no-op."""
    original = type(epoch_loop).update_lr_schedulers

    def once(interval: str, update_plateau_schedulers: bool) -> None:
        if interval == "step" and update_plateau_schedulers:
            del epoch_loop.update_lr_schedulers  # back to the class's method
            log.info("no ReduceLROnPlateau step for the rolled-back batch")
            return
        original(epoch_loop, interval, update_plateau_schedulers)

    epoch_loop.update_lr_schedulers = once


def after_validation(trainer: pl.Trainer, decide: Callable[[], bool]) -> None:
    """Run `decide` once every callback's and the module's `on_validation_end` has run after this batch.

    That is the epoch loop's plateau-scheduler update that follows its validation (nothing in between draws
    from the RNG streams or fetches data), so a checkpoint taken there holds what callbacks placed after ours
    (Lightning puts ModelCheckpoint last) updated after the validation. `decide` returns whether it rolled
    back; then that update is skipped, as `discard_batch` asks (the restored scheduler must not step on a
    thrown-away batch).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    original = type(epoch_loop).update_lr_schedulers

    def deferred(interval: str, update_plateau_schedulers: bool) -> None:
        # Back to the class's method, whatever happens next.
        vars(epoch_loop).pop("update_lr_schedulers", None)
        if interval == "step" and update_plateau_schedulers and decide():
            unpatch(trainer)  # the skip `discard_batch` set up is this very update
            log.info("no ReduceLROnPlateau step for the rolled-back batch")
            return
        original(epoch_loop, interval, update_plateau_schedulers)

    epoch_loop.update_lr_schedulers = deferred


def unpatch(trainer: pl.Trainer) -> None:
    """Undo a `discard_batch` patch that its batch did not consume (an exception in between)."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if "update_lr_schedulers" in vars(epoch_loop):
        del epoch_loop.update_lr_schedulers


@contextmanager
def rng_kept() -> Iterator[None]:
    """Leave every global RNG stream as it was (a loader without a generator draws from torch's)."""
    kept = capture_rng()
    try:
        yield
    finally:
        restore_rng(kept)
