"""`bench rollback --integration`: recovery under the Lightning and HF Trainer callbacks against the framework's
own resume, measured side by side in one run.

Per integration, on its example (examples/lightning_cnn.py, examples/hf_tiny_gpt.py):

- `relaunch_s`: a fresh process on a plan naming our checkpoint of step AT_STEP (as the supervisor starts a
  segment), restored by the callback, to the end of the first resumed step;
- `framework_resume_s`: a fresh process resuming the framework's own checkpoint of the same state at the same
  step (`trainer.fit(model, ckpt_path=...)`, `trainer.train(resume_from_checkpoint=...)`), to the same end;
- `in_process_s` (Lightning): anomaly to the end of the first resumed step inside one process; the HF Trainer
  has no in-process rollback (its anomalies exit 76 and the supervisor relaunches: `relaunch_s`).

Script mode (`script`) runs tests/scripts/train_mlp.py, a nanoGPT-style script that imports nothing of ours,
as it is: `relaunch_s` is the supervisor putting our stored version of its `ckpt.pt` back in place, then the
script's own `--init_from=resume` in a fresh process; `framework_resume_s` is that same command on the
script's own file of the same state. Both are read from outside, by the lines the script prints.

Every figure includes the first resumed step; `excluding_step` ends each at the first step's start. The two
fresh-process paths run interleaved, `reps` times each, each going first every other time, and read files
just written (warm page cache).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, BenchError, BenchRunError, child_env, machine, median, ratio, target
from benchmarks.integration_child import AT_STEP, DEFAULT_SIZE, EXAMPLES, INTEGRATIONS, SIZES, Workload

TARGETS = {"relaunch_s/framework_resume_s": 1.0}
#: What `--integration` accepts.
CHOICES = (*INTEGRATIONS, "script")
SCRIPT = REPO / "tests" / "scripts" / "train_mlp.py"
#: The script's arguments in every run: a stable learning rate, and no periodic save inside the measured steps.
SCRIPT_ARGS = ("--learning_rate=0.3", "--warmup_iters=100", "--save_interval=1000")
CHILD_TIMEOUT_S = 1800.0
#: integration -> the framework's own resume, as the JSON names it.
FRAMEWORK_RESUME = {
    "lightning": "trainer.fit(model, ckpt_path=<trainer.save_checkpoint() file>)",
    "transformers": "trainer.train(resume_from_checkpoint=<save_strategy='steps' checkpoint-N directory>)",
    "script": "python tests/scripts/train_mlp.py --init_from=resume (its own torch.load of out/ckpt.pt)",
}
NO_IN_PROCESS = {
    "transformers": "the HF Trainer fixes its epoch and step ranges before on_train_begin and holds the epoch's "
    "iterator inside its loop, so a callback cannot rewind it: an anomaly exits 76 and the supervisor relaunches "
    "on a plan, which is relaunch_s",
    "script": "an unmodified script has no in-process path: the supervisor reads it from outside, and every "
    "recovery is a relaunch (relaunch_s)",
}


def check(integration: str, size: str | None, device: str, world_size: int = 1) -> str | None:
    """The size to run at (None for the script, which runs as it is); refuses what this cannot measure."""
    if integration not in CHOICES:
        raise BenchError(f"--integration: expected one of {', '.join(CHOICES)}, got {integration!r}")
    if world_size < 1:
        raise BenchError(f"--world-size: expected 1 or more processes, got {world_size}")
    if world_size > 1 and integration == "script":
        raise BenchError(
            f"--world-size {world_size} with --integration script: the script runs as one process here "
            "(tests/test_script_mode_torchrun.py runs its DDP form); leave --world-size at 1"
        )
    if device != "cpu":
        raise BenchError(
            f"--device {device} with --integration: the integration examples train on the CPU here; leave "
            "--device at cpu"
        )
    if integration == "script":
        if size is not None:
            raise BenchError(
                f"--size {size} with --integration script: the script runs as it is ({SCRIPT.name}, a small "
                "MLP); leave --size out"
            )
        workload = SCRIPT
    else:
        size = size or DEFAULT_SIZE
        if size not in SIZES:
            raise BenchError(f"--size: expected one of {', '.join(SIZES)}, got {size!r}")
        workload = REPO / "examples" / EXAMPLES[integration]
    if not workload.exists():
        raise BenchError(f"{workload}: the workload is missing; run the benchmark from a source checkout")
    return size


def _child(cmd: list[str], log: Path, env: dict[str, str], what: str, cwd: Path) -> None:
    with log.open("ab") as out:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, timeout=CHILD_TIMEOUT_S
        )
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise BenchRunError(f"{what} exited {proc.returncode}; the end of {log}:\n{tail}")


def _child_cmd(mode: str, out: Path, w: Workload, *extra: str, torchrun: bool = True) -> list[str]:
    """The child's command; at world size > 1 under torchrun, unless a torchrun launcher adds it (`torchrun`
    False: the standby's)."""
    launch = [sys.executable]
    if w.world_size > 1 and torchrun:  # torchrun starts the ranks; rank 0 writes `out`
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={w.world_size}"]
    return [
        *launch,
        "-m",
        "benchmarks.integration_child",
        mode,
        "--out",
        str(out),
        *extra,
        *w.options(),
    ]


