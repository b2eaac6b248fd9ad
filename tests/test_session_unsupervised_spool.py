"""A Session run outside a supervisor (`supervised: false`) whose metrics go to a spool closes cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from supervisor.exitcodes import EXIT_OK
from supervisor.runtime import Session
from supervisor.runtime.plan import LaunchPlan
from tests.segmentkit import NAN_ROLLBACK_POLICY


def test_an_unsupervised_session_with_a_metrics_spool_closes_without_an_mlflow_client(tmp_path: Path):
    """The spool has no MLflow client to end the run with (it used to raise AttributeError at close)."""
    (tmp_path / "policy.yaml").write_text(NAN_ROLLBACK_POLICY)
    spool = tmp_path / "work" / "metrics" / "0.jsonl"
    plan = LaunchPlan(
        lineage="alone",
        workdir=str(tmp_path / "work"),
        checkpoint_dir=str(tmp_path / "store"),
        tracking_uri="sqlite:///unused.db",
        run_id="run",
        policy_path=str(tmp_path / "policy.yaml"),
        metrics_spool=str(spool),
        supervised=False,
    )
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sess = Session(plan)
    sess.register(model=model, optimizer=opt)
    with sess:
        for _, x in sess.loop([torch.ones(2, 4)] * 3, max_steps=3):
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sess.log(loss=loss.item())
    assert sess.exit_code == EXIT_OK
    assert [json.loads(line) for line in spool.read_text().splitlines()]  # the points are in the spool


def test_a_user_mistake_inside_the_session_is_recorded_as_exit_2_and_any_other_error_as_1(tmp_path: Path):
    """As the Lightning and Trainer callbacks do: the supervisor reads the recorded code, not a traceback's 1."""
    from supervisor.errors import UserError

    (tmp_path / "policy.yaml").write_text(NAN_ROLLBACK_POLICY)
    for error, code in ((UserError("a loader the Session cannot re-split"), 2), (RuntimeError("a bug"), 1)):
        work = tmp_path / str(code)
        plan = LaunchPlan(
            lineage="alone",
            workdir=str(work),
            checkpoint_dir=str(work / "store"),
            tracking_uri="sqlite:///unused.db",
            run_id="run",
            policy_path=str(tmp_path / "policy.yaml"),
            metrics_spool=str(work / "metrics" / "0.jsonl"),
            supervised=False,
        )
        sess = Session(plan)
        sess.register(model=torch.nn.Linear(2, 1))
        try:
            with sess:
                raise error
        except type(error):
            pass
        assert sess.exit_code == code
