"""Compare two commits' benchmark timings in one run: a `git worktree` of the base, interleaved rounds, verdicts.

Usage (from the repository root):

    .venv/bin/python -m benchmarks.compare_commits --base HEAD~1 --bench checkpoint --bench rollback \\
        --size 100M --rounds 2 --json benchmarks/results/compare-<name>.json

Each benchmark runs once per round for the base and for the head, each time in a fresh process started in
that tree with that tree first on PYTHONPATH and the venv's editable-install finder switched off, so each side
measures its own code (the JSON records which `supervisor/__init__.py` each side imported). Within a round the
two sides run back to back, and the order flips every round (base, head, then head, base), so a machine that
slows down or speeds up during the comparison hits both sides alike.

A figure regresses when head/base of the per-side medians exceeds 1 + max(noise, 10%). The noise is the
spread between rounds of either side and, for absolute times, the machine's drift between the sides as seen
in timings that do not depend on our code (torch.save, torch.load, memcpy; the naive restart). Exit status:
0 no regression, 1 a regression or a figure the head stopped reporting, 2 bad options, 3 a run failed,
130 interrupted (the worktree is removed in every case).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import BenchError, BenchRunError

REPO = Path(__file__).resolve().parents[1]
#: A slowdown below this is never called a regression, however quiet the rounds were.
FLOOR = 0.10
BENCHES = ("checkpoint", "rollback")
SIDES = ("base", "head")
#: The packages whose import location proves which tree a side ran.
OWN_PACKAGES = ("supervisor", "benchmarks", "policies", "flows")
PROVENANCE_ENV = "RBS_COMPARE_PROVENANCE"
CHILD_TIMEOUT_S = 3 * 3600.0
#: How long an interrupted benchmark gets to remove its scratch directory before it is killed.
CHILD_GRACE_S = 30.0


class CompareFailed(BenchRunError):
    """A side's benchmark failed, or it imported code from outside its own tree; the message says which."""

    exit_code = 3


# --- Pure core: figures, medians, noise, verdicts --------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """One compared number: a key of the benchmark's JSON (dotted for nested), or a ratio of two keys."""

    num: str
    den: str | None = None
    #: Does not depend on our code, so its head/base ratio measures the machine's drift between the sides.
    reference: bool = False

    @property
    def name(self) -> str:
        return self.num if self.den is None else f"{self.num}/{self.den}"


FIGURES: dict[str, tuple[Figure, ...]] = {
    "checkpoint": (
        Figure("torch_save_s", reference=True),
        Figure("torch_load_s", reference=True),
        Figure("memcpy_s", reference=True),
        Figure("blocking_save_s"),
        Figure("write_s"),
        Figure("restore_memory_s"),
        Figure("restore_disk_s"),
        Figure("blocking_save_s", "torch_save_s"),
        Figure("write_s", "torch_save_s"),
        Figure("restore_memory_s", "memcpy_s"),
        Figure("restore_disk_s", "torch_load_s"),
    ),
    "rollback": (
        Figure("naive_restart_s", reference=True),
        Figure("excluding_step.naive_restart_s", reference=True),
        Figure("in_process_s"),
        Figure("relaunch_s"),
        Figure("excluding_step.in_process_s"),
        Figure("excluding_step.relaunch_s"),
        Figure("in_process_s", "naive_restart_s"),
        Figure("relaunch_s", "naive_restart_s"),
        Figure("excluding_step.in_process_s", "excluding_step.naive_restart_s"),
        Figure("excluding_step.relaunch_s", "excluding_step.naive_restart_s"),
    ),
}


def lookup(result: dict[str, Any], key: str) -> float | None:
    """`result["a"]["b"]` for key "a.b"; None when absent or not a number."""
    node: Any = result
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    if isinstance(node, bool) or not isinstance(node, int | float):
        return None
    return float(node)


def figure_value(result: dict[str, Any], figure: Figure) -> float | None:
    num = lookup(result, figure.num)
    if figure.den is None or num is None:
        return num
    den = lookup(result, figure.den)
    if not den:
        return None
    return num / den


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of one side's rounds: 0 with fewer than two rounds (nothing to compare)."""
    if len(values) < 2:
        return 0.0
    mid = statistics.median(values)
    if mid <= 0:
        return 0.0
    return (max(values) - min(values)) / mid


