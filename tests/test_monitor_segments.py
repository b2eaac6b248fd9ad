"""Rollbacks split the stream into segments; abandoned branches never feed the new segment's detectors."""

from __future__ import annotations

import math

from supervisor.monitor import DetectorSet, Point, Segmenter, replay


class Recorder:
    """A detector that records what it was fed."""

    type = "spike"
    metrics = frozenset({"loss", "val_loss"})

    def __init__(self) -> None:
        self.seen: list[Point] = []
        self.resets = 0

    def observe(self, point):
        self.seen.append(point)

    def reset(self):
        self.resets += 1
        self.seen.clear()


def branch(start: int, stop: int, t0: float, tag: float) -> list[Point]:
    """Loss every step plus val_loss every 10 steps; `tag` marks which branch a value came from."""
    out = []
    for i, step in enumerate(range(start, stop)):
        out.append(Point("loss", step, tag + step, t0 + i))
        if step % 10 == 0:
            out.append(Point("val_loss", step, tag + step, t0 + i + 0.5))
    return out


def test_steps_going_backwards_start_a_segment_and_keep_only_the_common_prefix():
    segmenter, recorder = Segmenter(history=64), Recorder()
    detectors = DetectorSet([recorder])
    old = branch(0, 150, 0.0, tag=10_000.0)
    new = branch(101, 200, 1000.0, tag=0.0)
    late_old = [Point("val_loss", 150, 10_150.0, 149.9)]  # logged before the rollback, read after it
    for raw in old + new[:5] + late_old + new[5:]:
        point = segmenter.assign(raw)
        if point is None:
            continue
        if point.segment != detectors.segment:
            detectors.reset_segment(point.segment, segmenter.prefix(point.segment))
        detectors.observe(point)
    assert segmenter.segment == 1 and recorder.resets == 1
    # Warm-up is the old branch strictly before step 101 (the last 64 per metric, then cut at 101), then the new branch.
    warm = [p for p in recorder.seen if p.value >= 10_000]
    assert all(p.step < 101 for p in warm)
    assert [p.step for p in warm if p.metric == "loss"] == list(
        range(86, 101)
    )  # the last 64 before the rollback, then cut
    assert [p.step for p in warm if p.metric == "val_loss"] == list(range(0, 101, 10))
    assert 10_150.0 not in [p.value for p in recorder.seen]  # the late old-branch point was dropped
    assert [p.step for p in recorder.seen[len(warm) :] if p.metric == "loss"] == list(range(101, 200))
    assert all(p.segment == 1 for p in recorder.seen)


def test_a_second_rollback_makes_a_third_segment():
    segmenter = Segmenter()
    stream = branch(0, 50, 0.0, 0.0) + branch(30, 60, 100.0, 0.0) + branch(40, 70, 200.0, 0.0)
    segments = [p.segment for raw in stream if (p := segmenter.assign(raw))]
    assert segments[0] == 0 and segments[-1] == 2 and sorted(segments) == segments


def test_replay_reports_the_same_spike_again_in_the_new_branch():
    def healthy(step: int) -> float:
        return 1.0 + 0.01 * math.sin(step)

    old = [Point("loss", s, 50.0 if s == 300 else healthy(s), float(s)) for s in range(0, 320)]
    new = [Point("loss", s, 50.0 if s == 300 else healthy(s), 1000.0 + s) for s in range(250, 400)]
    specs = [
        {"type": "spike", "metric": "loss", "window": 64, "sigmas": 6, "warmup_steps": 100, "min_history": 32}
    ]
    events = replay(old + new, specs)
    assert [(e.type, e.onset_step, e.source) for e in events] == [
        ("spike", 300, "replay"),
        ("spike", 300, "replay"),
    ]


def test_replay_reads_stalls_from_wall_times():
    stream = [Point("loss", s, 1.0, float(s)) for s in range(10)] + [Point("loss", 10, 1.0, 700.0)]
    events = replay(stream, [{"type": "hang", "seconds": 600}])
    assert [(e.type, e.onset_step, round(e.value)) for e in events] == [("hang", 9, 691)]
