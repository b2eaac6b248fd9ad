"""`bench checkpoint --sharded`: FSDP2 on `world_size` ranks (torchrun), our sharded store against DCP's own
save, async_save and load, and in-process rollback against a relaunch; medians, every rep kept.

One torchrun measures everything but the relaunch side by side (`sharded_child.py measure`), each rep timing
every key once, so load from other work on the host weighs on the baselines and on ours alike. Then `reps` fresh
torchruns (`sharded_child.py relaunch`) restore the last commit, each timed from here: from exec until every
rank has restored and passed a barrier.

A time over ranks is the slowest rank's: the step after it waits for every rank.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.common import BenchError, BenchRunError, machine, run_torchrun, target

log = logging.getLogger("rollback_supervisor.bench")
CHILD = Path(__file__).resolve().parent / "sharded_child.py"
#: Our ratio against each baseline, with its goal (issue 17, "Benchmark").
TARGETS = {
    "blocking_vs_async_save": ("blocking_save_s", "dcp_async_save_blocking_s", 1.0),
    "blocking_vs_dcp_save": ("blocking_save_s", "dcp_save_s", 0.10),
    "restore_vs_dcp_load": ("restore_disk_s", "dcp_load_s", 1.0),
    "in_process_vs_relaunch": ("in_process_rollback_s", "relaunch_s", 0.1),
}
#: A relaunch's clock readings (the child's names) as the JSON names them: seconds from the exec, slowest rank;
#: the restore follows the model build, and relaunch_s ends it.
RELAUNCH_PHASES = {
    "start": "rank_interpreter_up_s",
    "imported": "imports_done_s",
    "process_group": "process_group_up_s",
    "built": "model_built_s",
}
#: dcp.async_save's ways to stage, as the JSON names them (the faster one is the baseline).
#: Our save's ways, as the JSON names them; blocking_save_s is the faster, which is named in the JSON.
OURS_VARIANTS = {
    "copy": "blocking_save_copy_s",
    "overlap": "blocking_save_overlap_s",
}
ASYNC_VARIANTS = {
    "writer_stager": "dcp_async_save_writer_stager_s",
    "default_stager": "dcp_async_save_default_stager_s",
}


def check_device(device: str, world_size: int) -> None:
    """cpu always; cuda only with at least one GPU per rank (refused before anything starts)."""
    if device not in ("cpu", "cuda"):
        raise BenchError(f"--device: expected cpu or cuda, got {device!r}")
    if world_size < 2:
        raise BenchError(f"--world-size: expected at least 2 ranks for a sharded run, got {world_size}")
    if device == "cuda":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < world_size:
            raise BenchError(
                f"--device cuda: expected a CUDA GPU per rank ({world_size}), found {found} "
                f"(torch {torch.__version__}); run with --device cpu, or on a machine with GPUs"
            )


def torchrun(world_size: int, mode: str, config: Path, timeout_s: float) -> float:
    """The child's `mode` on `world_size` ranks; the monotonic time of the exec."""
    return run_torchrun(CHILD, [mode, str(config)], world_size, timeout_s, f"sharded benchmark ({mode})")


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Per rep, the slowest rank's time."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def combine(ranks: list[dict[str, Any]], relaunch: list[float]) -> dict[str, Any]:
    """Medians of the slowest rank per rep, every rep, bytes and throughput per rank, the ratios."""
    keys = sorted(ranks[0]["times"])
    reps = {key: _slowest([r["times"][key] for r in ranks]) for key in keys}
    reps["relaunch_s"] = relaunch
    variants = {name: statistics.median(reps[key]) for name, key in ASYNC_VARIANTS.items()}
    best = min(variants, key=variants.__getitem__)
    reps["dcp_async_save_blocking_s"] = reps[ASYNC_VARIANTS[best]]
    ours = {name: statistics.median(reps[key]) for name, key in OURS_VARIANTS.items() if key in reps}
    if ours:  # an async save: the blocking time of the faster way (a synchronous one times blocking_save_s)
        mine = min(ours, key=ours.__getitem__)
        reps["blocking_save_s"] = reps[OURS_VARIANTS[mine]]
    out: dict[str, Any] = {key: statistics.median(values) for key, values in sorted(reps.items())}
    out["dcp_async_save_variant"] = best
    out["blocking_save_variant"] = mine if ours else "sync"
    out["reps_s"] = reps
    out["per_rank"] = [
        {
            "rank": r["rank"],
            "local_state_bytes": r["local_state_bytes"],
            "params_local": r["params_local"],
            "bytes_written": statistics.median(r["bytes_written"]),
            "write_s": statistics.median(r["write_s"]),
            "write_throughput_mb_s": statistics.median(
                b / s / 1e6 for b, s in zip(r["bytes_written"], r["write_s"], strict=True)
            ),
        }
        for r in ranks
    ]
    out["targets"] = {
        name: {"of": f"{num}/{den}", **target(out[num] / out[den] if out[den] else None, goal)}
        for name, (num, den, goal) in TARGETS.items()
    }
    out["blocking_vs_async_save_by_variant"] = {
        name: out["blocking_save_s"] / value if value else None for name, value in variants.items()
    }
    return out


