"""The `monitor.replay:` section: replay a bad step, on the same device and then on another rank's, to tell data
from hardware."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from policies.base import Spec


class ReplayConfig(Spec):
    """Before a rule applies to a non-finite value, a spike or a threshold crossed, replay the steps up to its onset from the newest
    snapshot in the memory ring, with the same batches and RNG streams, and compare the metric bit for bit: a
    different value is a transient hardware fault (`hardware_fault`, evidence `replay_mismatch`) and training
    goes on from the replayed state; the same value leaves the rule to decide, as without replay, after a
    second stage under DDP (`other_device`)."""

    enabled: bool = Field(
        False, description="Replay before deciding (off by default: it costs the replayed steps)."
    )
    max_steps: int = Field(
        50,
        ge=1,
        description="Replay only from a snapshot at most this many steps before the onset (see "
        "`checkpoint.memory_slots` and the save cadence: the ring must hold one that near).",
    )
    when: list[Literal["non_finite", "spike", "threshold"]] = Field(
        default_factory=lambda: ["non_finite", "spike"],
        min_length=1,
        description="The anomalies replayed (each has its onset at the step just seen), named as in a rule's "
        "`when:` (a key `on:` would be YAML's boolean true).",
    )
    budget_seconds: float = Field(
        300,
        gt=0,
        allow_inf_nan=False,
        description="Skip the replay when the steps to replay would take longer than this (at the recent step "
        "time); the rule then decides at once.",
    )
    other_device: bool = Field(
        True,
        description="Under DDP, when the same device reproduces the value: replay the same steps again with the "
        "batches of the rank that saw the anomaly computed on the next rank's device. A different value there "
        "is a device wrong every time (`hardware_fault`, evidence `persistent_mismatch`: every rank stops and "
        "the supervisor relaunches, away from that host where it can); the same value leaves the rule to "
        "decide. A single process has no other device: its verdict stays `reproducible_on_same_device`.",
    )