def _create_run(workdir: Path, integration: str) -> str:
    """The lineage's MLflow run, created as `rollback-supervisor run` creates it."""
    from mlflow.tracking import MlflowClient

    from supervisor.tracking import start_run

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    return start_run(
        client, "rollback-supervisor", f"bench-integration-{integration}", "bench-integration", workdir
    )


def prepare(workdir: Path, w: Workload, run_id: str) -> dict[str, Any]:
    """Our checkpoint and the framework's of the same state at AT_STEP, from one training process."""
    out = workdir / "prepare.json"
    cmd = _child_cmd("prepare", out, w, "--workdir", str(workdir / "resume"), "--run-id", run_id)
    _child(cmd, workdir / "prepare.log", child_env(), f"the {w.integration} prepare run", workdir)
    return json.loads(out.read_text())


def in_process(workdir: Path, w: Workload, run_id: str, reps: int) -> dict[str, Any]:
    """One Lightning process with `reps` injected anomalies, each rolled back in process."""
    from benchmarks.rollback import _ship

    out = workdir / "inprocess.json"
    sub = workdir / "inprocess"
    cmd = _child_cmd("inprocess", out, w, "--workdir", str(sub), "--run-id", run_id, "--anomalies", str(reps))
    _child(cmd, workdir / "inprocess.log", child_env(), "the in-process run", workdir)
    result = json.loads(out.read_text())
    _ship(sub / "plan.json", [a["target_step"] for a in result["anomalies"]])
    return result


def relaunch(workdir: Path, w: Workload, prep: dict[str, Any], run_id: str, i: int) -> dict[str, Any]:
    """The example started on a plan naming our checkpoint, up to the end of its first step; its phases."""
    from benchmarks.integration_child import write_plan
    from benchmarks.rollback import _ship
    from supervisor.exitcodes import EXIT_STOPPED
    from supervisor.runtime.plan import PLAN_ENV

    plan = write_plan(
        workdir / "resume", w.integration, run_id=run_id, every=AT_STEP, checkpoint_id=prep["checkpoint_id"]
    )
    out = workdir / f"relaunch-{i}.json"
    started = time.time()
    env = child_env(**{PLAN_ENV: str(plan)})
    _child(_child_cmd("relaunch", out, w), workdir / "relaunch.log", env, "the relaunched example", workdir)
    m = json.loads(out.read_text())
    if m.get("restored_step") != AT_STEP or m.get("step") != AT_STEP + 1 or m.get("exit") != EXIT_STOPPED:
        raise BenchRunError(
            f"the relaunch restored step {m.get('restored_step')}, trained step {m.get('step')} and exited "
            f"{m.get('exit')}; expected {AT_STEP}, {AT_STEP + 1} and {EXIT_STOPPED}; see {workdir}/relaunch.log"
        )
    _ship(plan, [AT_STEP])
    return phases(m, started, ours=True)


