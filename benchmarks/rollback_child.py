"""Child processes of `bench rollback`, timed inside the example's real Session (a subclass adds clocks only).

`inprocess`: runs examples/charlm.py's own training loop. The fault drill poisons the weights (`nan@K`); the
loss of the next step is NaN, the in-process detector fires, the policy says rollback, and the training
core's in-process rollback restores from the memory ring. Measured per anomaly: from the end of the
anomalous step (the detector fires right after it) to the end of the first resumed step. After the last
anomaly's resumed step the run stops (no final checkpoint) and a plain `torch.save` of the same state is
written for the naive baseline.

`relaunch`: a fresh process on a plan naming the checkpoint, as the supervisor would start it; wall-clock
marks at import, build, session set-up, restore and the first step, then it stops.

    python -m benchmarks.rollback_child inprocess --workdir W --size 100M --anomalies 3 --run-id R --out W/inprocess.json
    python -m benchmarks.rollback_child relaunch --out W/relaunch-0.json -- [charlm args]   # plan in env
    python -m benchmarks.rollback_child replay --workdir W/replay --size 100M --run-id R --out W/replay.json

`replay`: the example with `monitor.replay` on and a bit flipped once (`sdc@5`): the cost of one replay (the
restore from the memory ring and the two replayed steps), from the replay's own record.
"""

from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

#: Checkpoint every 2 steps; anomaly i poisons step 3 + 2i, is seen at 4 + 2i and rolls back to 2 + 2i.
POLICY_NAME = "bench-rollback"
POLICY = """\
version: 1
name: bench-rollback
checkpoint: {every_steps: 2, keep_last: 3, async: true, memory_slots: 2, storage: ./checkpoints, verify: full}
monitor:
  poll_seconds: 1
  detectors:
    - {type: non_finite, metrics: [loss]}
rules:
  - when: [non_finite]
    action: rollback
    target: {select: latest}
limits:
  max_rollbacks: 1000
  max_restarts: 1000
  backoff: {initial_seconds: 0, max_seconds: 0, multiplier: 1, jitter: false}
  escalation: null
"""
STEPS = 1000  # never reached: the runs stop after the measured step

#: The replay run: checkpoints every 4 steps; `sdc@5` flips a weight after step 5's update, step 6's loss is
#: wrong, and the replay runs steps 5 and 6 again from the snapshot of step 4 (at least two steps before the
#: onset). Steps 1-3 are the uninterrupted steps it is judged against (no save in or beside them).
REPLAY_FAULT = "sdc@5"
REPLAY_POLICY = (
    POLICY.replace("name: bench-rollback", "name: bench-replay").replace("every_steps: 2", "every_steps: 4")
).replace(
    "    - {type: non_finite, metrics: [loss]}\n",
    "    - {type: non_finite, metrics: [loss]}\n    - {type: threshold, metric: loss, above: 100}\n"
    "  replay: {enabled: true, max_steps: 4, when: [non_finite, threshold]}\n",
)


def fault_spec(anomalies: int) -> str:
    """`nan@3,nan@5,...`: each fault fires once, after the rollback that undid the previous one."""
    return ",".join(f"nan@{3 + 2 * i}" for i in range(anomalies))


@dataclass(frozen=True)
class Example:
    """The example's configuration, the same for every child (same config hash, so the relaunch restores)."""

    size: str
    batch_size: int = 1
    threads: int | None = None
    device: str = "cpu"

    def options(self) -> list[str]:
        """The options the children and the naive script take: size, batch size, device, threads."""
        out = ["--size", self.size, "--batch-size", str(self.batch_size), "--device", self.device]
        return out + (["--threads", str(self.threads)] if self.threads else [])

    def charlm_args(self) -> list[str]:
        return [*self.options(), "--steps", str(STEPS), "--eval-every", "1000000"]


def write_plan(
    workdir: Path, *, run_id: str, checkpoint_id: str | None = None, policy_text: str = POLICY
) -> Path:
    """A launch plan for the benchmark's lineage; with a checkpoint id it restores that one.

    Like the plans `rollback-supervisor run` writes, it names the lineage's MLflow run, a metric spool and the
    validated policy: the training process logs to the spool and the supervisor (here the benchmark, untimed)
    ships it to MLflow.
    """
    from policies import load_policy
    from policies.plain import policy_data
    from supervisor.runtime.plan import LaunchPlan, RestoreSpec

    policy = workdir / "policy.yaml"
    if not policy.exists():
        policy.write_text(policy_text)
    plan = LaunchPlan(
        lineage="bench-rollback",
        workdir=str(workdir),
        checkpoint_dir=str(workdir / "checkpoints"),
        tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}",
        run_id=run_id,
        policy_path=str(policy),
        policy=policy_data(load_policy(policy)),  # validated here, as the supervisor does
        restore=RestoreSpec(checkpoint_id=checkpoint_id),
        metrics_spool=str(workdir / "metrics" / ("relaunch.jsonl" if checkpoint_id else "inprocess.jsonl")),
    )
    return plan.write(workdir / ("plan.json" if checkpoint_id is None else "plan-relaunch.json"))


