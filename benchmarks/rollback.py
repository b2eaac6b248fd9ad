"""`bench rollback` measurements: anomaly to first resumed step, in process, by relaunch, and naively.

Every figure ends when a training step has completed after the restore (one step is included in each); the
step time itself is reported next to them, with the same ratios computed without it. All three paths read
files the benchmark has just written, so each runs against a warm page cache.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import BenchRunError, child_env, machine, median, ratio, target
from benchmarks.rollback_child import Example, write_plan

TARGETS = {
    "in_process_s/naive_restart_s": 0.1,
    "relaunch_s/naive_restart_s": 1.0,
    "relaunch_standby_s/naive_restart_s": 0.3,
    "relaunch_parked_s/naive_restart_s": 0.3,
    "relaunch_preloaded_s/naive_restart_s": 0.3,
}
CHILD_TIMEOUT_S = 3600.0


def _child(cmd: list[str], log: Path, env: dict[str, str], what: str) -> None:
    with log.open("ab") as out:
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise BenchRunError(f"{what} exited {proc.returncode}; the end of {log}:\n{tail}")


def in_process(workdir: Path, example: Example, reps: int) -> dict[str, Any]:
    """One training process with `reps` injected anomalies, each rolled back in process."""
    out = workdir / "inprocess.json"
    run_id = _create_run(workdir)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.rollback_child",
        "inprocess",
        "--workdir",
        str(workdir),
        "--anomalies",
        str(reps),
        "--out",
        str(out),
        "--run-id",
        run_id,
        *example.options(),
    ]
    _child(cmd, workdir / "inprocess.log", child_env(), "the in-process run")
    result = json.loads(out.read_text())
    _ship(workdir / "plan.json", [a["target_step"] for a in result["anomalies"]])
    return result


def replay(workdir: Path, example: Example) -> dict[str, Any]:
    """One replay (monitor.replay) of a step a flipped bit made wrong: its cost, in its own process."""
    out, sub = workdir / "replay.json", workdir / "replay"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.rollback_child",
        "replay",
        "--workdir",
        str(sub),
        "--out",
        str(out),
        "--run-id",
        _create_run(sub),
        *example.options(),
    ]
    _child(cmd, workdir / "replay.log", child_env(), "the replay run")
    return json.loads(out.read_text())


def _create_run(workdir: Path) -> str:
    """The lineage's MLflow run, created as `rollback-supervisor run` creates it."""
    from mlflow.tracking import MlflowClient

    from benchmarks.rollback_child import POLICY_NAME
    from supervisor.tracking import creating_store, start_run

    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    with creating_store(uri):  # a copy of the cached empty store, not every migration again (untimed)
        client = MlflowClient(tracking_uri=uri)
        return start_run(client, "rollback-supervisor", "bench-rollback", POLICY_NAME, workdir)


def relaunch(workdir: Path, inproc: dict[str, Any], example: Example, i: int) -> dict[str, float]:
    """The example started on a plan naming the checkpoint, up to its first step; its timings."""
    from supervisor.runtime.plan import PLAN_ENV

    plan = write_plan(workdir, run_id=inproc["run_id"], checkpoint_id=inproc["checkpoint_id"])
    out = workdir / f"relaunch-{i}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.rollback_child",
        "relaunch",
        "--out",
        str(out),
        "--",
        *example.charlm_args(),
    ]
    started = time.time()
    _child(cmd, workdir / "relaunch.log", child_env(**{PLAN_ENV: str(plan)}), "the relaunched example")
    m = json.loads(out.read_text())
    if m.get("restored_step") != inproc["checkpoint_step"]:
        raise BenchRunError(
            f"the relaunch restored step {m.get('restored_step')}, expected {inproc['checkpoint_step']}"
        )
    _ship(plan, [inproc["checkpoint_step"]])
    return {
        "total_s": m["done"] - started,
        "ready_s": m["restored"] - started,
        "interpreter_s": m["started"] - started,
        "import_s": m["imported"] - m["started"],
        "build_s": m["built"] - m["imported"],
        "session_s": m["session"] - m["built"],
        "restore_s": m["restored"] - m["session"],
        "step_s": m["done"] - m["restored"],
    }


