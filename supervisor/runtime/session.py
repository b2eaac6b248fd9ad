"""The training-side API: a few lines in the user's loop attach it to the supervisor."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data

from supervisor import exitcodes
from supervisor.checkpoint import CheckpointInfo
from supervisor.errors import UserError
from supervisor.runtime.actions import Action, Rollback, SaveDue
from supervisor.runtime.core import TrainingCore
from supervisor.runtime.distributed import Distributed, job_plan
from supervisor.runtime.plan import LaunchPlan
from supervisor.runtime.seams import CheckpointReader, CheckpointStore, Collective, MetricsLogger
from supervisor.runtime.wiring import load_session_policy
from supervisor.state import TrainingState

if TYPE_CHECKING:
    from policies import History
    from policies.plain import PolicyView
    from policies.schema import Policy

log = logging.getLogger("rollback_supervisor.session")


class Session:
    """One training segment under supervision (or stand-alone on local defaults): a loop over a TrainingCore.

    Not thread-safe: call it from the training loop's thread. `log()` never blocks on the network;
    checkpoint writes happen in the background (only the host-memory snapshot blocks a step). Use it as a
    context manager: `__enter__` opens the store and routes SIGTERM/SIGUSR2 to it, `__exit__` closes it.
    Under torchrun see `TrainingCore` for what each rank does.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        config: dict[str, Any] | None = None,
        run_name: str = "train",
        dist: Collective | None = None,
    ):
        self.plan = plan
        self.dist = dist
        self.config = {k: (str(v) if isinstance(v, Path) else v) for k, v in (config or {}).items()}
        self.run_name = run_name
        state = TrainingState()
        state.rank = dist.rank if dist else 0
        self._core = TrainingCore(
            plan,
            load_session_policy(plan),
            state,
            config=self.config,
            run_name=run_name,
            dist=dist,
            swaps_batches=True,  # `loop` hands a rank another rank's batch in a replay's second stage
        )
        self._step_metrics: dict[str, float] = {}  # this step's, for the detectors and the checkpoint
        self._restart_iter = False

    @classmethod
    def attach(
        cls,
        *,
        config: dict[str, Any] | None = None,
        workdir: Path | None = None,
        policy: Path | None = None,
        run_name: str = "train",
    ) -> Session:
        """Attach to the supervisor's launch plan (env `ROLLBACK_SUPERVISOR_PLAN`), or run stand-alone.

        Under torchrun, call `dist.init_process_group()` first; a stand-alone run then uses rank 0's plan.
        """
        dist = Distributed.detect()
        plan = job_plan(run_name, workdir, policy, dist)
        return cls(plan, config=config, run_name=run_name, dist=dist)

    # -- views over the core -------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The last step started (the TrainingState's counter, the only one)."""
        return self._core.state.step

    @property
    def state(self) -> TrainingState:
        return self._core.state

    @property
    def manager(self) -> CheckpointStore | CheckpointReader:
        """This rank's checkpoint store: rank 0's `CheckpointManager` (a `CheckpointStore`), the other ranks' a
        read-only `CheckpointReader`. Opened on first use (it locks its directory), not when the Session is built."""
        return self._core.open_store()

    @property
    def exit_code(self) -> int:
        """What the segment exits with (read-only: the core sets it when the segment stops or fails)."""
        return self._core.exit_code

    @property
    def rollbacks_in_process(self) -> int:
        return self._core.rollbacks_in_process

    @property
    def save_failures(self) -> int:
        return self._core.failures.count

    @property
    def policy(self) -> Policy | PolicyView:
        """The lineage's policy (read-only: the segment was built from it); under a supervisor, the plan's view
        of the policy it validated."""
        return self._core.rollback.policy

    @property
    def history(self) -> History:
        """The lineage's decisions so far, in-process rollbacks of this segment included."""
        return self._core.rollback.history

    @property
    def _metrics(self) -> MetricsLogger:
        return self._core.outputs.metrics

    @_metrics.setter
    def _metrics(self, metrics: MetricsLogger) -> None:
        """Tests route the metrics elsewhere (before the segment starts)."""
        self._core.outputs.metrics = metrics

    @property
    def run_id(self) -> str | None:
        """The MLflow run this segment logs to (waits for the store to open when the run is created here)."""
        if self.plan.run_id:
            return self.plan.run_id
        return self._core.outputs.metrics.connection()[1]

    # -- the user's verbs ------------------------------------------------------------------------

    def register(self, **stateful: Any) -> None:
        """Register named objects with `state_dict()`/`load_state_dict()` (model, optimizer, scheduler, data).

        A model with DTensor parameters (FSDP2's `fully_shard`) makes every rank checkpoint its own shards.
        """
        for name, obj in stateful.items():
            self._core.register(name, obj)

    def restore(self) -> CheckpointInfo | None:
        """Restore per the plan: the named checkpoint (or the latest valid), then skip batches and scale the LR."""
        info = self._core.restore()
        self._restart_iter = True
        return info

    def loop(self, loader: Iterable, *, max_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield `(step, batch)` from the restored position until `max_steps`, handling epochs and rollbacks."""
        _check_loop_loader(loader, self._core.registered.loader)
        if not self._core.restored:
            self.restore()
        iterator = None
        while self.step < max_steps and self._core.stopping() is None:
            if iterator is None or self._restart_iter:
                iterator, self._restart_iter = iter(loader), False
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = None
                self.state.epoch += 1
                continue
            batch = self._core.batch_for_step(batch)  # another rank's, in a replay's second stage
            self.state.step += 1
            self._step_metrics = {}
            yield self.step, batch
            self.state.samples_seen += _batch_len(batch)
            self._after_step(max_steps)
        if self._core.stopping() is not None:
            self._emergency_stop()
        elif self.exit_code == exitcodes.EXIT_OK and not (
            self._save(self.step, force=True) and self._core.wait()
        ):
            self._core.fail(
                f"the final checkpoint at step {self.step} was not written; the supervisor decides"
            )

    def log(self, **metrics: float) -> None:
        """Log metrics at the current step (asynchronously) and feed them to the in-process detectors."""
        self._step_metrics.update(metrics)
        self._core.log(metrics)

    def request_stop(self, reason: str, *, checkpoint: bool = False) -> None:
        """Stop after this step, with an emergency checkpoint first if `checkpoint` (exit 75, else 3)."""
        self._core.request_stop(reason, checkpoint=checkpoint)

    # -- the driver's steps (subclasses may wrap them: the benchmarks time them) ------------------

    def _after_step(self, max_steps: int) -> Action:
        action = self._core.step_ended(self.step, self._step_metrics, final=self.step >= max_steps)
        if isinstance(action, SaveDue):
            self._save(action.step)
        elif isinstance(action, Rollback):
            self._restart_iter = True
        return action

    def _save(self, step: int, *, force: bool = False) -> bool:
        return self._core.save(step, self._step_metrics, force=force)

    def _emergency_stop(self) -> None:
        stop = self._core.stopping()
        if stop is None:
            return
        if not stop.checkpoint:
            self._core.stopped(stop)
            return
        t0 = time.monotonic()
        saved = self._save(self.step) and self._core.wait()  # a no-op save when this step was just saved
        self._core.stopped(stop, saved=saved, seconds=time.monotonic() - t0)

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> Session:
        # Handlers first: installing them fails off the main thread, and then `__exit__` never runs to close
        # what `start()` would have opened.
        self._core.install_signal_handlers()
        try:
            self._core.start()
        except BaseException:
            self._core.fail()  # failed: the other ranks are not waited for on the way out
            try:
                self.close()
            finally:
                self._core.restore_signal_handlers()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:  # a user's mistake (a UserError) is recorded as 2, as the integrations do
            self._core.fail(exit_code=exc.exit_code if isinstance(exc, UserError) else exitcodes.EXIT_FAILED)
        try:
            self.close()  # a SIGTERM now (torchrun tearing ranks down) must not cut a pending save short
        finally:
            self._core.restore_signal_handlers()

    def close(self) -> None:
        self._core.close()


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    return int(first.shape[0]) if hasattr(first, "shape") and first.dim() > 0 else 1


def _check_loop_loader(loader: Any, registered: Any) -> None:
    """A torch DataLoader the session cannot checkpoint would resume at the wrong batch: refuse it up front."""
    if loader is registered or loader is getattr(registered, "loader", None):
        return
    if isinstance(loader, torch.utils.data.DataLoader):
        raise UserError(
            f"Session.loop(): the {type(loader).__name__} it iterates is not registered, so a resume would not "
            "know its position; build it with supervisor.data.ResumableLoader and register it "
            "(sess.register(..., data=loader))"
        )
