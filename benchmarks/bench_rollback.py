"""`rollback-supervisor bench rollback`: anomaly to first resumed step, in process vs relaunch vs naive."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import typer

from benchmarks.common import BenchError, PhasedResult, check_size

app = typer.Typer(add_completion=False)
#: A hand run at the issue's size keeps its numbers in benchmarks/results/rollback-100M.json (--json there);
#: `--integration X` runs keep theirs in benchmarks/results/rollback-integration-X.json.


@app.callback(invoke_without_command=True)
def main(
    json_path: Path | None = typer.Option(None, "--json", help="Write the results here as JSON."),
    size: str | None = typer.Option(
        None,
        "--size",
        help="Example size preset: tiny, small, 10M or 100M (default 100M; with --integration, 10M; none for script).",
    ),
    reps: int = typer.Option(3, "--reps", min=1, help="Repetitions per path (the median is reported)."),
    batch_size: int | None = typer.Option(
        None,
        "--batch-size",
        min=1,
        help="Example batch size (sets the step time; default 1, with --integration the example's own).",
    ),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch threads in the children."),
    workdir: Path | None = typer.Option(None, "--workdir", help="Scratch directory (kept when given)."),
    device: str = typer.Option("cpu", "--device", help="Where the example trains: cpu or cuda."),
    overhead_steps: int = typer.Option(
        100,
        "--overhead-steps",
        min=0,
        help="Also supervise this many steps of the example with no fault and report the supervisor's CPU "
        "time against the training's (supervisor_cpu_s; target <= 2%); 0 skips it.",
    ),
    overhead_timeout_s: float = typer.Option(
        120.0,
        "--overhead-timeout-s",
        min=0,
        help="Time budget of the --overhead-steps phase, from its launch: when it runs out the training's "
        "process group is killed and the steps done so far are reported (timed_out: true); 0: no budget.",
    ),
    world_size: int = typer.Option(
        1,
        "--world-size",
        min=1,
        help="With --integration lightning or transformers: every child on this many torchrun ranks (DDP, "
        "gloo), our relaunch against the framework's own resume at the same world size.",
    ),
    integration: str | None = typer.Option(
        None,
        "--integration",
        help="lightning, transformers or script: that integration's example, in process and relaunched, "
        "against the framework's own resume (benchmarks/integration.py).",
    ),
) -> None:
    """Measure anomaly -> first resumed step: in process (memory tier), relaunch (disk), naive torch.load;
    with --integration, under a framework integration against that framework's own resume.

    With --json the file is rewritten after each phase (`complete: false`, `phases_done`) and once more at
    the end (`complete: true`): a run killed part-way keeps the figures of the phases it finished."""
    if integration is not None:
        from benchmarks.integration import check

        size = check(integration, size, device, world_size)
        planned = ["integration"]
    else:
        if world_size != 1:
            raise BenchError("--world-size: only with --integration lightning or transformers")
        size = check_size(size or "100M")
        batch_size = batch_size or 1
        if device not in ("cpu", "cuda"):
            raise BenchError(f"--device: expected cpu or cuda, got {device!r}")
        from benchmarks.rollback import phases

        planned = phases(reps) + (["supervisor_cpu"] if overhead_steps else [])

    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rbs-bench-rollback-", dir=workdir))
    out = PhasedResult(json_path, planned)

    def say(message: str) -> None:
        typer.echo(message, err=True)

    def phase_done(phase: str, result: dict[str, Any]) -> None:
        out.phase_done(phase, result)
        if json_path is not None:
            say(f"{phase}: done, written to {json_path}")

    # `timeout` and a machine being given back send SIGTERM: unwind, so that the segment of the overhead phase
    # (a session of its own) is stopped and the file says how the run ended.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main_thread else None
    try:
        if integration is not None:
            from benchmarks.integration import run as run_integration

            result = run_integration(
                scratch, integration, size, reps, batch_size, threads, say=say, world_size=world_size
            )
            phase_done("integration", result)
        else:
            from benchmarks.rollback import run

            result = run(
                scratch, size, reps, batch_size, threads, device=device, say=say, on_phase=phase_done
            )
            if overhead_steps:
                from benchmarks.overhead import supervisor_cpu

                budget = f" (at most {overhead_timeout_s:g} s)" if overhead_timeout_s else ""
                say(f"supervisor CPU time over {overhead_steps} supervised steps{budget}")
                cost = supervisor_cpu(
                    scratch / "overhead",
                    size,
                    overhead_steps,
                    threads,
                    device=device,
                    batch_size=batch_size,
                    timeout_s=overhead_timeout_s or None,
                )
                if cost["timed_out"]:
                    say(f"supervisor CPU time: the budget ran out after {cost['steps']} steps")
                result["supervisor_cpu"] = cost
                result["supervisor_cpu_s"] = cost["supervisor_cpu_s"]
                result["targets"].update(cost["targets"])
                phase_done("supervisor_cpu", result)
    except BaseException as exc:
        out.failed(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if workdir is None:
            shutil.rmtree(scratch, ignore_errors=True)
    typer.echo(out.finish(result))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