def standby_launcher(example: Example, park: str = "imports", preload: Path | None = None) -> Any:
    """A standby launcher whose parked process imports what a standby of `python examples/charlm.py` would.

    The relaunch child wraps the example (`-m benchmarks.rollback_child`), so the example's own top-level
    imports, which the supervisor finds with `ast` in the script it runs, are named explicitly. No standby is
    started behind a measured relaunch: each is parked by hand, and the launcher's own one waits an hour.
    `park="plan"`: the parked process runs the relaunch child up to the example's `Session.attach`; with
    `preload` (the checkpoint directory) it also keeps the newest commit there read into memory.
    """
    from benchmarks.common import CHARLM
    from supervisor.launcher.standby import StandbyLauncher, StandbyOptions
    from supervisor.launcher.standby_child import top_level_imports

    imports = tuple(top_level_imports(CHARLM.read_text())) + ("benchmarks.common",)
    options = StandbyOptions(
        imports=imports,
        delay_seconds=3600.0,
        park=park,
        park_timeout_seconds=CHILD_TIMEOUT_S,
        preload=str(preload) if preload else None,
    )
    return StandbyLauncher(options)


def relaunch_standby(
    workdir: Path, inproc: dict[str, Any], example: Example, i: int, launcher: Any
) -> dict[str, Any]:
    """The relaunch of `relaunch()`, started in a parked standby: from the plan sent to the first step done.

    A launcher that parks at the plan (`park="plan"`) has run the child up to `Session.attach` beforehand:
    its import and build marks are then the parking's, and `activate_s` ends with the Session set up.
    """
    from supervisor.launcher import LaunchSpec
    from supervisor.runtime.plan import PLAN_ENV

    at_plan = launcher.park_point == "plan"
    preloading = bool(launcher.options.preload)
    plan = write_plan(workdir, run_id=inproc["run_id"], checkpoint_id=inproc["checkpoint_id"])
    kind = "preloaded" if preloading else "parked" if at_plan else "standby"
    out = workdir / f"{kind}-{i}.json"
    command = (sys.executable, "-m", "benchmarks.rollback_child", "relaunch", "--out", str(out), "--")
    spec = LaunchSpec(
        (*command, *example.charlm_args()), child_env(**{PLAN_ENV: str(plan)}), inherit_env=False
    )
    parked = launcher.park_for(spec)
    if parked is None or not parked.wait_ready(CHILD_TIMEOUT_S):
        raise BenchRunError(f"the standby did not park; see the log of pid {parked.pid if parked else None}")
    rss = parked.rss_bytes()
    lines: list[str] = []
    started = time.time()
    handle = launcher.start(spec, lambda stream, line: lines.append(f"{stream}: {line}"))
    info = handle.wait(CHILD_TIMEOUT_S)
    with (workdir / "standby.log").open("a") as log:
        log.write("\n".join(lines) + "\n")
    if int(handle.handle_id) != parked.pid or info.returncode != 0:
        raise BenchRunError(
            f"the standby relaunch ran in pid {handle.handle_id} (parked: {parked.pid}) and exited "
            f"{info.returncode}; see {workdir / 'standby.log'}"
        )
    m = json.loads(out.read_text())
    if m.get("restored_step") != inproc["checkpoint_step"]:
        raise BenchRunError(
            f"the standby relaunch restored step {m.get('restored_step')}, expected {inproc['checkpoint_step']}"
        )
    _ship(plan, [inproc["checkpoint_step"]])
    want = "preloaded" if preloading else "local"
    if m.get("tier") != want or (preloading and parked.report.get("preloaded") != inproc["checkpoint_id"]):
        raise BenchRunError(
            f"the {kind} relaunch restored from the {m.get('tier')} tier (parked holding "
            f"{parked.report.get('preloaded')}), expected the {want} tier; see {workdir / 'standby.log'}"
        )
    if at_plan:  # interpreter, imports and build happened while parked (parked_s); timed: Session on
        return {
            "total_s": m["done"] - started,
            "ready_s": m["restored"] - started,
            "activate_s": m["session"] - started,
            "restore_s": m["restored"] - m["session"],
            "step_s": m["done"] - m["restored"],
            "parked_s": parked.report["imports_s"],
            "parked_build_s": m["built"] - m["imported"],
            "parked_rss_bytes": rss,
        }
    return {
        "total_s": m["done"] - started,
        "ready_s": m["restored"] - started,
        "activate_s": m["started"] - started,
        "import_s": m["imported"] - m["started"],
        "build_s": m["built"] - m["imported"],
        "session_s": m["session"] - m["built"],
        "restore_s": m["restored"] - m["session"],
        "step_s": m["done"] - m["restored"],
        "parked_imports_s": parked.report["imports_s"],
        "parked_rss_bytes": rss,
    }