def standby_launcher(w: Workload) -> Any:
    """A standby launcher whose parked process imports what a standby of the example script would.

    The relaunch child wraps the example (`-m benchmarks.integration_child`), so the example's top-level
    imports, which the supervisor finds with `ast` in the script it runs, are named explicitly. No standby is
    started behind a measured relaunch: each is parked by hand, and the launcher's own one waits an hour.
    """
    from supervisor.launcher.standby import StandbyLauncher, StandbyOptions
    from supervisor.launcher.standby_child import top_level_imports

    source = (REPO / "examples" / EXAMPLES[w.integration]).read_text()
    options = StandbyOptions(imports=tuple(top_level_imports(source)), delay_seconds=3600.0)
    if w.world_size > 1:  # a parked torchrun agent with its ranks, as `relaunch: {standby: true}` parks it
        from supervisor.launcher import TorchrunLauncher, TorchrunOptions
        from supervisor.launcher.standby_torchrun import TorchrunStandbyLauncher

        return TorchrunStandbyLauncher(
            options, TorchrunLauncher(TorchrunOptions(nproc_per_node=w.world_size))
        )
    return StandbyLauncher(options)


def relaunch_standby(
    workdir: Path, w: Workload, prep: dict[str, Any], run_id: str, i: int, launcher: Any
) -> dict[str, Any]:
    """`relaunch()` started in a parked standby: from the plan sent to the end of the first step; its phases."""
    from benchmarks.integration_child import write_plan
    from benchmarks.rollback import _ship
    from supervisor.exitcodes import EXIT_STOPPED
    from supervisor.launcher import LaunchSpec
    from supervisor.runtime.plan import PLAN_ENV

    plan = write_plan(
        workdir / "resume", w.integration, run_id=run_id, every=AT_STEP, checkpoint_id=prep["checkpoint_id"]
    )
    out = workdir / f"standby-{i}.json"
    env = child_env(**{PLAN_ENV: str(plan)})
    command = tuple(_child_cmd("relaunch", out, w, torchrun=False))
    spec = LaunchSpec(command, env, cwd=str(workdir), inherit_env=False)
    parked = launcher.park_for(spec)
    if parked is None or not parked.wait_ready(CHILD_TIMEOUT_S):
        raise BenchRunError(f"the standby did not park (pid {parked.pid if parked else None})")
    rss = _parked_rss(parked)
    lines: list[str] = []
    started = time.time()
    handle = launcher.start(spec, lambda stream, line: lines.append(f"{stream}: {line}"))
    info = handle.wait(CHILD_TIMEOUT_S)
    with (workdir / "standby.log").open("a") as log:
        log.write("\n".join(lines) + "\n")
    m = json.loads(out.read_text()) if out.exists() else {}
    if int(handle.handle_id) != parked.pid or info.returncode != 0 or m.get("exit") != EXIT_STOPPED:
        raise BenchRunError(
            f"the standby relaunch ran in pid {handle.handle_id} (parked: {parked.pid}), exited "
            f"{info.returncode} (the example: {m.get('exit')}); see {workdir / 'standby.log'}"
        )
    if m.get("restored_step") != AT_STEP or m.get("step") != AT_STEP + 1:
        raise BenchRunError(
            f"the standby relaunch restored step {m.get('restored_step')} and trained step {m.get('step')}; "
            f"expected {AT_STEP} and {AT_STEP + 1}; see {workdir / 'standby.log'}"
        )
    _ship(plan, [AT_STEP])
    out_phases = phases(m, started, ours=True)
    # The plan sent -> the command runs as __main__: what a cold start spends in the interpreter and imports.
    out_phases["activate_s"] = out_phases.pop("interpreter_s")
    return {**out_phases, "parked_imports_s": parked.report["imports_s"], "parked_rss_bytes": rss}


def _parked_rss(parked: Any) -> int | None:
    """The parked process's resident memory; for a torchrun agent, the agent's and every rank's together."""
    import psutil

    ranks = (parked.report or {}).get("ranks") or []
    if not ranks:
        return parked.rss_bytes()
    total = 0
    for pid in [parked.pid, *ranks]:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            return None
    return total


def framework(workdir: Path, w: Workload, prep: dict[str, Any], i: int) -> dict[str, Any]:
    """The framework's own resume from its own checkpoint, up to the end of its first step; its phases."""
    out = workdir / f"framework-{i}.json"
    cmd = _child_cmd("framework", out, w, "--checkpoint", prep["framework_checkpoint"])
    started = time.time()
    _child(cmd, workdir / "framework.log", child_env(), "the framework's own resume", workdir)
    m = json.loads(out.read_text())
    if m.get("step") != AT_STEP + 1 or m.get("exit") != 0:
        raise BenchRunError(
            f"the framework's resume trained step {m.get('step')} and exited {m.get('exit')}; expected "
            f"{AT_STEP + 1} (resumed at {AT_STEP}) and 0; see {workdir}/framework.log"
        )
    return phases(m, started, ours=False)


