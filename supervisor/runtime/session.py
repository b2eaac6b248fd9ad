"""The training-side API: a few lines in the user's loop attach it to the supervisor."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient

from supervisor import exitcodes
from supervisor.runtime.metrics import AsyncMetricLogger
from supervisor.runtime.plan import LaunchPlan, load_plan

log = logging.getLogger("rollback_supervisor.session")


class Session:
    """One training segment under supervision (or stand-alone on local defaults).

    Not thread-safe: call it from the training loop's thread. `log()` never blocks on the network.
    """

    def __init__(self, plan: LaunchPlan, *, config: dict[str, Any] | None = None, run_name: str = "train"):
        self.plan = plan
        self.config = dict(config or {})
        self.run_name = run_name
        self.exit_code = exitcodes.EXIT_OK
        self.step = 0
        self._stateful: dict[str, Any] = {}
        self._last_metrics: dict[str, float] = {}
        self._stop_signal: int | None = None
        self._old_handlers: dict[int, Any] = {}
        Path(plan.workdir).mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=plan.tracking_uri)
        self.run_id = plan.run_id or self._start_run()
        self._metrics = AsyncMetricLogger(self._client, self.run_id)

    @classmethod
    def attach(
        cls,
        *,
        config: dict[str, Any] | None = None,
        workdir: Path | None = None,
        policy: Path | None = None,
        run_name: str = "train",
    ) -> Session:
        """Attach to the supervisor's launch plan (env `ROLLBACK_SUPERVISOR_PLAN`), or run stand-alone."""
        return cls(load_plan(run_name, workdir, policy), config=config, run_name=run_name)

    def _start_run(self) -> str:
        exp = self._client.get_experiment_by_name(self.plan.experiment)
        exp_id = exp.experiment_id if exp else self._client.create_experiment(self.plan.experiment)
        run = self._client.create_run(
            exp_id, run_name=self.run_name, tags={"rollback.lineage": self.plan.lineage}
        )
        params = {k: str(v)[:500] for k, v in self.config.items()}
        if params:
            self._client.log_batch(
                run.info.run_id, params=[mlflow.entities.Param(k, v) for k, v in params.items()]
            )
        return run.info.run_id

    # -- registration -------------------------------------------------------------------------

    def register(self, **stateful: Any) -> None:
        """Register named objects with `state_dict()`/`load_state_dict()` (model, optimizer, scheduler, data)."""
        for name, obj in stateful.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"register({name}=...): expected an object with state_dict()/load_state_dict()"
                )
            self._stateful[name] = obj

    # -- the loop -----------------------------------------------------------------------------

    def loop(self, loader: Iterable, *, max_steps: int) -> Iterator[tuple[int, Any]]:
        """Yield `(step, batch)` from the restored position until `max_steps`, handling epochs."""
        iterator = iter(loader)
        while self.step < max_steps and self._stop_signal is None:
            try:
                batch = next(iterator)
            except StopIteration:
                iterator = iter(loader)
                continue
            self.step += 1
            yield self.step, batch
            self._after_step()
        if self._stop_signal is not None:
            self.exit_code = exitcodes.EXIT_PREEMPTED

    def log(self, **metrics: float) -> None:
        """Log metrics at the current step (asynchronously)."""
        self._last_metrics.update(metrics)
        self._metrics.log(metrics, self.step)

    def _after_step(self) -> None:
        pass

    # -- lifecycle ----------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._stop_signal = signum

    def __enter__(self) -> Session:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        if exc_type is not None and self.exit_code == exitcodes.EXIT_OK:
            self.exit_code = exitcodes.EXIT_FAILED
        self.close()

    def close(self) -> None:
        self._metrics.close()
        status = "FINISHED" if self.exit_code == exitcodes.EXIT_OK else "KILLED"
        if not self.plan.supervised:
            self._client.set_terminated(self.run_id, status=status)
        log.info(
            "segment done: %s (exit %d, pid %d)",
            exitcodes.DESCRIPTIONS.get(self.exit_code),
            self.exit_code,
            os.getpid(),
        )
        self._closed_at = time.time()
