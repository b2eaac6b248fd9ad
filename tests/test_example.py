"""The standard workload is bit-for-bit deterministic.

That it trains and logs every step's metrics to MLflow is checked on test_monitor_example's 1,000-step
stand-alone recording (test_healthy_run_is_complete_and_quiet_in_process and
test_healthy_run_logs_to_mlflow_and_learns) instead of on a 300-step run of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import charlm  # noqa: E402


def test_same_seed_gives_bit_identical_parameters(tmp_path: Path):
    finals = []
    for i in range(2):
        args = charlm.parse_args(["--steps", "12", "--workdir", str(tmp_path / f"r{i}"), "--eval-every", "6"])
        code, model, opt = charlm.train(args)
        assert code == 0
        finals.append(({k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()))
    (p0, o0), (p1, o1) = finals
    assert p0.keys() == p1.keys()
    for key in p0:
        assert torch.equal(p0[key], p1[key]), key
    for pid, state in o0["state"].items():
        for name, tensor in state.items():
            assert torch.equal(tensor, o1["state"][pid][name]), (pid, name)
    # A different seed must give different weights, or the comparison above proves nothing.
    args = charlm.parse_args(["--steps", "12", "--seed", "1", "--workdir", str(tmp_path / "r2")])
    _, other, _ = charlm.train(args)
    assert not torch.equal(other.state_dict()["head.weight"], p0["head.weight"])