def ratio_of(head: float, base: float) -> float:
    if base > 0:
        return head / base
    if head == 0:
        return 1.0
    return float("inf")


@dataclass(frozen=True)
class Judgement:
    """One figure's verdict and the numbers it rests on."""

    base: list[float]
    head: list[float]
    base_median: float | None
    head_median: float | None
    ratio: float | None
    noise: float | None
    threshold: float | None
    verdict: str


def judge(
    base: Sequence[float],
    head: Sequence[float],
    *,
    drift: float = 0.0,
    floor: float = FLOOR,
    reference: bool = False,
) -> Judgement:
    """head/base of the medians against 1 + max(noise, floor); noise = the rounds' spread or the drift.

    Verdicts: "no regression", "regression", "reference" (a machine yardstick, not judged), "missing" (the base
    reported the figure and the head did not: counts as a failure), "new" (only the head reports it).
    """
    base, head = list(base), list(head)
    if not base:
        verdict = "new" if head else "missing"
        return Judgement(base, head, None, _median(head), None, None, None, verdict)
    base_median = statistics.median(base)
    if not head:
        return Judgement(base, head, base_median, None, None, None, None, "missing")
    head_median = statistics.median(head)
    ratio = ratio_of(head_median, base_median)
    noise = max(spread(base), spread(head), drift)
    threshold = 1.0 + max(noise, floor)
    if reference:
        verdict = "reference"
    elif ratio <= threshold:
        verdict = "no regression"
    else:
        verdict = "regression"
    return Judgement(base, head, base_median, head_median, ratio, noise, threshold, verdict)


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def side_values(results: Sequence[dict[str, Any]], figure: Figure) -> list[float]:
    """The figure in each round's result, skipping rounds that lack it."""
    values = (figure_value(r, figure) for r in results)
    return [v for v in values if v is not None]


def drift_between(base: Sequence[dict[str, Any]], head: Sequence[dict[str, Any]], bench: str) -> float:
    """How far the machine moved between the sides: the largest |head/base - 1| of the reference figures."""
    moves = [0.0]
    for figure in FIGURES[bench]:
        if not figure.reference:
            continue
        b, h = side_values(base, figure), side_values(head, figure)
        if b and h:
            moves.append(abs(ratio_of(statistics.median(h), statistics.median(b)) - 1.0))
    return max(moves)


def compare(
    results: dict[str, dict[str, list[dict[str, Any]]]],
    committed: dict[str, dict[str, Any] | None],
    *,
    floor: float = FLOOR,
) -> dict[str, Any]:
    """results[bench][side] is that side's raw JSON per round; committed[bench] the JSON in the repository."""
    benches: dict[str, Any] = {}
    failures: list[str] = []
    for bench, sides in results.items():
        base, head = sides.get("base", []), sides.get("head", [])
        drift = drift_between(base, head, bench)
        figures: dict[str, Any] = {}
        for figure in FIGURES[bench]:
            # A ratio of two timings from the same run already cancels the machine's drift.
            j = judge(
                side_values(base, figure),
                side_values(head, figure),
                drift=drift if figure.den is None else 0.0,
                floor=floor,
                reference=figure.reference,
            )
            entry = asdict(j)
            reference = committed.get(bench)
            committed_value = None if reference is None else figure_value(reference, figure)
            entry["committed"] = committed_value
            entry["head_vs_committed"] = (
                None
                if committed_value is None or j.head_median is None
                else ratio_of(j.head_median, committed_value)
            )
            figures[figure.name] = entry
            if j.verdict in ("regression", "missing"):
                failures.append(f"{bench} {figure.name}: {j.verdict}")
        benches[bench] = {"drift": drift, "figures": figures}
    return {
        "verdict": "regression" if failures else "no regression",
        "failures": failures,
        "floor": floor,
        "benches": benches,
    }


def schedule(benches: Sequence[str], rounds: int) -> list[tuple[int, str, str]]:
    """(round, bench, side) in run order: the sides run back to back, and their order flips every round."""
    order: list[tuple[int, str, str]] = []
    for r in range(rounds):
        sides = SIDES if r % 2 == 0 else SIDES[::-1]
        for bench in benches:
            order.extend((r, bench, side) for side in sides)
    return order


