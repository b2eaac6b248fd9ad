"""The replay's pure part (supervisor/runtime/replay.py): when it replays, from where, and its verdicts."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from supervisor.events import Event
from supervisor.runtime.replay import (
    ELSEWHERE,
    INCONCLUSIVE,
    MISMATCH,
    PERSISTENT,
    REPRODUCIBLE,
    Local,
    Replayer,
    ReplaySettings,
    Trail,
    Verdict,
    hardware_event,
    same_bits,
    with_verdict,
)

ON = ReplaySettings(enabled=True, max_steps=10, budget_seconds=60.0)


@dataclass
class Ckpt:
    id: str
    step: int
    tiers: tuple[str, ...] = ("memory", "local")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def nan_at(step: int, metric: str = "loss") -> Event:
    return Event("non_finite", "loss is nan", metric=metric, onset_step=step, step=step, value=math.nan)


def test_bits_not_values_decide():
    assert same_bits(1.5, 1.5) and same_bits(math.nan, float("nan"))
    assert not same_bits(0.0, -0.0)  # equal as numbers, different bits
    assert not same_bits(1.0, math.nextafter(1.0, 2.0))
    assert not same_bits(None, 1.0) and same_bits(None, None)


def test_the_trail_keeps_max_steps_and_forgets_an_abandoned_branch():
    trail = Trail(3)
    for step in range(1, 8):
        trail.record(step, {"loss": float(step)}, now=step * 0.5)
    assert trail.values("loss", 0, 10) == {4: 4.0, 5: 5.0, 6: 6.0, 7: 7.0}
    assert trail.step_seconds() == 0.5
    trail.record(5, {"loss": 50.0}, now=9.0)  # a rollback to step 4: steps 5.. of the old branch go
    assert trail.values("loss", 0, 10) == {4: 4.0, 5: 50.0}


def test_only_listed_anomalies_at_the_step_just_ended_are_replayed_and_each_onset_once():
    r = Replayer(ON)
    assert r.wants(nan_at(9), 9) is None
    assert r.wants(nan_at(9), 10) == "its onset is not the step that just ended"
    assert "does not list divergence" in (r.wants(Event("divergence", "up", "loss", 9, 9), 9) or "")
    assert Replayer(ReplaySettings()).wants(nan_at(9), 9) == "replay is off"
    r.begin(nan_at(9), 6)
    assert r.wants(nan_at(9), 9) == "this onset was replayed already"


def test_the_newest_memory_snapshot_before_the_onset_within_max_steps_and_the_budget():
    clock = Clock()
    r = Replayer(ON, clock=clock)
    ring = [Ckpt("a", 2), Ckpt("b", 5), Ckpt("c", 8, ("local",)), Ckpt("d", 11), Ckpt("e", 12)]
    # Not c (disk only), not d (the step before the onset: its update may be the damage), not e (the onset).
    assert r.target(ring, 12)[0] == Ckpt("b", 5)
    target, why = r.target(ring, 40)
    assert (
        target is None and why == "no snapshot in the memory ring within 10 steps (the newest is at step 12)"
    )
    for step in range(1, 6):
        clock.now = step * 20.0  # 20 s a step: 7 steps would take 140 s, over the 60 s budget
        r.record(step, {"loss": 1.0})
    target, why = r.target(ring, 12)
    assert target is None and "about 140 s, over monitor.replay.budget_seconds (60)" in why


def _replay(r: Replayer, first: dict[int, float], again: dict[int, float], onset: int, start: int) -> Local:
    for step, value in first.items():
        r.record(step, {"loss": value})
    r.begin(nan_at(onset), start)
    out = None
    for step, value in again.items():
        r.record(step, {"loss": value})
        out = r.observe(step, {"loss": value})
        assert (out is None) == (step < onset)
    assert out is not None
    return out


def test_a_replay_that_parts_from_the_first_run_is_a_transient_hardware_fault_named_where_it_parted():
    r = Replayer(ON, rank=0, host="node-a", device="cpu")
    first = {4: 1.0, 5: 0.9, 6: 0.8, 7: math.nan}
    local = _replay(r, first, {5: 0.9, 6: 0.7, 7: 0.6}, onset=7, start=4)
    assert (local.differs, local.first_diff, local.replayed) == (True, 6, 0.6) and math.isnan(local.original)
    verdict = r.conclude([local], ["node-a"])
    assert verdict.verdict == MISMATCH and verdict.hardware
    assert (verdict.first_diff_step, verdict.ranks, verdict.hosts, verdict.steps) == (6, [0], ["node-a"], 3)
    assert math.isnan(verdict.original) and verdict.replayed == 0.6
    assert "differed first at step 6 (rank 0 on node-a; cpu)" in verdict.reason
    event = hardware_event(verdict, nan_at(7), 123.0)
    assert (event.type, event.evidence["evidence"], event.evidence["ranks"]) == (
        "hardware_fault",
        MISMATCH,
        [0],
    )
    assert r.active is None


def test_a_replay_that_comes_out_the_same_bit_for_bit_leaves_the_rule_to_decide():
    r = Replayer(ON)
    first = {4: 1.0, 5: 0.9, 6: 0.8, 7: math.nan}
    verdict = r.conclude([_replay(r, first, {5: 0.9, 6: 0.8, 7: math.nan}, onset=7, start=4)])
    assert verdict.verdict == REPRODUCIBLE and not verdict.hardware and verdict.first_diff_step is None
    assert "came out the same, bit for bit" in verdict.reason
    event = with_verdict(nan_at(7), verdict)
    assert event.type == "non_finite" and event.evidence["replay"]["verdict"] == REPRODUCIBLE


def test_on_cuda_without_deterministic_kernels_a_difference_proves_nothing():
    r = Replayer(ON, device="cuda:0", deterministic=lambda: False)
    local = _replay(r, {4: 1.0, 5: math.nan}, {5: 0.5}, onset=5, start=4)
    verdict = r.conclude([local])
    assert verdict.verdict == INCONCLUSIVE and "nondeterministic" in verdict.reason


def test_under_ddp_the_first_step_at_which_any_rank_parts_names_the_ranks():
    # Rank 1 was corrupted at step 5: its own loss parts at step 6; rank 0's only at step 7 (the all-reduce).
    rows = [Local(True, 7, 9.0, 1.0), Local(True, 6, 2.0, 1.1), Local(False, None, 1.2, 1.2)]
    r = Replayer(ON, rank=2)
    r.begin(nan_at(8), 4)
    verdict = r.conclude(rows, ["h0", "h1", "h2"])
    assert (verdict.verdict, verdict.ranks, verdict.hosts, verdict.first_diff_step) == (
        MISMATCH,
        [1],
        ["h1"],
        6,
    )
    assert (verdict.original, verdict.replayed) == (2.0, 1.1)  # the parting rank's values


def test_settings_from_the_policy_section():
    @dataclass
    class Spec:
        enabled: bool = True
        max_steps: int = 7
        when: tuple[str, ...] = ("spike",)
        budget_seconds: float = 9.0

    assert ReplaySettings.of(Spec()) == ReplaySettings(True, 7, frozenset({"spike"}), 9.0, other_device=True)
    assert ReplaySettings.of(None) == ReplaySettings()


@pytest.mark.parametrize("onset", [5, 6])
def test_a_rank_with_no_value_at_a_step_compares_what_it_has(onset):
    r = Replayer(ON)
    local = _replay(r, {4: 1.0, 5: 2.0, 6: 3.0}, {5: 2.0, 6: 3.0}, onset=onset, start=4)
    assert not local.differs


# -- the second stage: the suspect's batches on another rank's device --------------------------------------


def _first_stage(rank: int, trail: dict[int, float]) -> tuple[Replayer, Verdict]:
    r = Replayer(ON, rank=rank)
    for step, value in trail.items():
        r.record(step, {"loss": value})
    event = nan_at(5)
    r.begin(Event(**{**event.to_dict(), "evidence": {"seen_on_rank": 1}}), 3)
    first = r.conclude([Local(False, None, math.nan, math.nan)] * 2, ["h0", "h1"])
    return r, first


def test_the_suspect_is_the_one_rank_that_saw_it_and_its_buddy_the_next_one():
    r = Replayer(ON, rank=0, swaps_batches=True)
    first = Verdict(REPRODUCIBLE, "loss", 5, 3, 2, 1.0, math.nan, math.nan)

    def seen(rank: int, by: list[int] | None = None) -> Event:
        evidence = {"seen_on_rank": rank, "seen_by": by or [rank]}
        return Event(**{**nan_at(5).to_dict(), "evidence": evidence})

    assert r.pair_for(seen(1), 2, first) == ((1, 0), "") and r.pair_for(seen(2), 4, first)[0] == (2, 3)
    assert r.pair_for(seen(3), 4, first)[0] == (3, 0)
    assert r.pair_for(seen(0), 1, first) == (None, "there is no other rank's device")
    # Several ranks saw it at the onset: it came through a collective, no one rank's batches are to blame.
    none, why = r.pair_for(seen(0, [0, 2]), 4, first)
    assert none is None and "ranks [0, 2] all saw it" in why
    slow = Verdict(REPRODUCIBLE, "loss", 5, 3, 2, ON.budget_seconds + 1, math.nan, math.nan)
    assert "over monitor.replay.budget_seconds" in r.pair_for(seen(1), 2, slow)[1]
    off = Replayer(ReplaySettings(enabled=True, other_device=False), swaps_batches=True)
    assert off.pair_for(seen(1), 2, first) == (None, "monitor.replay.other_device is off")
    framework = Replayer(ON)  # a driver that cannot hand a rank another rank's batch
    assert "cannot hand a rank another rank's batches" in framework.pair_for(seen(1), 2, first)[1]


def test_each_rank_is_compared_with_what_the_owner_of_its_batches_logged():
    # Rank 0 computes rank 1's batches: it expects rank 1's values (a NaN at step 5), and finds them.
    r, first = _first_stage(0, {3: 1.0, 4: 0.9, 5: 0.8})
    windows = [r.window("loss", 3, 5), [1.0, 2.0, 1.0, math.nan]]
    assert windows[0] == [1.0, 0.9, 1.0, 0.8]
    assert r.begin_elsewhere(first, nan_at(5), (1, 0), windows) == 1
    assert r.active is not None and r.active.swapped and r.active.expected[5] != r.active.expected[5]
    r.record(4, {"loss": 123.0})  # a second stage's values are another rank's: never in this rank's trail
    assert r.trail.values("loss", 3, 5) == {4: 0.9, 5: 0.8}
    assert r.observe(4, {"loss": 2.0}) is None
    local = r.observe(5, {"loss": math.nan})
    assert local is not None and not local.differs and local.first_diff is None
    assert math.isnan(local.original) and math.isnan(local.replayed)  # rank 1's NaN, reproduced here


def _second(rows: list[Local], *, pair: tuple[int, int] = (1, 0), world: int = 2, devices=None) -> Verdict:
    r, first = _first_stage(0, {3: 1.0, 4: 0.9, 5: 0.8})
    hosts = [f"h{i}" for i in range(world)]
    r.begin_elsewhere(first, nan_at(5), pair, [[0.0] * 4] * world, hosts, devices or ["cpu"] * world)
    return r.conclude_elsewhere(rows)


def test_the_suspects_batches_differing_elsewhere_is_a_device_wrong_every_time():
    verdict = _second([Local(True, 5, math.nan, 0.7), Local(True, 5, 0.8, math.inf)])
    assert (verdict.verdict, verdict.stage, verdict.ranks, verdict.hosts, verdict.other_rank) == (
        PERSISTENT,
        2,
        [1],
        ["h1"],
        0,
    )
    assert verdict.hardware and verdict.differed == [0, 1] and verdict.first_diff_step == 5
    assert math.isnan(verdict.original) and verdict.replayed == 0.7  # the suspect's batch, on rank 0's device
    event = hardware_event(verdict, nan_at(5), 1.0, [Verdict(REPRODUCIBLE, "loss", 5, 3, 2, 0.5, None, None)])
    assert event.evidence["evidence"] == PERSISTENT and event.evidence["hosts"] == ["h1"]
    assert [s["verdict"] for s in event.evidence["stages"]] == [REPRODUCIBLE, PERSISTENT]


def test_the_suspects_device_parting_only_on_the_buddys_batches_blames_neither():
    verdict = _second([Local(False, None, math.nan, math.nan), Local(True, 5, 0.8, 0.9)])
    assert verdict.verdict == INCONCLUSIVE and not verdict.hardware and verdict.differed == [1]
    assert "neither the data nor the device alone" in verdict.reason


def test_the_same_values_elsewhere_leave_the_rule_to_decide():
    verdict = _second([Local(False, None, math.nan, math.nan), Local(False, None, 0.8, 0.8)])
    assert verdict.verdict == ELSEWHERE and not verdict.hardware and verdict.differed == []
    event = with_verdict(nan_at(5), verdict, [Verdict(REPRODUCIBLE, "loss", 5, 3, 2, 0.5, None, None)])
    assert event.type == "non_finite" and [s["verdict"] for s in event.evidence["stages"]] == [
        REPRODUCIBLE,
        ELSEWHERE,
    ]


def test_a_difference_outside_the_swapped_pair_or_on_nondeterministic_cuda_proves_nothing():
    outside = _second([Local(True, 5, 1.0, 1.1), Local(True, 5, 0.8, 0.9), Local(True, 5, 0.7, 0.6)], world=3)
    assert outside.verdict == INCONCLUSIVE and "outside the swapped pair" in outside.reason
    r, first = _first_stage(0, {3: 1.0, 4: 0.9, 5: 0.8})
    r._deterministic = lambda: False
    r.begin_elsewhere(first, nan_at(5), (1, 0), [[0.0] * 4] * 2, ["h0", "h1"], ["cuda:0", "cuda:1"])
    cuda = r.conclude_elsewhere([Local(True, 5, math.nan, 0.7), Local(False, None, 0.8, 0.8)])
    assert cuda.verdict == INCONCLUSIVE and "nondeterministic" in cuda.reason


def test_the_supervisor_decides_a_persistent_mismatch_and_keeps_the_replays_as_reports(tmp_path):
    """What rank 0 writes for a device wrong every time (two replay reports, then the hardware fault left to
    the supervisor): the fold keeps the reports with the segment and hands the hardware fault on."""
    from policies import History, parse_policy
    from supervisor.orchestrator.decision_step import DecisionStep
    from supervisor.orchestrator.events_log import EventsLog
    from supervisor.runtime.reporter import EventReporter

    anomaly = Event(**{**nan_at(5).to_dict(), "evidence": {"seen_on_rank": 1}})
    first = Verdict(REPRODUCIBLE, "loss", 5, 2, 3, 0.4, math.nan, math.nan)
    second = _second([Local(True, 5, math.nan, 0.7), Local(True, 5, 0.8, math.inf)])
    hardware = hardware_event(second, anomaly, 2.0, [first])
    reporter = EventReporter(tmp_path / "events.jsonl", 0)
    from supervisor.runtime.rollback import InProcessRollback

    InProcessRollback.report_replay(_Reports(reporter), with_verdict(anomaly, first), first, anomaly)
    InProcessRollback.report_replay(_Reports(reporter), hardware, second, anomaly)
    reporter.anomaly(hardware, None, handled=False)

    policy = parse_policy(
        "version: 1\nname: t\nrules: [{when: [hardware_fault], action: resume, allow_scratch: true}]\n"
    )
    step = DecisionStep(
        policy,
        history=History(),
        events=EventsLog(tmp_path / "events.jsonl"),
        catalog=lambda: None,
        run=None,
        save=lambda: None,
        clock=lambda: 3.0,
    )
    from supervisor.lineage import SegmentRecord

    seg = SegmentRecord(index=0, started=0.0)
    records, _ = step.events.since(0)
    left = step.fold(seg, records)
    assert left is not None and left.type == "hardware_fault" and left.evidence["evidence"] == PERSISTENT
    assert [r["replay"]["verdict"] for r in seg.in_process] == [REPRODUCIBLE, PERSISTENT]


class _Reports:
    """Just what `InProcessRollback.report_replay` uses of its instance."""

    def __init__(self, reporter):
        self._reporter = reporter


def test_every_rank_parting_at_the_same_step_names_no_host():
    # A wrong gradient all-reduced (or a corrupted FSDP shard all-gathered) reaches every rank before any value.
    r = Replayer(ON, rank=0)
    r.begin(nan_at(6), 4)
    verdict = r.conclude([Local(True, 5, 2.0, 1.0), Local(True, 5, 2.1, 1.1)], ["h0", "h1"])
    assert (verdict.verdict, verdict.ranks, verdict.hosts) == (MISMATCH, [0, 1], [])
    assert "no rank or host is named" in verdict.reason
    assert hardware_event(verdict, nan_at(6), 1.0).evidence["hosts"] == []


def test_policy_explain_says_what_the_replay_does_and_warns_when_no_rule_takes_a_faulty_device():
    from policies import parse_policy
    from policies.summary import summarize

    text = """\
version: 1
name: r
monitor:
  detectors: [{type: non_finite, metrics: [loss]}]
  replay: {enabled: true, max_steps: 4, when: [non_finite, spike]%s}
rules: [{when: [non_finite], action: rollback, target: {select: latest}}%s]
"""
    bare = summarize(parse_policy(text % ("", "")))
    assert "Replay (data or hardware?)" in bare and "2 to 4 steps back" in bare
    assert "non_finite or spike" in bare and "persistent_mismatch" in bare
    assert "No rule handles hardware_fault" in bare
    handled = summarize(
        parse_policy(text % (", other_device: false", ", {when: [hardware_fault], action: resume}"))
    )
    assert "no second stage" in handled and "No rule handles hardware_fault" not in handled
    assert "Replay" not in summarize(parse_policy(text.replace("enabled: true", "enabled: false") % ("", "")))