def _ship(plan_path: Path, restored_steps: list[int]) -> None:
    """Do the supervisor's part, untimed: ship a plan's spool to MLflow and check that its restores are there."""
    from mlflow.tracking import MlflowClient

    from supervisor.monitor.shipper import SpoolShipper
    from supervisor.runtime.plan import LaunchPlan

    plan = LaunchPlan.read(plan_path)
    client = MlflowClient(tracking_uri=plan.tracking_uri)
    if not SpoolShipper(client, plan.run_id, plan.metrics_spool).drain():
        raise BenchRunError(f"could not ship {plan.metrics_spool} to MLflow")
    steps = [m.value for m in client.get_metric_history(plan.run_id, "rollback.restored_step")]
    if not set(restored_steps) <= set(steps):
        raise BenchRunError(f"rollback.restored_step {restored_steps} did not all reach MLflow: {steps}")


def naive(workdir: Path, inproc: dict[str, Any], example: Example, i: int) -> dict[str, Any]:
    """A plain script that torch.loads the same state and takes one step; its timings."""
    out = workdir / f"naive-{i}.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.naive_restart",
        "--state",
        inproc["naive_path"],
        "--out",
        str(out),
        *example.options(),
    ]
    started = time.time()
    _child(cmd, workdir / "naive.log", child_env(), "the naive restart")
    timings = json.loads(out.read_text())
    total = timings["done"] - started
    return {
        **timings,
        "total_s": total,
        "ready_s": total - timings["step_s"],
        "interpreter_s": timings["started"] - started,
    }


#: The paths measured once per repetition, in the order `run` measures them.
PATHS = ("relaunch", "relaunch_standby", "relaunch_parked", "relaunch_preloaded", "naive_restart")


def phases(reps: int) -> list[str]:
    """The phases of `run`, in order: the in-process run, one replay, then each path of each repetition
    (`relaunch-1`)."""
    return ["in_process", "replay", *(f"{path}-{i + 1}" for i in range(reps) for path in PATHS)]


def run(
    workdir: Path,
    size: str,
    reps: int,
    batch_size: int = 1,
    threads: int | None = None,
    device: str = "cpu",
    say: Callable[[str], None] = lambda _: None,
    on_phase: Callable[[str, dict[str, Any]], None] = lambda phase, result: None,
) -> dict[str, Any]:
    """Measure all three paths `reps` times (relaunch and naive interleaved) and summarise with medians.

    After each phase (see `phases`), `on_phase` gets its name and the summary of every sample so far."""
    load_start = os.getloadavg()[0]
    info = {
        "size": size,
        "reps": reps,
        "batch_size": batch_size,
        "threads": threads,
        "load_start": load_start,
        "device": device,
    }
    say(f"in-process: {reps} anomalies at size {size}")
    example = Example(size, batch_size, threads, device)
    inproc = in_process(workdir, example, reps)
    samples: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    replayed: dict[str, Any] = {}

    def summary() -> dict[str, Any]:
        return summarize(
            inproc,
            samples["relaunch"],
            samples["naive_restart"],
            standbys=samples["relaunch_standby"],
            parked=samples["relaunch_parked"],
            preloaded=samples["relaunch_preloaded"],
            replayed=replayed or None,
            **info,
        )

    on_phase("in_process", summary())
    say(f"replay: one replay of a step a flipped bit made wrong, at size {size}")
    replayed.update(replay(workdir, example))
    on_phase("replay", summary())
    with (
        standby_launcher(example) as launcher,
        standby_launcher(example, park="plan") as at_plan,
        standby_launcher(example, park="plan", preload=workdir / "checkpoints") as preloading,
    ):
        measure = {
            "relaunch": ("relaunch", lambda i: relaunch(workdir, inproc, example, i)),
            "relaunch_standby": (
                "relaunch through the standby",
                lambda i: relaunch_standby(workdir, inproc, example, i, launcher),
            ),
            "relaunch_parked": (
                "relaunch through the standby parked at its plan",
                lambda i: relaunch_standby(workdir, inproc, example, i, at_plan),
            ),
            "relaunch_preloaded": (
                "relaunch through the standby parked at its plan with the checkpoint preloaded",
                lambda i: relaunch_standby(workdir, inproc, example, i, preloading),
            ),
            "naive_restart": ("naive restart", lambda i: naive(workdir, inproc, example, i)),
        }
        for i in range(reps):
            for path in PATHS:
                words, take = measure[path]
                say(f"{words} {i + 1}/{reps}")
                samples[path].append(take(i))
                on_phase(f"{path}-{i + 1}", summary())
    return summary()


