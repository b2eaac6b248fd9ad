"""`rollback-supervisor drill --policy P -- CMD`: inject a standard fault mix into the user's own script and
check that each fault is detected, decided per the policy, and recovered from."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from supervisor.errors import UserError
from supervisor.runtime.faults import FAULTS_ENV, Fault, parse_faults

#: The fault each kind should be seen as.
EXPECTED = {
    "nan": "non_finite",
    "spike": "spike",
    "kill": "unknown_exit",
    "term": "preemption",
    "hw": "hardware_fault",
    "hang": "hang",
    "oom": "oom",
    "exc": "software_error",
    "sdc": "non_finite",  # a top exponent bit: usually a non-finite loss, a spike where the value stays finite
    "sdc_persistent": "non_finite",
    "bad_batch": "non_finite",
    "slow": "straggler",  # with a straggler detector
    "stuck": "hang",
}
#: Kinds that leave the run recoverable under a typical policy; `oom` and `exc` usually end it.
STANDARD_MIX = ("spike", "nan", "kill", "term", "hw")


@dataclass(frozen=True)
class Verdict:
    fault: Fault
    expected: str
    seen: str | None
    action: str | None
    wanted_action: str
    recovered: bool

    @property
    def passed(self) -> bool:
        return self.seen == self.expected and self.action == self.wanted_action and self.recovered


def standard_faults(first: int, gap: int, kinds: tuple[str, ...] = STANDARD_MIX) -> list[Fault]:
    return [Fault(kind, first + i * gap) for i, kind in enumerate(kinds)]


def judge(faults: list[Fault], rows: list[dict[str, Any]], policy: Any, status: str) -> list[Verdict]:
    """Match each injected fault to the first event of its expected type at or after its step. Pure."""
    verdicts, used = [], set()
    for fault in sorted(faults, key=lambda f: f.step):
        expected = EXPECTED[fault.kind]
        rule = policy.rule_for(expected)
        wanted = rule[1].action if rule else "fail"
        match = None
        for i, row in enumerate(rows):
            if i in used or row.get("event") != expected:
                continue
            step = row.get("onset_step") or row.get("step")
            if step is None or step >= fault.step:
                match = i
                break
        if match is None:
            verdicts.append(Verdict(fault, expected, None, None, wanted, False))
            continue
        used.add(match)
        row = rows[match]
        later = rows[match + 1 :]
        recovered = wanted in ("stop", "fail") or status == "finished" or any(r.get("event") for r in later)
        verdicts.append(Verdict(fault, expected, row["event"], row.get("action"), wanted, recovered))
    return verdicts


def command(
    ctx: typer.Context,
    policy: Path = typer.Option(..., "--policy", help="The policy to drill."),
    first: int = typer.Option(60, "--first", help="Step of the first injected fault."),
    gap: int = typer.Option(40, "--gap", help="Steps between injected faults."),
    faults: str = typer.Option(
        None, "--faults", help="Explicit mix, e.g. nan@100,kill@200 (overrides --first/--gap)."
    ),
    workdir: Path = typer.Option(Path(".rollback") / "drills", "--workdir"),
    stop_grace: float = typer.Option(30.0, "--stop-grace"),
    verbose: bool = typer.Option(
        False, "--verbose", help="Also show MLflow's, Prefect's and httpx's INFO logs."
    ),
    progress_every: float = typer.Option(
        30.0, "--progress-every", min=0.0, help="Seconds between progress log lines off a terminal (0: none)."
    ),
) -> None:
    """Run CMD (after `--`) under POLICY with injected faults; print a pass/fail table per fault."""
    argv = [a for a in ctx.args if a != "--"] if ctx.args[:1] == ["--"] else list(ctx.args)
    if not argv:
        raise UserError(
            "drill: expected the training command after `--`, e.g. -- python train.py --steps 400"
        )
    from policies import load_policy

    pol = load_policy(policy)
    mix = parse_faults(faults) if faults else standard_faults(first, gap)
    if not mix:
        raise UserError("--faults: expected at least one KIND@STEP")
    from flows.prefect_env import apply_defaults
    from supervisor.commands.logs import configure_logging
    from supervisor.commands.progress import for_run

    configure_logging(verbose)  # before MLflow and Prefect are imported (see configure_logging)
    apply_defaults(workdir)
    from flows.supervised import supervised_training

    lineage = f"drill-{time.strftime('%Y%m%d-%H%M%S')}"
    spec = ",".join(f.key for f in mix)
    typer.echo(f"drill {lineage}: injecting {spec}")
    progress = for_run(argv, policy, lineage, workdir, every=progress_every).start()
    try:
        result = supervised_training(
            command=argv,
            policy=str(policy),
            lineage=lineage,
            workdir=str(workdir),
            stop_grace_seconds=stop_grace,
            env={FAULTS_ENV: spec},
            progress_seconds=0,  # the live line above is this command's progress
        )
    finally:
        progress.stop()
    verdicts = judge(mix, result["timeline"], pol, result["status"])
    print_verdicts(verdicts, result)
    raise typer.Exit(0 if all(v.passed for v in verdicts) else 1)


def print_verdicts(verdicts: list[Verdict], result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"drill {result['lineage']}: run {result['status']}", title_justify="left")
    for col in ("fault", "expected", "seen", "action", "policy says", "recovered", "result"):
        table.add_column(col)
    for v in verdicts:
        table.add_row(
            v.fault.key,
            v.expected,
            v.seen or "-",
            v.action or "-",
            v.wanted_action,
            "yes" if v.recovered else "no",
            Text("PASS", style="green") if v.passed else Text("FAIL", style="red"),
        )
    Console().print(table)
