"""The training side's metric connections: the supervisor's spool, or MLflow directly.

Both are opened on the metric logger's thread. Under a supervisor that ships a spool (`plan.metrics_spool`)
the training process never imports MLflow; otherwise MLflow (the lineage's run when the plan names one, a run
of its own stand-alone) is imported only on that thread: importing it and opening a store take seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.runtime.plan import LaunchPlan


class MlflowSink:
    """Sends the logger's batches straight to an MLflow run."""

    def __init__(self, client: Any, run_id: str):
        self.client, self.run_id = client, run_id

    def send(self, points: list[tuple[str, float, int, int]]) -> None:
        from mlflow.entities import Metric

        self.client.log_batch(self.run_id, metrics=[Metric(*p) for p in points], synchronous=True)


class SpoolConnection:
    """Callable that opens the supervisor's spool for the plan's run: `(SpoolWriter, run_id)`."""

    def __init__(self, plan: LaunchPlan):
        if not plan.run_id or not plan.metrics_spool:
            raise ValueError("a spool connection needs a plan with both run_id and metrics_spool")
        self.plan = plan

    def __call__(self) -> tuple[Any, str]:
        from supervisor.spool import SpoolWriter

        return SpoolWriter(self.plan.metrics_spool), self.plan.run_id


def metric_connection(plan: LaunchPlan, run_name: str, config: dict[str, Any], policy: str) -> Any:
    """The spool when the supervisor ships one for the plan's run, else MLflow itself."""
    if plan.metrics_spool and plan.run_id:
        return SpoolConnection(plan)
    return TrackingConnection(plan, run_name, config, policy)


class TrackingConnection:
    """Callable that opens the store: `(MlflowSink, run_id)`. Stand-alone, the first call creates the run;
    connecting is retried, and a retry reuses that run instead of creating a second one."""

    def __init__(self, plan: LaunchPlan, run_name: str, config: dict[str, Any], policy: str):
        self.plan, self.run_name, self.config, self.policy = plan, run_name, config, policy
        self.own_run_id: str | None = None  # the stand-alone run this process created

    def __call__(self) -> tuple[Any, str]:
        from mlflow.tracking import MlflowClient

        if self.plan.run_id:  # the supervisor created the store
            client = MlflowClient(tracking_uri=self.plan.tracking_uri)
        else:
            from supervisor.tracking import creating_store

            with creating_store(self.plan.tracking_uri):  # a stand-alone run's store, new on the first run
                client = MlflowClient(tracking_uri=self.plan.tracking_uri)
        if self.plan.run_id:
            return MlflowSink(client, self.plan.run_id), self.plan.run_id
        if self.own_run_id is None:
            self.own_run_id = self._start_run(client)
        return MlflowSink(client, self.own_run_id), self.own_run_id

    def _start_run(self, client: Any) -> str:
        from mlflow.entities import Param

        from supervisor.tracking import start_run

        root = Path(self.plan.tracking_uri.removeprefix("sqlite:///")).parent
        run_id = start_run(
            client, self.plan.experiment, self.plan.lineage, self.policy, root, run_name=self.run_name
        )
        params = [Param(k, str(v)[:500]) for k, v in self.config.items()]
        if params:
            client.log_batch(run_id, params=params)
        return run_id