def phases(m: dict[str, Any], started: float, *, ours: bool) -> dict[str, Any]:
    """Process start -> interpreter -> imports -> build -> fit/train set-up -> [our restore] -> loop -> step."""
    out = {
        "total_s": m["done"] - started,
        "ready_s": m["step_start"] - started,
        "interpreter_s": m["started"] - started,
        "import_s": m["imported"] - m["started"],
        "build_s": m["built"] - m["imported"],
        "setup_s": m["hook"] - m["built"],
        "loop_start_s": m["step_start"] - m["restored"],
        "step_s": m["done"] - m["step_start"],
    }
    if ours:
        out["restore_s"] = m["restored"] - m["hook"]
    return out


def run(
    workdir: Path,
    integration: str,
    size: str = DEFAULT_SIZE,
    reps: int = 3,
    batch_size: int | None = None,
    threads: int | None = None,
    say: Callable[[str], None] = lambda _: None,
    world_size: int = 1,
) -> dict[str, Any]:
    """Prepare both checkpoints, time the in-process path (Lightning), then relaunch and framework interleaved.

    With `world_size` > 1 every child runs on that many torchrun ranks, and the standby is a parked torchrun
    agent with its ranks."""
    load_start = os.getloadavg()[0]
    workdir.mkdir(parents=True, exist_ok=True)
    if integration == "script":
        return run_script(workdir, reps, threads, say, load_start)
    w = Workload(integration, size, batch_size, threads, world_size)
    run_id = _create_run(workdir, integration)
    say(f"{integration}: training to step {AT_STEP} at size {size}, both checkpoints")
    prep = prepare(workdir, w, run_id)
    inproc = None
    if integration not in NO_IN_PROCESS:
        say(f"{integration}: in process, {reps} anomalies")
        inproc = in_process(workdir, w, run_id, reps)
    relaunches, frameworks, standbys = [], [], []
    with standby_launcher(w) as launcher:
        for i in range(reps):  # interleaved, each going first every other time
            for path in ("relaunch", "standby", "framework")[:: 1 if i % 2 == 0 else -1]:
                say(f"{integration}: {path} {i + 1}/{reps}")
                if path == "relaunch":
                    relaunches.append(relaunch(workdir, w, prep, run_id, i))
                elif path == "standby":
                    standbys.append(relaunch_standby(workdir, w, prep, run_id, i, launcher))
                else:
                    frameworks.append(framework(workdir, w, prep, i))
    return summarize(
        integration,
        prep,
        inproc,
        relaunches,
        frameworks,
        standbys=standbys,
        size=size,
        reps=reps,
        batch_size=batch_size,
        threads=threads,
        load_start=load_start,
        world_size=world_size,
    )


# -- script mode: an unmodified script, read from outside -------------------------------------------------


def run_script(
    workdir: Path, reps: int, threads: int | None, say: Callable[[str], None], load_start: float
) -> dict[str, Any]:
    """Version the script's own file of AT_STEP, then relaunch (put back + resume) and its own resume, interleaved."""
    say(f"script: {SCRIPT.name} to iteration {AT_STEP}, versioned; then on to {2 * AT_STEP}")
    files, prep = prepare_script(workdir, threads)
    relaunches, frameworks = [], []
    try:
        for i in range(reps):  # interleaved, each going first every other time
            for path in ("relaunch", "own resume")[:: 1 if i % 2 == 0 else -1]:
                say(f"script: {path} {i + 1}/{reps}")
                if path == "relaunch":
                    relaunches.append(relaunch_script(workdir, files, prep, threads))
                else:
                    frameworks.append(script_resume(workdir, prep, threads))
    finally:
        files.close()
    return summarize(
        "script",
        prep,
        None,
        relaunches,
        frameworks,
        size=None,
        reps=reps,
        batch_size=None,
        threads=threads,
        load_start=load_start,
    )