def timed_session(base: type, anomalies: int) -> type:
    """The example's Session plus timestamps; stops after the first step that follows the last rollback."""

    class TimedSession(base):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.bench: dict[str, Any] = {"steps_s": [], "anomalies": [], "registered": {}}
            self._prev_end: float | None = None
            self._resume: tuple[float, float] | None = None

        def register(self, **stateful: Any) -> None:
            self.bench["registered"].update(stateful)
            super().register(**stateful)

        def _after_step(self, max_steps: int) -> Any:
            from supervisor.runtime.actions import Rollback

            done = time.monotonic()
            if self._resume is not None:
                detected, restored = self._resume
                self._resume = None
                self.bench["anomalies"].append(
                    {"total_s": done - detected, "handler_s": restored - detected, "step_s": done - restored}
                )
                if len(self.bench["anomalies"]) >= anomalies:
                    self.request_stop("benchmark done")
                    return None
            elif self._prev_end is not None and self.step > 1:
                self.bench["steps_s"].append(done - self._prev_end)
            action = super()._after_step(max_steps)
            if isinstance(action, Rollback):  # the detector fired and the core rolled back within that call
                self._resume = (done, time.monotonic())
            self._prev_end = time.monotonic()
            return action

    return TimedSession


def run(
    workdir: Path,
    size: str,
    batch_size: int,
    threads: int | None,
    anomalies: int,
    run_id: str,
    device: str = "cpu",
) -> dict[str, Any]:
    """Train until `anomalies` in-process rollbacks are done; returns the timings and what was restored."""
    import torch

    from benchmarks.common import BenchRunError, load_charlm
    from supervisor.exitcodes import EXIT_STOPPED
    from supervisor.runtime.faults import FAULTS_ENV
    from supervisor.runtime.plan import PLAN_ENV

    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[PLAN_ENV] = str(write_plan(workdir, run_id=run_id))
    os.environ[FAULTS_ENV] = fault_spec(anomalies)
    charlm = load_charlm()
    sessions: list[Any] = []
    base = charlm.Session

    class Recorder(timed_session(base, anomalies)):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            sessions.append(self)

    charlm.Session = Recorder
    try:
        code = charlm.main(Example(size, batch_size, threads, device).charlm_args())
    finally:
        charlm.Session = base
    sess = sessions[0]
    reports = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines() if line]
    if code != EXIT_STOPPED or len(sess.bench["anomalies"]) != anomalies or len(reports) != anomalies:
        raise BenchRunError(
            f"in-process run: expected {anomalies} in-process rollbacks and exit 3 (stopped), got "
            f"{len(reports)} reported, {len(sess.bench['anomalies'])} timed, exit {code}; see {workdir}"
        )
    for timing, report in zip(sess.bench["anomalies"], reports, strict=True):
        timing.update(
            restore_s=report["restore_s"],
            tier=report["tier"],
            target=report["decision"]["target_id"],
            target_step=report["decision"]["target_step"],
            event=report["event"]["type"],
        )
    parts = sess.bench["registered"]
    naive = workdir / "naive.pt"
    state = {k: parts[k].state_dict() for k in ("model", "optimizer", "scheduler")}
    torch.save(state, naive)
    last = sess.bench["anomalies"][-1]
    return {
        "anomalies": sess.bench["anomalies"],
        "steps_s": sess.bench["steps_s"],
        "run_id": sess.run_id,
        "checkpoint_id": last["target"],
        "checkpoint_step": last["target_step"],
        "naive_path": str(naive),
        "naive_bytes": naive.stat().st_size,
        "params": sum(p.numel() for p in parts["model"].parameters()),
        "pid": os.getpid(),
    }


