"""DDP on the sharded path (`checkpoint.sharded: always`): examples/charlm.py under DDP, unchanged, under
`rollback-supervisor run` and torchrun with 2 gloo processes. Every rank writes its share of the replicated
state through DCP; a SIGKILL of rank 1 is relaunched from the last sharded commit, and a NaN is rolled back in
process on both ranks, where DDP's rank-0 path would relaunch every rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.runtime.segment_store import shards
from tests.conftest import REPO
from tests.test_example_fsdp import assert_kill_then_nan, policy


@pytest.mark.e2e
@pytest.mark.slow
def test_ddp_on_the_sharded_path_resumes_a_killed_rank_then_rolls_back_a_nan_in_process(
    prefect_harness, tmp_path: Path
):
    example = str(REPO / "examples" / "charlm.py")
    assert_kill_then_nan(example, policy(tmp_path, "\n  sharded: always"), "ddp-sharded", tmp_path)


@pytest.mark.parametrize(
    ("mode", "dtensor", "distributed", "params", "expected"),
    [
        ("auto", True, True, 10, True),  # FSDP2: always sharded
        ("never", True, True, 10, True),
        ("auto", False, True, 10_000_000, False),  # small DDP: rank 0's writer is faster
        ("auto", False, True, 50_000_000, True),  # large DDP: the ranks' shared writes are
        ("always", False, True, 10, True),
        ("never", False, True, 10**9, False),
        ("always", False, False, 10**9, False),  # one process: nothing to share
    ],
)
def test_which_models_go_through_sharded_checkpoints(mode, dtensor, distributed, params, expected):
    assert shards(mode, dtensor=dtensor, distributed=distributed, params=params) is expected
