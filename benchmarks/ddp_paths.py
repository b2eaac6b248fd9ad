"""`bench checkpoint --ddp-paths`: under DDP, the rank-0 path (rank 0 alone writes the replicated state) against
the sharded path (every rank writes a share through DCP); which is faster, per figure (issue 17, item 3).

One torchrun of `world_size` ranks (gloo, CPU) measures both paths in every rep, alternating which goes first
(`ddp_paths_child.py`), so load from other work on the host weighs on both alike. A time over ranks is the
slowest rank's: the step after it waits for every rank.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import BenchError, BenchRunError, machine, run_torchrun

log = logging.getLogger("rollback_supervisor.bench")
CHILD = Path(__file__).resolve().parent / "ddp_paths_child.py"
PATHS = ("rank0_path", "sharded")
#: Each figure: (the rank-0 path's key, the sharded path's key).
FIGURES = {
    "save_blocking": ("rank0_blocking_save_s", "sharded_blocking_save_s"),
    "save_total": ("rank0_save_total_s", "sharded_save_total_s"),
    "restore": ("rank0_restore_s", "sharded_restore_s"),
}
DEFINITIONS = {
    "times": "per rep, the slowest rank (every rank starts after a barrier); medians of reps",
    "rank0_blocking_save_s": "Saver.save under DDP: every rank's RNG state gathered to rank 0 "
    "(Distributed.gather_state), then rank 0's CheckpointManager.save with async_save (until it returns: the "
    "copy into its host ring); the other ranks only take part in the gather",
    "rank0_save_total_s": "the same, until rank 0's manager.wait() returns (written and committed)",
    "sharded_blocking_save_s": "every rank's ShardedCheckpoints.save(blocking=False) of a ShardedTrainingState "
    "of the DDP model, until it returns (the copy into each rank's ring)",
    "sharded_save_total_s": "the same, until every rank's wait() returns (every share written, committed)",
    "rank0_restore_s": "PlanRestore.restore under DDP, from disk (as after a relaunch): rank 0's "
    "CheckpointManager.restore(id, tier='local'), broadcast_outcome of the id, then every other rank's "
    "ReadOnlyCheckpoints.restore (the full state, verify=full); one after the other",
    "rank0_restore_own_read_s": "each rank's own restore call within rank0_restore_s (the slowest rank's): "
    "what it would cost if the ranks did not wait for rank 0's",
    "sharded_restore_s": "every rank's ShardedCheckpoints.restore(id) from disk at once (each reads the full "
    "replicated state, verify=full)",
    "sharded_restore_memory_s": "in-process rollback on the sharded path: restore_memory from every rank's "
    "ring; the rank-0 path has none under DDP (every anomaly goes to the supervisor: a relaunch, whose "
    "restore is rank0_restore_s)",
    "bytes_written": "per rank, median over reps of the tensor blob bytes it wrote for one checkpoint",
    "faster": "the path with the lower median; `clear` when every rep of it was faster than every rep of the "
    "other (non-overlapping ranges; null with one rep), `ratio` the slower median over the faster",
    "rank0_path_faster_on": "the figures whose median the rank-0 path wins (see each figure's `clear`)",
}


def check(world_size: int, device: str) -> None:
    """Refused before anything starts: at least 2 ranks, CPU (gloo) only."""
    if world_size < 2:
        raise BenchError(f"--world-size: expected at least 2 ranks for a --ddp-paths run, got {world_size}")
    if device != "cpu":
        raise BenchError(f"--device: --ddp-paths runs on cpu (gloo DDP), got {device!r}; drop --device")


def torchrun(world_size: int, config: Path, timeout_s: float) -> None:
    run_torchrun(CHILD, [str(config)], world_size, timeout_s, "ddp-paths benchmark")


def verdict(rank0: list[float], sharded: list[float]) -> dict[str, Any]:
    """Which path is faster on one figure (by median), by how much, and whether every rep agrees."""
    a, b = statistics.median(rank0), statistics.median(sharded)
    faster, slower = ("rank0_path", "sharded") if a < b else ("sharded", "rank0_path")
    reps = {"rank0_path": rank0, "sharded": sharded}
    return {
        "rank0_path_s": a,
        "sharded_s": b,
        "faster": faster,
        "ratio": max(a, b) / min(a, b) if min(a, b) > 0 else None,
        # one rep per path proves nothing either way
        "clear": max(reps[faster]) < min(reps[slower]) if min(len(rank0), len(sharded)) > 1 else None,
    }


def combine(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the slowest rank per rep, every rep, bytes per rank, and a verdict per figure."""
    keys = sorted(ranks[0]["times"])
    reps = {k: [max(t) for t in zip(*(r["times"][k] for r in ranks), strict=True)] for k in keys}
    out: dict[str, Any] = {k: statistics.median(v) for k, v in reps.items()}
    out["reps_s"] = reps
    out["figures"] = {name: verdict(reps[a], reps[b]) for name, (a, b) in FIGURES.items()}
    out["rank0_path_faster_on"] = [name for name, v in out["figures"].items() if v["faster"] == "rank0_path"]
    out["per_rank"] = [
        {
            "rank": r["rank"],
            "bytes_written": {p: statistics.median(r["bytes_written"][p]) for p in PATHS},
        }
        for r in ranks
    ]
    out["bytes_written_total"] = {p: sum(r["bytes_written"][p] for r in out["per_rank"]) for p in PATHS}
    exact = {p: all(all(r["restored_bit_exact"][p]) for r in ranks) for p in ranks[0]["restored_bit_exact"]}
    out["restored_bit_exact"] = exact
    out["ranks_agree"] = len({r["digest"] for r in ranks}) == 1  # DDP keeps every replica the same
    return out


def run(params: int, reps: int, world_size: int, workdir: Path, timeout_s: float = 1800) -> dict[str, Any]:
    """Both DDP checkpoint paths side by side, with the machine and its load."""
    check(world_size, "cpu")
    load_before = os.getloadavg()
    out_dir = workdir / "out"
    out_dir.mkdir(parents=True)
    config = workdir / "config.json"
    config.write_text(
        json.dumps({"params": params, "reps": reps, "workdir": str(workdir), "out": str(out_dir)})
    )
    torchrun(world_size, config, timeout_s)
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    out = combine(ranks)
    if not all(out["restored_bit_exact"].values()) or not out["ranks_agree"]:
        raise BenchRunError(
            f"ddp-paths benchmark: a restore did not give the saved state back bit for bit "
            f"({out['restored_bit_exact']}, ranks agree: {out['ranks_agree']})"
        )
    for name, v in out["figures"].items():
        log.info(
            "%s: %s faster (%.3f s rank-0 path, %.3f s sharded, x%.2f%s)",
            name,
            v["faster"],
            v["rank0_path_s"],
            v["sharded_s"],
            v["ratio"] or 0.0,
            "" if v["clear"] else "; not clear from these reps",
        )
    out.update(
        ddp_paths=True,
        world_size=world_size,
        params=ranks[0]["params"],
        state_bytes=ranks[0]["state_bytes"],
        reps=reps,
        device="cpu",
        first_per_rep=ranks[0]["first"],
        definitions=DEFINITIONS,
        machine=machine(),
        load_average={
            "start_1_5_15m": list(load_before),
            "end_1_5_15m": list(os.getloadavg()),
            "per_rep_1m": ranks[0]["load_average_1m_per_rep"],
        },
    )
    return out
