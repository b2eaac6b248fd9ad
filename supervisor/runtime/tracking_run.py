"""The training side's MLflow connection: the lineage's run when supervised, a run of its own stand-alone.

It runs on the metric logger's thread (importing MLflow and opening a store take seconds), so MLflow is
imported only there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.runtime.plan import LaunchPlan


class TrackingConnection:
    """Callable that opens the store: `(MlflowClient, run_id)`. Stand-alone, the first call creates the run;
    connecting is retried, and a retry reuses that run instead of creating a second one."""

    def __init__(self, plan: LaunchPlan, run_name: str, config: dict[str, Any], policy: str):
        self.plan, self.run_name, self.config, self.policy = plan, run_name, config, policy
        self.own_run_id: str | None = None  # the stand-alone run this process created

    def __call__(self) -> tuple[Any, str]:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.plan.tracking_uri)
        if self.plan.run_id:
            return client, self.plan.run_id
        if self.own_run_id is None:
            self.own_run_id = self._start_run(client)
        return client, self.own_run_id

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
