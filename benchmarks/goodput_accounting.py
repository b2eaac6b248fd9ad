"""Where the wall time of a preempted run went, from per-segment counters. Pure: data in, figures out.

Buckets over the window [t0, t_end]:
- startup: the first segment's launch up to its resume point (restore done);
- restart: from the moment a segment stopped doing useful work (a SIGKILL, or the end of its emergency
  checkpoint) up to the next segment's resume point: detection, decision, relaunch, imports, restore;
- checkpoint: time the training loop was blocked saving (periodic saves, and emergency checkpoints);
- redone: steps executed again because they were lost (at or below an earlier segment's last step), plus
  the partial step a SIGKILL threw away;
- useful: the remaining step time; other: what is left (rounding, process teardown not covered above).

Where the preemptions land between two checkpoints is luck: with a handful per run, the redone time of two
cadences differs by that luck as much as by their intervals. So besides the realized figures, `account` gives
the expected ones for the checkpoints the run actually took: a preemption at a random moment loses the time
since the last durable point, on average sum(T^2) / (2 sum(T)) over the intervals T between durable points
(the restore, then each checkpoint), and preemptions come at `rate_per_min`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SegmentSample:
    """One training process: when it started and ended, when we signalled it, and its counter record."""

    launched: float
    ended: float
    signalled: float | None
    counter: dict[str, float] | None


def arrivals(rate_per_min: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Offsets (seconds from the start) of a Poisson process with `rate_per_min` events, up to `horizon_s`."""
    if rate_per_min <= 0:
        return []
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate_per_min / 60.0)
        if t >= horizon_s:
            return out
        out.append(t)


def account(
    segments: list[SegmentSample],
    t0: float,
    t_end: float,
    *,
    graceful: bool,
    useful_steps: int,
    rate_per_min: float = 0.0,
) -> dict[str, Any]:
    """Steps and wall-time buckets of one run; `useful_steps` is the step of the last durable checkpoint."""
    wall = t_end - t0
    time_in = dict.fromkeys(("startup", "restart", "checkpoint", "redone", "useful"), 0.0)
    executed = redone = saves = restarts = 0
    save_s = step_time = gap_s = gap_sq_s = 0.0
    high_water = 0
    gap_start = t0
    for index, seg in enumerate(segments):
        bucket = "startup" if index == 0 else "restart"
        last = index == len(segments) - 1
        c = seg.counter
        if c is None or c["restored_at"] >= t_end:  # died (or the window closed) before it resumed
            time_in[bucket] += max(0.0, min(seg.ended, t_end) - gap_start)
            gap_start = min(seg.ended, t_end)
            restarts += index > 0
            continue
        restarts += index > 0
        time_in[bucket] += max(0.0, c["restored_at"] - gap_start)
        steps = int(c["steps_run"])
        seg_redone = max(0, min(int(c["last_step"]), high_water) - int(c["restored_step"]))
        high_water = max(high_water, int(c["last_step"]))
        busy = min(c["last_step_at"], t_end) - c["restored_at"]
        step_s = max(0.0, busy - c["save_s"]) / steps if steps else 0.0
        executed, redone, saves = executed + steps, redone + seg_redone, saves + int(c["saves"])
        save_s, step_time = save_s + c["save_s"], step_time + step_s * steps
        time_in["checkpoint"] += c["save_s"]
        gap_s, gap_sq_s = gap_s + c.get("gap_s", 0.0), gap_sq_s + c.get("gap_sq_s", 0.0)
        time_in["redone"] += seg_redone * step_s
        time_in["useful"] += (steps - seg_redone) * step_s
        if last:
            time_in["useful"] += max(0.0, t_end - c["last_step_at"])  # the step in flight completes
            break
        if graceful:
            time_in["checkpoint"] += c["emergency_s"]
            gap_start = c["last_step_at"] + c["emergency_s"]
        else:
            stop = min(seg.signalled if seg.signalled is not None else seg.ended, t_end)
            lost = max(0.0, stop - c["last_step_at"])
            time_in["redone"] += lost
            gap_start = c["last_step_at"] + lost
    fractions = {k: v / wall for k, v in time_in.items()} if wall > 0 else dict.fromkeys(time_in, 0.0)
    fractions["other"] = 1.0 - sum(fractions.values())
    # Expected seconds a preemption at a random moment throws away, and the expected share of wall time the
    # cadence costs (checkpointing as measured + redone work at the preemption rate), free of where they hit.
    exposure = gap_sq_s / (2 * gap_s) if gap_s > 0 else None
    # A SIGTERM loses nothing: the emergency checkpoint (charged to "checkpoint") is the resume point.
    lost = 0.0 if graceful else rate_per_min / 60.0 * exposure if exposure is not None else None
    expected = fractions["checkpoint"] + lost if lost is not None and wall > 0 else None
    return {
        "wall_s": wall,
        "executed_steps": executed,
        "useful_steps": useful_steps,
        "redone_steps": redone,
        "unsaved_steps": max(0, executed - redone - useful_steps),
        "goodput": useful_steps / executed if executed else 0.0,
        "time_fraction": fractions,
        "seconds": time_in,
        "restarts": restarts,
        "saves": saves,
        "mean_restart_s": time_in["restart"] / restarts if restarts else None,
        "mean_save_blocked_s": save_s / saves if saves else None,
        "steps_per_save": executed / saves if saves else None,
        "step_s": step_time / executed if executed else None,
        "expected_loss_per_preemption_s": exposure,
        "expected_cadence_overhead": expected,
    }