def table(summary: dict[str, Any]) -> str:
    """The comparison as fixed-width text: one line per figure."""
    names = [name for part in summary["benches"].values() for name in part["figures"]]
    w = max((len(n) for n in names), default=6)
    title = f"{'bench':<11} {'figure':<{w}} {'base':>9} {'head':>9} {'h/b':>6} {'noise':>6}  {'verdict':<14} {'vs committed':>12}"
    lines = [title, "-" * len(title)]
    for bench, part in summary["benches"].items():
        for name, f in part["figures"].items():
            lines.append(
                f"{bench:<11} {name:<{w}} {_num(f['base_median']):>9} {_num(f['head_median']):>9} "
                f"{_num(f['ratio'], 2):>6} {_num(f['noise'], 2):>6}  {f['verdict']:<14} "
                f"{_num(f['head_vs_committed'], 2):>12}"
            )
        lines.append(f"{bench:<11} machine drift between the sides: {part['drift']:.1%}")
    lines.append(f"verdict: {summary['verdict']}")
    return "\n".join(lines)


def _num(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


# --- Shell: trees, child processes, files ----------------------------------------------------------------


@dataclass(frozen=True)
class Tree:
    """One side's source tree: the working tree as it is, or a temporary `git worktree` of a revision."""

    side: str
    spec: str
    path: Path
    rev: str
    dirty: bool
    worktree: bool


#: Put on each child's PYTHONPATH (inherited by the benchmarks' own children): it removes the venv's
#: editable-install finder, which would otherwise serve any module missing from the side's tree out of the
#: main checkout; and it records where the first process's own packages came from.
SITECUSTOMIZE = f'''"""Written by benchmarks.compare_commits: import this tree only, and record from where."""
import atexit
import json
import os
import sys

sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
_out = os.environ.pop("{PROVENANCE_ENV}", None)


def _record():
    own = {OWN_PACKAGES!r}
    modules = {{
        name: getattr(module, "__file__", None)
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in own
    }}
    with open(_out, "w") as f:
        json.dump({{"executable": sys.executable, "sys_path": sys.path, "modules": modules}}, f)


if _out:
    atexit.register(_record)
'''


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise BenchError(f"git {' '.join(args)} in {repo}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout.strip()


def working_tree(path: Path, side: str) -> Tree:
    top = Path(git(path, "rev-parse", "--show-toplevel"))
    dirty = bool(git(top, "status", "--porcelain"))
    return Tree(side, str(path), top, git(top, "rev-parse", "HEAD"), dirty, worktree=False)


@contextmanager
def opened_tree(repo: Path, spec: str | None, side: str, scratch: Path) -> Iterator[Tree]:
    """`spec` None or an existing directory: that tree as it is; else a revision, checked out for the run."""
    if spec is None:
        yield working_tree(repo, side)
        return
    if Path(spec).is_dir():
        yield working_tree(Path(spec), side)
        return
    try:
        rev = git(repo, "rev-parse", "--verify", f"{spec}^{{commit}}")
    except BenchError:
        raise BenchError(f"--{side} {spec!r}: not a directory and not a revision of {repo}") from None
    path = scratch / side
    try:
        git(repo, "worktree", "add", "--detach", str(path), rev)
        yield Tree(side, spec, path, rev, dirty=False, worktree=True)
    finally:
        remove_worktree(repo, path)


def remove_worktree(repo: Path, path: Path) -> None:
    done = subprocess.run(
        ["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True, check=False
    )
    if done.returncode != 0:
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True, check=False)


@dataclass(frozen=True)
class Settings:
    """What each benchmark run is asked for."""

    size: str
    params: str
    reps: int | None
    timeout_s: float = CHILD_TIMEOUT_S


def bench_args(bench: str, settings: Settings, tree: Path | None = None) -> list[str]:
    args = ["--params", settings.params] if bench == "checkpoint" else ["--size", settings.size]
    if settings.reps is not None:
        args += ["--reps", str(settings.reps)]
    if bench == "rollback" and tree is not None and _skips_overhead(tree):
        args += ["--overhead-steps", "0"]  # the supervisor's CPU phase is no figure compared here
    return args


def _skips_overhead(tree: Path) -> bool:
    """Whether the tree's `bench rollback` has `--overhead-steps` (a base from before it always runs that
    phase, and would refuse the option)."""
    source = tree / "benchmarks" / "bench_rollback.py"
    return source.exists() and '"--overhead-steps"' in source.read_text()


def imported_from(provenance: dict[str, Any], tree: Path) -> dict[str, Any]:
    """Which `supervisor` the child imported, and any of our modules that came from outside its tree."""
    root = tree.resolve()
    modules: dict[str, str | None] = provenance.get("modules", {})
    supervisor_file = modules.get("supervisor")
    foreign = sorted(
        name for name, file in modules.items() if file and not Path(file).resolve().is_relative_to(root)
    )
    return {
        "supervisor": supervisor_file,
        "root": None if supervisor_file is None else str(Path(supervisor_file).resolve().parents[1]),
        "foreign_modules": foreign,
        "executable": provenance.get("executable"),
    }


def finish(child: subprocess.Popen[bytes], timeout_s: float) -> int:
    """The child's exit status; on a timeout or an interruption its process group gets SIGINT, as from a
    terminal, so the benchmark removes its scratch directory, and SIGKILL if it has not exited in time."""
    try:
        return child.wait(timeout=timeout_s)
    except BaseException:
        signal_group(child, signal.SIGINT)
        try:
            child.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            signal_group(child, signal.SIGKILL)
            child.wait()
        raise


def signal_group(child: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(child.pid, signum)  # the child leads its own group (start_new_session)
    except ProcessLookupError:
        pass


def tail(log: Path) -> str:
    """The end of a child's log, for the error message: the scratch directory holding it is removed."""
    return log.read_text(errors="replace")[-3000:]


def run_one(tree: Tree, bench: str, settings: Settings, rnd: int, scratch: Path) -> dict[str, Any]:
    """One benchmark in its own process with the tree's own code; its raw JSON and where its code came from."""
    stem = scratch / f"r{rnd}-{bench}-{tree.side}"
    out, log, prov = stem.with_suffix(".json"), stem.with_suffix(".log"), stem.with_suffix(".imports.json")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", PROVENANCE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join((str(tree.path), str(scratch / "isolate")))
    env[PROVENANCE_ENV] = str(prov)
    cmd = [
        sys.executable,
        "-m",
        "supervisor.cli",
        "bench",
        bench,
        *bench_args(bench, settings, tree.path),
        "--json",
        str(out),
    ]
    load_start = os.getloadavg()[0]
    started = time.monotonic()
    what = f"round {rnd + 1} {bench} {tree.side} ({tree.path})"
    with log.open("wb") as err:
        child = subprocess.Popen(
            cmd, cwd=tree.path, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
        )
        try:
            returncode = finish(child, settings.timeout_s)
        except subprocess.TimeoutExpired:
            raise CompareFailed(
                f"{what} ran past {settings.timeout_s:.0f}s; its log ends:\n{tail(log)}"
            ) from None
    seconds = time.monotonic() - started
    if returncode != 0 or not out.exists():
        raise CompareFailed(f"{what} exited {returncode}; its log ends:\n{tail(log)}")
    if not prov.exists():
        raise CompareFailed(f"{what}: the child wrote no import record to {prov}; was PYTHONPATH overridden?")
    imported = imported_from(json.loads(prov.read_text()), tree.path)
    if imported["root"] != str(tree.path.resolve()) or imported["foreign_modules"]:
        raise CompareFailed(
            f"{what} imported supervisor from {imported['supervisor']} and "
            f"{imported['foreign_modules'] or 'nothing else'} from outside its tree; "
            "check PYTHONPATH and the venv's editable install"
        )
    return {
        "round": rnd,
        "bench": bench,
        "side": tree.side,
        "command": cmd,
        "seconds": seconds,
        "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "imported": imported,
        "result": json.loads(out.read_text()),
    }


def committed_results(tree: Path, settings: Settings, benches: Sequence[str]) -> dict[str, Any]:
    """The JSON committed at the base for the same size (benchmarks/results/<bench>-<size>.json), if any."""
    found: dict[str, Any] = {}
    for bench in benches:
        size = settings.params if bench == "checkpoint" else settings.size
        path = tree / "benchmarks" / "results" / f"{bench}-{size}.json"
        found[bench] = {"path": str(path.relative_to(tree)), "result": None}
        if path.is_file():
            found[bench]["result"] = json.loads(path.read_text())
    return found


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    settings = Settings(
        size=args.size, params=args.params or args.size, reps=args.reps, timeout_s=args.timeout
    )
    benches = list(dict.fromkeys(args.bench or BENCHES))
    scratch = Path(tempfile.mkdtemp(prefix="rbs-compare-"))
    try:
        (scratch / "isolate").mkdir()
        (scratch / "isolate" / "sitecustomize.py").write_text(SITECUSTOMIZE)
        with (
            opened_tree(REPO, args.base, "base", scratch) as base,
            opened_tree(REPO, args.head, "head", scratch) as head,
        ):
            trees = {"base": base, "head": head}
            say(f"base {base.rev[:12]} at {base.path}; head {head.rev[:12]} at {head.path}")
            load_start = os.getloadavg()[0]
            runs = []
            for rnd, bench, side in schedule(benches, args.rounds):
                record = run_one(trees[side], bench, settings, rnd, scratch)
                say(f"round {rnd + 1}/{args.rounds} {bench:<10} {side}: {record['seconds']:.1f}s")
                runs.append(record)
            load_end = os.getloadavg()[0]
            committed = committed_results(base.path, settings, benches)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = {
        b: {s: [r["result"] for r in runs if r["bench"] == b and r["side"] == s] for s in SIDES}
        for b in benches
    }
    summary = compare(results, {b: c["result"] for b, c in committed.items()}, floor=args.floor)
    return {
        "tool": "benchmarks.compare_commits",
        "verdict": summary["verdict"],
        "failures": summary["failures"],
        "trees": {
            side: {**asdict(t), "path": str(t.path), "removed": t.worktree and not t.path.exists()}
            for side, t in trees.items()
        },
        "settings": {**asdict(settings), "benches": benches, "rounds": args.rounds, "floor": args.floor},
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_1m": {"start": load_start, "end": load_end},
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "committed": {
            b: {"path": c["path"], "rev": trees["base"].rev, "found": c["result"] is not None}
            for b, c in committed.items()
        },
        "benches": summary["benches"],
        "runs": runs,
    }


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_commits", description=__doc__.splitlines()[0]
    )
    p.add_argument("--base", required=True, help="The revision to compare against, e.g. HEAD~1.")
    p.add_argument("--head", help="A directory or a revision (default: this working tree, as it is).")
    p.add_argument("--bench", action="append", choices=BENCHES, help="Repeat for several (default: all).")
    p.add_argument("--size", default="100M", help="bench rollback --size (tiny, small, 10M, 100M).")
    p.add_argument("--params", help="bench checkpoint --params (default: --size).")
    p.add_argument("--reps", type=int, help="--reps for each benchmark (default: each benchmark's own).")
    p.add_argument("--rounds", type=int, default=2, help="Runs per side of each benchmark (default 2).")
    p.add_argument(
        "--timeout", type=float, default=CHILD_TIMEOUT_S, help="Seconds one benchmark run may take."
    )
    p.add_argument("--floor", type=float, default=FLOOR, help="Smallest slowdown called a regression (0.10).")
    p.add_argument(
        "--json", type=Path, help="Write everything here, e.g. benchmarks/results/compare-<name>.json."
    )
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds: expected at least 1")
    if args.timeout <= 0:
        p.error("--timeout: expected a number of seconds > 0")
    if args.reps is not None and args.reps < 1:
        p.error("--reps: expected at least 1")
    if "checkpoint" in (args.bench or BENCHES) and args.params is None and args.size in ("tiny", "small"):
        p.error(
            f"--params: bench checkpoint takes a count like 100K, not the preset {args.size!r}; pass --params"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through the worktree's removal

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        report = run(args, say=lambda m: print(m, file=sys.stderr, flush=True))
    except (CompareFailed, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("aborted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    return 0 if report["verdict"] == "no regression" else 1


if __name__ == "__main__":
    sys.exit(main())
