"""Retention policies: table-driven, pure."""

from __future__ import annotations

import pytest

from supervisor.checkpoint import (
    AnyOf,
    CheckpointInfo,
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepProtected,
    apply_retention,
)
from supervisor.checkpoint.retention import policy_from_settings


def ckpts(*specs) -> list[CheckpointInfo]:
    """specs: (step, loss or None[, abandoned]) in commit order."""
    out = []
    for seq, spec in enumerate(specs, start=1):
        step, loss, *rest = spec
        metrics = {} if loss is None else {"loss": loss}
        out.append(
            CheckpointInfo(
                f"{step:010d}-{seq:06d}", step, 0.0, metrics, seq=seq, abandoned=bool(rest and rest[0])
            )
        )
    return out


S = ckpts((100, 5.0), (200, 3.0), (300, 4.0), (400, 6.0), (500, 7.0))


def steps(infos) -> list[int]:
    return [i.step for i in infos]


CASES = [
    ("keep last 2", KeepLast(2), S, [400, 500]),
    ("keep last more than held", KeepLast(9), S, [100, 200, 300, 400, 500]),
    ("best 2 min keeps the newest too", KeepBest("loss", "min", 2), S, [200, 300, 500]),
    ("best 1 max", KeepBest("loss", "max", 1), S, [500]),
    (
        "best ignores checkpoints without the metric",
        KeepBest("loss", "min", 1),
        ckpts((1, None), (2, 9.0), (3, None)),
        [2, 3],
    ),
    ("best ignores nan", KeepBest("loss", "min", 1), ckpts((1, float("nan")), (2, 9.0), (3, 8.0)), [3]),
    ("every 200 plus newest", KeepEvery(200), S, [200, 400, 500]),
    ("protected keeps an old one", KeepLast(1) | KeepProtected({S[0].id}), S, [100, 500]),
    ("union of three", AnyOf(KeepLast(1), KeepBest("loss", "min", 1), KeepEvery(300)), S, [200, 300, 500]),
    ("newest always kept", KeepEvery(1000), S, [500]),
    ("no policy keeps everything", None, S, [100, 200, 300, 400, 500]),
    ("empty store", KeepLast(1), [], []),
]


@pytest.mark.parametrize("name,policy,infos,kept", CASES, ids=[c[0] for c in CASES])
def test_retention_keeps(name, policy, infos, kept):
    result = apply_retention(policy, infos)
    assert steps(result.keep) == kept
    assert sorted(steps(result.keep) + [i.step for i, _ in result.delete]) == sorted(steps(infos))
    assert all(reason for _, reason in result.delete)


WITH_ABANDONED = ckpts((100, 5.0), (200, 1.0), (300, 0.5, True), (400, 0.1, True), (200, 2.0), (300, 3.0))


@pytest.mark.parametrize(
    "name,policy,kept,first_deleted",
    [
        (
            "abandoned go first, never count as best or newest",
            KeepLast(2) | KeepBest("loss", "min", 1),
            [200, 200, 300],
            300,
        ),
        (
            "protection wins over abandonment",
            KeepLast(1) | KeepProtected({WITH_ABANDONED[3].id}),
            [400, 300],
            300,
        ),
    ],
)
def test_abandoned_checkpoints(name, policy, kept, first_deleted):
    result = apply_retention(policy, WITH_ABANDONED)
    assert [i.step for i in result.keep] == kept
    deleted, reason = result.delete[0]
    assert deleted.step == first_deleted and deleted.abandoned and "abandoned" in reason


@pytest.mark.parametrize(
    "policy,info,reason",
    [
        (KeepLast(2), S[0], "not among the last 2"),
        (KeepBest("loss", "min", 1), S[3], "loss=6 not among the best 1 (min)"),
        (KeepBest("acc", "max", 1), S[3], "no finite acc"),
        (KeepEvery(200), S[0], "step 100 is not a multiple of 200"),
        (KeepLast(1) | KeepEvery(300), S[0], "not among the last 1; step 100 is not a multiple of 300"),
    ],
)
def test_deletion_reasons(policy, info, reason):
    assert dict((i.id, r) for i, r in apply_retention(policy, S).delete)[info.id] == reason


def test_or_flattens_and_policy_from_settings_composes():
    assert len((KeepLast(1) | KeepEvery(2) | KeepProtected({"x"})).policies) == 3
    assert policy_from_settings() is None
    built = policy_from_settings(
        keep_last=2, keep_best=("loss", "min", 1), keep_every_steps=300, protected={"x"}
    )
    assert built == AnyOf(KeepLast(2), KeepBest("loss", "min", 1), KeepEvery(300), KeepProtected({"x"}))


def test_unhealthy_checkpoints_never_push_the_last_healthy_ones_out():
    """A run that keeps saving NaN weights (issue 14): keep_last still holds the last k good checkpoints."""
    from dataclasses import replace

    infos = [
        replace(i, nonfinite=("model.w",)) if i.step >= 300 else i
        for i in ckpts((100, 5.0), (200, 3.0), (300, None), (400, None), (500, None))
    ]
    result = apply_retention(KeepLast(2), infos)
    assert steps(result.keep) == [100, 200, 400, 500]
    assert [(i.step, why) for i, why in result.delete] == [(300, "not among the last 2 (and unhealthy)")]