def summarize(
    inproc: dict[str, Any],
    relaunches: list[dict[str, Any]],
    naives: list[dict[str, Any]],
    standbys: list[dict[str, Any]] | None = None,
    parked: list[dict[str, Any]] | None = None,
    preloaded: list[dict[str, Any]] | None = None,
    replayed: dict[str, Any] | None = None,
    **info: Any,
) -> dict[str, Any]:
    """Medians, the issue's two ratios, and the same ratios up to the restore (the step taken out)."""
    anomalies = inproc["anomalies"]

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        return median([r[key] for r in rows])

    full = {
        "in_process_s": med(anomalies, "total_s"),
        "relaunch_s": med(relaunches, "total_s"),
        "naive_restart_s": med(naives, "total_s"),
    }
    ready = {
        "in_process_s": med(anomalies, "handler_s"),
        "relaunch_s": med(relaunches, "ready_s"),
        "naive_restart_s": med(naives, "ready_s"),
    }
    standby: dict[str, Any] = {}
    if standbys is not None:  # measured (the CLI always measures it)
        full["relaunch_standby_s"] = med(standbys, "total_s")
        ready["relaunch_standby_s"] = med(standbys, "ready_s")
        standby["relaunch_standby"] = {
            **{k: med(standbys, k) for k in _PHASES["standby"]},
            "samples": standbys,
        }
    if parked is not None:  # measured (the CLI always measures it)
        full["relaunch_parked_s"] = med(parked, "total_s")
        ready["relaunch_parked_s"] = med(parked, "ready_s")
        standby["relaunch_parked"] = {**{k: med(parked, k) for k in _PHASES["parked"]}, "samples": parked}
    if preloaded is not None:  # measured (the CLI always measures it)
        full["relaunch_preloaded_s"] = med(preloaded, "total_s")
        ready["relaunch_preloaded_s"] = med(preloaded, "ready_s")
        standby["relaunch_preloaded"] = {
            **{k: med(preloaded, k) for k in _PHASES["parked"]},
            "samples": preloaded,
        }
    targets = {}
    for suffix, values in (("", full), (" (step excluded)", ready)):
        for key, goal in TARGETS.items():
            num, den = key.split("/")
            if num not in values:
                continue
            targets[key + suffix] = target(ratio(values[num], values[den]), goal)
    replay_view: dict[str, Any] = {}
    if (
        replayed is not None
    ):  # the replay: its restore and two replayed steps, against two steps and a restore
        restore_s = med(anomalies, "restore_s")
        budget = 2 * median(replayed["steps_s"]) + restore_s if replayed["steps_s"] and restore_s else None
        targets["replay_s/(2 steps + memory restore)"] = target(ratio(replayed["replay_s"], budget), 1.0)
        replay_view = {
            "replay_s": replayed["replay_s"],
            "replay": {
                "replay_s": replayed["replay_s"],
                "two_steps_and_restore_s": budget,
                "step_s": median(replayed["steps_s"]),
                "memory_restore_s": restore_s,
                "verdict": replayed["verdict"]["verdict"],
                "steps": replayed["verdict"]["steps"],
                "fault": replayed["fault"],
                "from_step": replayed["verdict"]["from_step"],
                "onset_step": replayed["verdict"]["onset_step"],
                "note": "monitor.replay on, checkpoints every 4 steps, a bit flipped once after step 5's update "
                "(the drill's sdc@5): the replay restores the snapshot of step 4 from the memory ring and runs "
                "steps 5 and 6 again (replay_s: from the anomaly to the verdict, restore included); the budget "
                "is two uninterrupted steps of the same run (the median of the steps before the fault) plus the "
                "in-process run's memory restore",
            },
        }
    # With the step included, no recovery path can be faster than the step itself: the in-process ratio's floor.
    resumed_step = med(anomalies, "step_s")
    step_floor = ratio(resumed_step, full["naive_restart_s"])
    return {
        "size": info["size"],
        "params": inproc["params"],
        "state_bytes": inproc["naive_bytes"],
        "batch_size": info["batch_size"],
        "threads": info["threads"],
        "device": _device_name(info.get("device", "cpu")),
        "reps": info["reps"],
        **full,
        "step_s": median(inproc["steps_s"]),
        "step_included": True,
        "excluding_step": ready,
        "targets": targets,
        "step_floor": {
            "in_process_s/naive_restart_s": step_floor,
            "note": "the first resumed step alone (in process) over the naive restart: what the step-included "
            "in-process ratio would be with a recovery that took no time at all",
        },
        "in_process": {
            "restore_s": med(anomalies, "restore_s"),
            "resumed_step_s": resumed_step,
            "tiers": [a["tier"] for a in anomalies],
            "samples": anomalies,
        },
        "relaunch": {
            **{k: med(relaunches, k) for k in _PHASES["relaunch"]},
            "checkpoint_id": inproc["checkpoint_id"],
            "samples": relaunches,
        },
        **standby,
        **replay_view,
        "naive_restart": {**{k: med(naives, k) for k in _PHASES["naive"]}, "samples": naives},
        "machine": {**machine(), "load_average_1m_start": round(info["load_start"], 2)},
        "notes": [
            "in_process_s, relaunch_s and naive_restart_s each end when one training step has completed "
            "after the restore (step_included); step_s is the median uninterrupted step of the in-process "
            "run. excluding_step ends them when training can resume: the in-process rollback handler alone "
            "(decide, restore from the memory ring, report; a checkpoint write in flight is not waited for), "
            "and each new process up to its restore.",
            "in_process_s: from the in-process detector firing to the first resumed step done, same PID. "
            "relaunch_s: process start -> interpreter -> imports (torch, the supervisor) -> build -> "
            "Session set-up -> restore from disk per the plan (verify: full) -> step done. As under "
            "`rollback-supervisor run`, both training processes get plans naming the lineage's MLflow run and a "
            "metric spool, so neither imports MLflow; the benchmark ships the spools after the timing and checks "
            "that every rollback.restored_step reached MLflow. naive_restart_s: "
            "process start -> interpreter -> import torch and the model -> build -> "
            "torch.load(weights_only=True) + load_state_dict -> step done; it imports neither MLflow nor the "
            "supervisor runtime.",
            "relaunch_standby_s: the same relaunch started in a parked standby (policy `relaunch: {standby: "
            "true}`): a process started beforehand of the same command, interpreter up and the example's "
            "top-level imports (torch, the supervisor runtime) done, waiting on a pipe. Timed from the moment "
            "the supervisor sends it the plan (argv, cwd, environment) -> the command runs as __main__ "
            "(activate_s) -> the rest as relaunch_s. parked_rss_bytes: the parked process's resident memory, "
            "its cost while a segment runs; parked_imports_s: how long it took to park (off the critical path).",
            "relaunch_parked_s: the same, parked at its plan (policy `relaunch: {standby: true, park: plan}`): "
            "the standby ran the command from its first line, built the model, data and optimizer and waited "
            "in `load_plan` (`Session.attach`). Timed from the plan sent -> per-segment environment set, Session "
            "set up (activate_s) -> restore -> step done. parked_s: start to park point, parked_build_s: its "
            "model build, parked_rss_bytes: its memory with the model built (all off the critical path).",
            "relaunch_preloaded_s: the same as relaunch_parked_s, with `relaunch: {standby: true, park: plan, "
            "preload: true}`: while parked, the standby also read the newest commit of the lineage's store into "
            "memory (verified in full); the restore of that checkpoint copies it into the built model and hands "
            "the optimizer state over, with no disk read. parked_s includes that read; parked_rss_bytes the "
            "copy it holds.",
            "All paths read files just written by this benchmark: warm page cache.",
        ],
    }


@functools.cache
def _device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return device


_PHASES = {
    "relaunch": ("interpreter_s", "import_s", "build_s", "session_s", "restore_s", "step_s"),
    "naive": ("interpreter_s", "import_s", "build_s", "load_s", "step_s"),
    "standby": (
        "activate_s",
        "import_s",
        "build_s",
        "session_s",
        "restore_s",
        "step_s",
        "parked_imports_s",
        "parked_rss_bytes",
    ),
    "parked": ("activate_s", "restore_s", "step_s", "parked_s", "parked_build_s", "parked_rss_bytes"),
}