def run(
    params: int, reps: int, world_size: int, workdir: Path, device: str = "cpu", timeout_s: float = 1800
) -> dict[str, Any]:
    """Every measurement of issue 17's table, with the paths measured, the machine and its load."""
    check_device(device, world_size)
    load_before = os.getloadavg()[0]
    out_dir = workdir / "out"
    out_dir.mkdir(parents=True)
    config = workdir / "config.json"
    base = {"params": params, "reps": reps, "device": device, "workdir": str(workdir), "out": str(out_dir)}
    config.write_text(json.dumps(base))
    t0 = time.monotonic()
    torchrun(world_size, "measure", config, timeout_s)
    measured_s = time.monotonic() - t0
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]
    relaunch: list[float] = []
    phases: list[dict[str, float]] = []
    equal = True
    for attempt in range(reps):
        config.write_text(json.dumps({**base, "attempt": attempt}))
        t_exec = torchrun(world_size, "relaunch", config, timeout_s)
        got = [
            json.loads((out_dir / f"relaunch-{attempt}.rank{r}.json").read_text()) for r in range(world_size)
        ]
        relaunch.append(max(g["t_ready"] for g in got) - t_exec)
        phases.append(
            {key: max(g[f"t_{name}"] for g in got) - t_exec for name, key in RELAUNCH_PHASES.items()}
        )
        for g in got:
            mine = ranks[g["rank"]]
            equal &= g["checkpoint"] == mine["last_checkpoint"] and g["digest"] == mine["digest"]
    if not equal:
        raise BenchRunError(
            "sharded benchmark: a relaunch did not restore the last commit bit for bit (per-rank digests differ)"
        )
    out = combine(ranks, relaunch)
    out["relaunch_phases_s"] = {key: statistics.median(p[key] for p in phases) for key in phases[0]}
    out["relaunch_restored_bit_exact"] = equal
    state_bytes = sum(r["local_state_bytes"] for r in ranks)
    from_disk = max(r["in_process_from_disk"] for r in ranks)
    out.update(
        sharded=True,
        world_size=world_size,
        params=sum(r["params_local"] for r in ranks),
        state_bytes=state_bytes,
        reps=reps,
        device=ranks[0]["device"] if device == "cpu" else _gpu_name(),
        paths_measured={
            "blocking_save_s": f"the faster of our async save's ways {sorted(OURS_VARIANTS)}: "
            f"{out['blocking_save_variant']}"
            if ranks[0]["paths"]["async_save"]
            else "synchronous save (this ShardedCheckpoints has no blocking=False): blocked until committed",
            "in_process_rollback_s": f"restore_memory (host ring); {from_disk} of {reps} went to disk instead"
            if ranks[0]["paths"]["restore_memory"]
            else "restore from the local store (this ShardedCheckpoints has no restore_memory)",
            "dcp_async_save_blocking_s": f"the faster of {sorted(ASYNC_VARIANTS)}: {out['dcp_async_save_variant']}",
            "restore_verify": ranks[0]["verify"],
        },
        definitions={
            "times": "per rep, the slowest rank (every rank starts after a barrier); medians of reps",
            "blocking_save_s": "training thread blocked by our save: the faster of the two ways below",
            "blocking_save_copy_s": "save(blocking=False): returns after the copy into the host ring",
            "blocking_save_overlap_s": "save(blocking=False, overlap=True): until it returns (buffers copied), "
            "plus the wait for the copy of parameters and optimizer state after the next forward and backward "
            "(the optimizer's step waits for it): charged as dcp_async_save_default_stager_s is",
            "save_total_s": "from our save call until every rank's files are committed (an async save "
            "writes beside the next forward and backward, timed as ours_overlapped_fwd_bwd_s)",
            "ours_overlapped_fwd_bwd_s": "a forward and backward run while our save writes in the background "
            "(compare fwd_bwd_s)",
            "fwd_bwd_s": "a forward and backward with nothing in the background",
            "dcp_save_s": "dcp.save with the stock FileSystemWriter into a fresh directory on the same disk",
            "dcp_async_save_writer_stager_s": "dcp.async_save with a FileSystemWriter (it stages: a blocking "
            "copy), until it returns",
            "dcp_async_save_default_stager_s": "dcp.async_save with a reused DefaultStager staging on its own "
            "thread: until it returns, plus the wait for the staging after the next forward and backward (an "
            "optimizer step must not run before the staging is done)",
            "dcp_async_save_default_stager_staging_s": "from that call until its staging thread was done (what "
            "the wait would be if no forward and backward hid it)",
            "dcp_async_overlapped_fwd_bwd_s": "that forward and backward, run while the DefaultStager stages "
            "(compare fwd_bwd_s: for DCP and for us, the background work's cost to training is not in the "
            "blocking time)",
            "dcp_load_s": "dcp.load of the dcp.save directory into the live sharded state dict, then "
            "set_state_dict",
            "restore_disk_s": "our restore of the same step from the local store (checksums verified)",
            "in_process_rollback_s": "the rollback in the running processes (see paths_measured)",
            "relaunch_s": "a fresh torchrun of every rank, from exec until every rank has restored the last "
            "commit and passed a barrier (interpreter, imports, process group, model build on the meta device "
            "then to_empty, as the restore overwrites every value, restore)",
            "memcpy_s": "floor: one copy of this rank's local shard bytes into a preallocated buffer",
            "write_throughput_mb_s": "bytes this rank wrote / its blob write time (DCP write_data, with fsync)",
        },
        measure_run_s=measured_s,
        machine=machine(),
    )
    out["load_average_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    return out


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name()