def prepare_script(workdir: Path, threads: int | None) -> tuple[Any, dict[str, Any]]:
    """The script to AT_STEP (its file versioned into our store, and kept as its own), then on to 2 x AT_STEP.

    The file in place is then a later state than the version, as before a rollback: the first put-back writes.
    """
    from supervisor.script.files import ScriptFiles
    from supervisor.script.steps import OutputStep

    ours, own = workdir / "script", workdir / "script-own"
    ours.mkdir(parents=True, exist_ok=True)
    (own / "out").mkdir(parents=True, exist_ok=True)
    at = {"step": AT_STEP}
    steps = OutputStep(lambda when: at["step"])  # the script has exited: its last iteration is the file's
    files = ScriptFiles(ours, "out/ckpt.pt", workdir / "script-store", steps, zip_check=True).open()
    first = _script(ours, threads, f"--max_iters={AT_STEP}")
    (version,) = files.scan(final=True)
    shutil.copyfile(ours / "out" / "ckpt.pt", own / "ckpt-kept.pt")
    at["step"] = 2 * AT_STEP
    _script(ours, threads, "--init_from=resume", f"--max_iters={2 * AT_STEP}")
    if len(files.scan(final=True)) != 1:
        raise BenchRunError(f"script: the file of iteration {2 * AT_STEP} was not versioned; see {ours}")
    info = files.catalog.get(version)
    times = [t for _, t in first["iters"]]
    return files, {
        "checkpoint_id": version,
        "checkpoint_step": info.step,
        "checkpoint_bytes": info.nbytes,
        "framework_checkpoint": str(own / "out" / "ckpt.pt"),
        "framework_checkpoint_bytes": (own / "ckpt-kept.pt").stat().st_size,
        "params": None,
        "steps_s": [b - a for a, b in zip(times, times[1:], strict=False)],
    }


