"""Shared helpers for the flow end-to-end tests: run the real flow on the example, read back what it did."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from mlflow.tracking import MlflowClient

from tests.conftest import REPO

CHARLM = str(REPO / "examples" / "charlm.py")
FAST_POLICY = REPO / "tests" / "data" / "policies" / "fast.yaml"
#: The example on a 30 KB slice of its corpus at batch 8: an epoch is 52 steps and a step ~4x cheaper than the
#: default, for tests that need epoch boundaries or many restarts but not a realistic loss curve.
SMALL = ["--batch-size", "8", "--data", str(REPO / "tests" / "data" / "corpus-30k.txt")]

sys.path.insert(0, str(REPO / "examples"))


def run_flow(
    workdir: Path, steps: int, faults: str = "", policy: Path = FAST_POLICY, lineage: str = "t", **kw: Any
):
    """The real Prefect flow (under the session's test harness) on the example workload."""
    from flows.supervised import supervised_training

    return supervised_training(
        command=["python", CHARLM, "--steps", str(steps), "--eval-every", "20"],
        policy=str(policy),
        lineage=lineage,
        workdir=str(workdir),
        stop_grace_seconds=kw.pop("stop_grace_seconds", 10),
        env={"ROLLBACK_SUPERVISOR_FAULTS": faults} if faults else {},
        **kw,
    )


def record(workdir: Path, lineage: str = "t") -> dict[str, Any]:
    return json.loads((workdir / "lineages" / lineage / "lineage.json").read_text())


def history(result: dict[str, Any], key: str) -> list[tuple[int, float, int]]:
    client = MlflowClient(tracking_uri=result["tracking_uri"])
    return [(m.step, m.value, m.timestamp) for m in client.get_metric_history(result["mlflow_run_id"], key)]


def live_series(result: dict[str, Any], key: str) -> dict[int, float]:
    """The metric on the surviving branch, step -> value (abandoned branches dropped)."""
    from supervisor.report import split_branches

    live, _ = split_branches(history(result, key))
    return {step: value for step, value, _ in live}


def load_final_state(
    checkpoint_dir: Path, checkpoint_id: str, steps: int, extra: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """Restore a checkpoint into a freshly built example model (built with `extra` args); model and optimizer."""
    import charlm

    from supervisor.checkpoint import CheckpointManager, CheckpointOptions
    from supervisor.state import TrainingState

    args = charlm.parse_args(["--steps", str(steps), "--eval-every", "20", *extra])
    model, opt, sched, loader, _ = charlm.build(args)
    state = TrainingState()
    for name, obj in (("model", model), ("optimizer", opt), ("scheduler", sched), ("data", loader)):
        state.register(name, obj)
    with CheckpointManager(CheckpointOptions(directory=checkpoint_dir, async_save=False), state) as mgr:
        info = mgr.restore(checkpoint_id)
    return {"step": info.step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    for pid, entry in a["optimizer"]["state"].items():
        for name, tensor in entry.items():
            other = b["optimizer"]["state"][pid][name]
            assert torch.equal(torch.as_tensor(tensor), torch.as_tensor(other)), (pid, name)


def stored_state(checkpoint_dir: Path, checkpoint_id: str) -> dict[str, Any]:
    """Everything a checkpoint stores, as restored into a bare state (nothing registered; read-only, and the
    calling process's RNG streams are left as they were): model, optimizer, RNG, "ranks", ..."""
    from supervisor.checkpoint import open_store
    from supervisor.checkpoint.restore import restore_local
    from supervisor.state import TrainingState, capture_rng, restore_rng

    seen: dict[str, Any] = {}

    class Probe(TrainingState):
        def load_state_dict(self, nested, *, prefixes=None):
            seen.update(nested)

    saved_rng = capture_rng()
    try:
        catalog = open_store(checkpoint_dir)
        restore_local(catalog, catalog.manifest(checkpoint_id), Probe(), None, "full")
    finally:
        restore_rng(saved_rng)
    return seen
