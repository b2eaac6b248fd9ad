"""Holds: what retention must keep now, folded into the policy the options ask for."""

from __future__ import annotations

import pytest

from supervisor.checkpoint.holds import Holds
from supervisor.checkpoint.options import CheckpointInfo, CheckpointOptions
from supervisor.checkpoint.retention import apply_retention


def infos(n: int) -> list[CheckpointInfo]:
    return [CheckpointInfo(f"{i:010d}-{i:06d}", i, 0.0, seq=i) for i in range(1, n + 1)]


@pytest.mark.parametrize(
    "protect,uploading,kept",
    [
        ((), (), [4]),
        (("0000000001-000001",), (), [1, 4]),
        ((), ("0000000002-000002",), [2, 4]),
        (("0000000001-000001",), ("0000000002-000002",), [1, 2, 4]),
    ],
)
def test_held_ids_survive_keep_last(tmp_path, protect, uploading, kept):
    holds = Holds()
    holds.protect(protect)
    for cid in uploading:
        holds.uploading(cid)
    result = apply_retention(holds.policy(CheckpointOptions(tmp_path, keep_last=1)), infos(4))
    assert [i.step for i in result.keep] == kept


def test_released_holds_no_longer_keep_and_no_settings_means_no_policy(tmp_path):
    holds = Holds()
    holds.protect(["a", "b"])
    holds.uploading("c")
    assert holds.held() == {"a", "b", "c"}
    holds.unprotect(["a"])
    holds.uploaded("c")
    assert holds.held() == {"b"}
    assert holds.policy(CheckpointOptions(tmp_path)) is None