def relaunch_script(workdir: Path, files: Any, prep: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """Our version put back in place (the supervisor's part, timed here), then the script's own resume."""
    t0 = time.time()
    restored = files.restore(prep["checkpoint_id"])
    put_back = time.time() - t0
    if restored.step != AT_STEP:
        raise BenchRunError(f"script: put back step {restored.step}, expected {AT_STEP}")
    m = _resumed(_script(workdir / "script", threads, "--init_from=resume", f"--max_iters={AT_STEP + 1}"))
    return {
        "total_s": put_back + m["total_s"],
        "ready_s": put_back + m["ready_s"],
        "put_back_s": put_back,
        "to_resumed_s": m["ready_s"],
        "step_s": m["step_s"],
    }


def script_resume(workdir: Path, prep: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """The script's own resume from its own file of the same state (put in place untimed: it left it there)."""
    own = workdir / "script-own"
    shutil.copyfile(own / "ckpt-kept.pt", prep["framework_checkpoint"])
    m = _resumed(_script(own, threads, "--init_from=resume", f"--max_iters={AT_STEP + 1}"))
    return {**m, "to_resumed_s": m["ready_s"]}


def _script(cwd: Path, threads: int | None, *args: str) -> dict[str, Any]:
    """Run the script in `cwd` to its end; when it said it resumed and when each iteration's line came."""
    cmd = [sys.executable, str(SCRIPT), "--out_dir=out", *SCRIPT_ARGS, *args]
    env = child_env(OMP_NUM_THREADS=str(threads or 1))  # a tiny model: one thread, as its tests run it
    marks: dict[str, Any] = {"iters": []}
    log = cwd.parent / "script.log"
    started = time.time()
    with log.open("a") as out:
        # Unbuffered, read a line at a time: each line is timed when it arrives, not when a chunk does.
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0
        )
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            now = time.time()
            line = raw.decode(errors="replace")
            out.write(line)
            if line.startswith("resuming from "):
                marks["resumed"], marks["resumed_at"] = now, int(line.split()[-1])
            elif line.startswith("iter "):
                marks["iters"].append((int(line.split()[1].rstrip(":")), now))
        code = proc.wait(timeout=CHILD_TIMEOUT_S)
    if code != 0:
        raise BenchRunError(f"{SCRIPT.name} {' '.join(args)} exited {code}; see {log}")
    return {**marks, "started": started}


def _resumed(m: dict[str, Any]) -> dict[str, float]:
    """Process start -> the script's "resuming from" line (interpreter, imports, its load) -> first iteration."""
    if m.get("resumed_at") != AT_STEP or not m["iters"] or m["iters"][0][0] != AT_STEP:
        first = m["iters"][0][0] if m["iters"] else None
        raise BenchRunError(
            f"script: resumed at {m.get('resumed_at')} and trained iteration {first} first; expected {AT_STEP}"
        )
    done = m["iters"][0][1]
    return {
        "total_s": done - m["started"],
        "ready_s": m["resumed"] - m["started"],
        "step_s": done - m["resumed"],
    }


def summarize(
    integration: str,
    prep: dict[str, Any],
    inproc: dict[str, Any] | None,
    relaunches: list[dict[str, Any]],
    frameworks: list[dict[str, Any]],
    standbys: list[dict[str, Any]] | None = None,
    **info: Any,
) -> dict[str, Any]:
    """Medians, the target ratio with and without the step, and the in-process ratio where there is one."""

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        return median([r[key] for r in rows])

    anomalies = inproc["anomalies"] if inproc else []
    full = {
        "in_process_s": med(anomalies, "total_s"),
        "relaunch_s": med(relaunches, "total_s"),
        "framework_resume_s": med(frameworks, "total_s"),
    }
    ready = {
        "in_process_s": med(anomalies, "handler_s"),
        "relaunch_s": med(relaunches, "ready_s"),
        "framework_resume_s": med(frameworks, "ready_s"),
    }
    targets, ratios = {}, {}
    for suffix, values in (("", full), (" (step excluded)", ready)):
        for key, goal in TARGETS.items():
            num, den = key.split("/")
            targets[key + suffix] = target(ratio(values[num], values[den]), goal)
        ratios["in_process_s/framework_resume_s" + suffix] = ratio(
            values["in_process_s"], values["framework_resume_s"]
        )
    steps = prep["steps_s"] + (inproc["steps_s"] if inproc else [])
    if inproc:
        in_process: dict[str, Any] = {
            "restore_s": med(anomalies, "restore_s"),
            "resumed_step_s": med(anomalies, "step_s"),
            "tiers": [a["tier"] for a in anomalies],
            "samples": anomalies,
        }
    else:
        in_process = {"available": False, "reason": NO_IN_PROCESS[integration]}
    return {
        "integration": integration,
        "example": str(SCRIPT.relative_to(REPO))
        if integration == "script"
        else f"examples/{EXAMPLES[integration]}",
        "size": info["size"],
        "params": prep["params"],
        "state_bytes": prep["checkpoint_bytes"],
        "framework_checkpoint_bytes": prep["framework_checkpoint_bytes"],
        "batch_size": info["batch_size"],
        "threads": info["threads"],
        "device": "cpu",
        "world_size": info.get("world_size", 1),
        "reps": info["reps"],
        "resumed_at_step": prep["checkpoint_step"],
        **full,
        "step_s": median(steps),
        "step_included": True,
        "excluding_step": ready,
        "targets": targets,
        "ratios": ratios,
        "in_process": in_process,
        "relaunch": {
            **{k: med(relaunches, k) for k in _phases(integration, "relaunch")},
            "checkpoint_id": prep["checkpoint_id"],
            "samples": relaunches,
        },
        "framework_resume": {
            "how": FRAMEWORK_RESUME[integration],
            **{k: med(frameworks, k) for k in _phases(integration, "framework")},
            "checkpoint": Path(prep["framework_checkpoint"]).name,
            "samples": frameworks,
        },
        "machine": {**machine(), "load_average_1m_start": round(info["load_start"], 2)},
        "notes": _notes(integration),
        **(
            _standby_summary(standbys, full["framework_resume_s"], ready["framework_resume_s"])
            if standbys
            else {}
        ),
    }


def _standby_summary(
    standbys: list[dict[str, Any]], framework_s: float | None, framework_ready_s: float | None
) -> dict[str, Any]:
    """`relaunch_standby_s` and its phases: the relaunch started in a parked standby (not for the script)."""
    total = median([r["total_s"] for r in standbys])
    ready = median([r["ready_s"] for r in standbys])
    return {
        "relaunch_standby_s": total,
        "relaunch_standby": {
            **{k: median([r[k] for r in standbys]) for k in _STANDBY_PHASES},
            "excluding_step_s": ready,
            "ratios": {
                "relaunch_standby_s/framework_resume_s": ratio(total, framework_s),
                "relaunch_standby_s/framework_resume_s (step excluded)": ratio(ready, framework_ready_s),
            },
            "samples": standbys,
            "note": "relaunch_s's path started in a parked standby (policy `relaunch: {standby: true}`): a process "
            "of the same command started beforehand, interpreter up and the example's top-level imports (torch, "
            "the framework, our callback) done, waiting on a pipe; timed from the plan sent (activate_s: until "
            "the command runs as __main__). parked_rss_bytes: its resident memory while parked.",
        },
    }


_STANDBY_PHASES = (
    "activate_s",
    "import_s",
    "build_s",
    "setup_s",
    "restore_s",
    "loop_start_s",
    "step_s",
    "parked_imports_s",
    "parked_rss_bytes",
)


def _phases(integration: str, path: str) -> tuple[str, ...]:
    if integration == "script":
        return ("put_back_s", "to_resumed_s", "step_s") if path == "relaunch" else ("to_resumed_s", "step_s")
    return _PHASES[path]


_PHASES = {
    "relaunch": (
        "interpreter_s",
        "import_s",
        "build_s",
        "setup_s",
        "restore_s",
        "loop_start_s",
        "step_s",
    ),
    "framework": ("interpreter_s", "import_s", "build_s", "setup_s", "loop_start_s", "step_s"),
}


def _notes(integration: str) -> list[str]:
    if integration == "script":
        return _script_notes()
    hook = "on_fit_start" if integration == "lightning" else "on_train_begin"
    call = "fit()" if integration == "lightning" else "train()"
    notes = [
        "relaunch_s, framework_resume_s and in_process_s each end when the first resumed training step has "
        "completed (step_included); excluding_step ends them when that step starts (for in-process: the "
        "callback's rollback handler alone: detect, decide, restore from the memory ring, settle the loop). "
        "step_s is the median uninterrupted step of the prepare (and in-process) run.",
        f"Both fresh-process paths run the example's own build() and {call}, started by the benchmark with "
        f"the wall clock: interpreter -> imports -> build -> setup ({call} up to {hook}) -> restore (ours only: "
        f"the callback's {hook}, TrainingCore set-up and restore from our store, checksums verified) -> "
        "loop_start (the loop's start and first batch) -> step. The framework's resume reads its checkpoint "
        "within setup and loop_start.",
        "relaunch: as under `rollback-supervisor run`, the plan names the lineage's MLflow run and a metric "
        "spool, so the training process does not import MLflow; the benchmark ships the spool afterwards and "
        "checks that rollback.restored_step reached MLflow. framework resume: the supervisor is not imported "
        "at all (its callback is replaced by a clock).",
        f"Both checkpoints hold the same state at step {AT_STEP} (mid-epoch), written by one training process "
        "under the callback; our side never unpickles, the framework's resume loads its own files as it does.",
    ]
    if integration in NO_IN_PROCESS:
        notes.append(f"in_process_s is null: {NO_IN_PROCESS[integration]}.")
    return notes


def _script_notes() -> list[str]:
    return [
        "relaunch_s and framework_resume_s end when the script prints the line of its first resumed iteration "
        f"({AT_STEP}); excluding_step ends them at its 'resuming from' line (after its own torch.load). The "
        "script is read from outside, by its output, as the supervisor reads it: no clock inside it, so step_s "
        "(an iteration of this MLP takes well under a millisecond) is about the pipe's delivery of two lines.",
        "relaunch: the supervisor's part is put_back_s, ScriptFiles.restore() of our version of out/ckpt.pt "
        "(its blob checked and written beside the file, then renamed over the later state in place), timed in "
        "the benchmark's process with the store already open, as the runner holds it between segments; then "
        "the command the relaunch template gives, --init_from=resume, in a fresh process (to_resumed_s, "
        "step_s). framework resume: the same command on the script's own file of the same state, put back in "
        "place untimed (the script left it there). The process is the same on both sides: the relaunch costs "
        "the put-back more, so its ratio is about 1 + put_back_s / framework_resume_s.",
        f"The script runs as it is ({SCRIPT.name}: a small MLP, with OMP_NUM_THREADS=1 unless --threads) with "
        f"{' '.join(SCRIPT_ARGS)}; params is null (its file is never unpickled here).",
        "in_process_s is null: " + NO_IN_PROCESS["script"] + ".",
    ]