def replay(
    workdir: Path, size: str, batch_size: int, threads: int | None, run_id: str, device: str = "cpu"
) -> dict[str, Any]:
    """Train until one replay (monitor.replay) has given its verdict: its cost from the replay's own record
    (the restore from the memory ring and the replayed steps), and the uninterrupted steps' times."""
    from benchmarks.common import BenchRunError, load_charlm
    from supervisor.exitcodes import EXIT_STOPPED
    from supervisor.runtime.faults import FAULTS_ENV
    from supervisor.runtime.plan import PLAN_ENV

    workdir.mkdir(parents=True, exist_ok=True)
    os.environ[PLAN_ENV] = str(write_plan(workdir, run_id=run_id, policy_text=REPLAY_POLICY))
    os.environ[FAULTS_ENV] = REPLAY_FAULT
    charlm = load_charlm()
    base = charlm.Session
    steps_s: list[float] = []

    class Replayed(base):
        """Stops after the step at which the replay gave its verdict; times the steps before the fault."""

        began = False
        prev: float | None = None

        def _after_step(self, max_steps: int) -> Any:
            done = time.monotonic()
            if self.prev is not None and not self.began and self.step > 1:
                steps_s.append(done - self.prev)
            action = super()._after_step(max_steps)
            replaying = self._core.rollback.replay.active is not None
            if self.began and not replaying:
                self.request_stop("benchmark done")
            self.began = self.began or replaying
            self.prev = time.monotonic()
            return action

    charlm.Session = Replayed
    try:
        code = charlm.main(Example(size, batch_size, threads, device).charlm_args())
    finally:
        charlm.Session = base
    reports = [json.loads(line) for line in (workdir / "events.jsonl").read_text().splitlines() if line]
    verdicts = [r["replay"] for r in reports if r.get("kind") == "replay"]
    if code != EXIT_STOPPED or len(verdicts) != 1:
        raise BenchRunError(
            f"replay run: expected one replay verdict and exit 3 (stopped), got {len(verdicts)} and exit {code}; "
            f"see {workdir}"
        )
    (verdict,) = verdicts
    return {"replay_s": verdict["seconds"], "verdict": verdict, "steps_s": steps_s, "fault": REPLAY_FAULT}


def relaunch(out: Path, charlm_argv: list[str]) -> None:
    """Run the example on the plan in the environment until its first step is done; write the marks."""
    from benchmarks.common import load_charlm

    charlm = load_charlm()
    marks = {"started": STARTED, "imported": time.time()}
    build = charlm.build

    def timed_build(args: Any, *rest: Any) -> Any:
        parts = build(args, *rest)
        marks["built"] = time.time()
        return parts

    class Probe(charlm.Session):
        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            marks["session"] = time.time()

        def restore(self) -> Any:
            info = super().restore()
            marks["restored"], marks["restored_step"] = time.time(), self.step
            return info

        def _after_step(self, max_steps: int) -> None:
            marks["done"], marks["step"] = time.time(), self.step
            self.request_stop("benchmark done")

    from supervisor.checkpoint.tiers import Tiers

    restore_tier = Tiers.restore

    def noted_restore(self: Any, *args: Any, **kwargs: Any) -> str:
        marks["tier"] = used = restore_tier(self, *args, **kwargs)
        return used

    charlm.build, charlm.Session, Tiers.restore = timed_build, Probe, noted_restore  # type: ignore[method-assign]
    try:
        charlm.main(charlm_argv)
    finally:
        Tiers.restore = restore_tier  # type: ignore[method-assign]
    out.write_text(json.dumps(marks))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="mode", required=True)
    a_in = sub.add_parser("inprocess")
    a_in.add_argument("--workdir", type=Path, required=True)
    a_in.add_argument("--size", default="100M")
    a_in.add_argument("--batch-size", type=int, default=1)
    a_in.add_argument("--threads", type=int, default=None)
    a_in.add_argument("--anomalies", type=int, default=3)
    a_in.add_argument("--device", default="cpu")
    a_in.add_argument("--run-id", required=True)
    a_in.add_argument("--out", type=Path, required=True)
    a_rp = sub.add_parser("replay")
    a_rp.add_argument("--workdir", type=Path, required=True)
    a_rp.add_argument("--size", default="100M")
    a_rp.add_argument("--batch-size", type=int, default=1)
    a_rp.add_argument("--threads", type=int, default=None)
    a_rp.add_argument("--device", default="cpu")
    a_rp.add_argument("--run-id", required=True)
    a_rp.add_argument("--out", type=Path, required=True)
    a_re = sub.add_parser("relaunch")
    a_re.add_argument("--out", type=Path, required=True)
    a_re.add_argument("charlm_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.mode == "relaunch":
        relaunch(a.out, [x for x in a.charlm_args if x != "--"])
        return 0
    if a.mode == "replay":
        result = replay(a.workdir.resolve(), a.size, a.batch_size, a.threads, a.run_id, a.device)
        a.out.write_text(json.dumps(result, indent=2))
        return 0
    result = run(a.workdir.resolve(), a.size, a.batch_size, a.threads, a.anomalies, a.run_id, a.device)
    a.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
