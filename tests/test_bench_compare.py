"""benchmarks.compare_commits: the verdict arithmetic, the run order, import isolation, and a tiny run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare_commits import (
    FIGURES,
    PROVENANCE_ENV,
    SITECUSTOMIZE,
    Figure,
    compare,
    figure_value,
    imported_from,
    judge,
    main,
    schedule,
    spread,
    table,
)
from tests.conftest import REPO

IN_GIT = (REPO / ".git").exists()

# (case, base rounds, head rounds, drift, reference, verdict)
JUDGE_CASES = [
    ("equal", [1.0, 1.0], [1.0, 1.0], 0.0, False, "no regression"),
    ("faster", [1.0, 1.0], [0.5, 0.5], 0.0, False, "no regression"),
    ("1.5x slower, quiet rounds", [1.0, 1.02], [1.5, 1.52], 0.0, False, "regression"),
    ("1.5x slower, rounds spread 60%", [0.7, 1.3], [1.5, 1.5], 0.0, False, "no regression"),
    ("1.5x slower, machine drifted 60%", [1.0, 1.0], [1.5, 1.5], 0.6, False, "no regression"),
    ("9% slower: under the floor", [1.0], [1.09], 0.0, False, "no regression"),
    ("11% slower: over the floor", [1.0], [1.11], 0.0, False, "regression"),
    ("one round each: no spread to excuse it", [1.0], [1.5], 0.0, False, "regression"),
    ("a reference is reported, not judged", [1.0], [3.0], 0.0, True, "reference"),
    ("the head stopped reporting it", [1.0], [], 0.0, False, "missing"),
    ("only the head reports it", [], [1.0], 0.0, False, "new"),
]


@pytest.mark.parametrize(
    ("base", "head", "drift", "reference", "verdict"),
    [c[1:] for c in JUDGE_CASES],
    ids=[c[0] for c in JUDGE_CASES],
)
def test_judge_verdicts(base, head, drift, reference, verdict):
    assert judge(base, head, drift=drift, reference=reference).verdict == verdict


def test_judge_reports_the_numbers_it_rests_on():
    j = judge([0.5, 1.5, 1.0], [2.0, 2.0], drift=0.25)
    assert (j.base_median, j.head_median, j.ratio) == (1.0, 2.0, 2.0)
    assert j.noise == pytest.approx(1.0)  # base spread (1.5 - 0.5) / 1.0 beats the drift
    assert j.threshold == pytest.approx(2.0)
    assert j.verdict == "no regression"


@pytest.mark.parametrize(
    ("values", "expected"),
    [([], 0.0), ([2.0], 0.0), ([1.0, 3.0], 1.0), ([1.0, 2.0, 3.0], 1.0), ([4.0, 4.0], 0.0)],
)
def test_spread_is_range_over_median(values, expected):
    assert spread(values) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("figure", "expected"),
    [
        (Figure("a_s"), 2.0),
        (Figure("nested.b_s"), 0.5),
        (Figure("a_s", "nested.b_s"), 4.0),
        (Figure("a_s", "zero_s"), None),
        (Figure("absent_s"), None),
        (Figure("flag"), None),
        (Figure("nested"), None),
    ],
)
def test_figure_value(figure, expected):
    result = {"a_s": 2, "zero_s": 0.0, "flag": True, "nested": {"b_s": 0.5}}
    assert figure_value(result, figure) == expected


def test_schedule_flips_the_side_order_every_round():
    assert schedule(["checkpoint", "rollback"], 3) == [
        (0, "checkpoint", "base"),
        (0, "checkpoint", "head"),
        (0, "rollback", "base"),
        (0, "rollback", "head"),
        (1, "checkpoint", "head"),
        (1, "checkpoint", "base"),
        (1, "rollback", "head"),
        (1, "rollback", "base"),
        (2, "checkpoint", "base"),
        (2, "checkpoint", "head"),
        (2, "rollback", "base"),
        (2, "rollback", "head"),
    ]


#: A checkpoint benchmark result; powers of two keep every ratio below exact in binary.
CK = {
    "torch_save_s": 0.5,
    "torch_load_s": 0.5,
    "memcpy_s": 0.125,
    "blocking_save_s": 0.0625,
    "write_s": 2.0,
    "restore_memory_s": 0.125,
    "restore_disk_s": 0.0625,
}


def scaled(result: dict[str, float], factor: float, keys: tuple[str, ...] | None = None) -> dict[str, float]:
    return {k: v * factor if keys is None or k in keys else v for k, v in result.items()}


def test_compare_flags_a_slower_save_and_its_ratio_only():
    slow = scaled(CK, 1.5, ("blocking_save_s",))
    got = compare({"checkpoint": {"base": [CK, CK], "head": [slow, slow]}}, {"checkpoint": None})
    assert got["verdict"] == "regression"
    assert got["failures"] == [
        "checkpoint blocking_save_s: regression",
        "checkpoint blocking_save_s/torch_save_s: regression",
    ]
    figures = got["benches"]["checkpoint"]["figures"]
    assert list(figures) == [f.name for f in FIGURES["checkpoint"]]
    assert figures["blocking_save_s"]["ratio"] == 1.5
    assert figures["write_s"]["verdict"] == "no regression"
    assert figures["torch_save_s"]["verdict"] == "reference"
    assert got["benches"]["checkpoint"]["drift"] == 0.0


def test_compare_excuses_a_machine_that_slowed_down_for_everything():
    slow = scaled(CK, 1.5)
    got = compare({"checkpoint": {"base": [CK], "head": [slow]}}, {"checkpoint": None})
    assert got["benches"]["checkpoint"]["drift"] == 0.5
    assert got["verdict"] == "no regression", got["failures"]
    assert got["benches"]["checkpoint"]["figures"]["blocking_save_s/torch_save_s"]["ratio"] == 1.0


def test_compare_fails_on_a_figure_the_head_dropped_and_reports_the_committed_ratio():
    head = {k: v for k, v in CK.items() if k != "write_s"}
    committed = scaled(CK, 0.5, ("restore_disk_s",))
    got = compare({"checkpoint": {"base": [CK], "head": [head]}}, {"checkpoint": committed})
    figures = got["benches"]["checkpoint"]["figures"]
    assert figures["write_s"]["verdict"] == "missing"
    assert figures["write_s/torch_save_s"]["verdict"] == "missing"
    assert got["failures"] == ["checkpoint write_s: missing", "checkpoint write_s/torch_save_s: missing"]
    assert figures["restore_disk_s"]["head_vs_committed"] == 2.0
    assert figures["restore_disk_s"]["committed"] == 0.03125


def test_compare_rollback_uses_the_naive_restart_as_the_yardstick():
    rb = {
        "in_process_s": 1.0,
        "relaunch_s": 4.0,
        "naive_restart_s": 8.0,
        "excluding_step": {"in_process_s": 0.125, "relaunch_s": 2.0, "naive_restart_s": 4.0},
    }
    slow = {**rb, "excluding_step": {**rb["excluding_step"], "relaunch_s": 4.0}}
    got = compare({"rollback": {"base": [rb], "head": [slow]}}, {})
    assert got["failures"] == [
        "rollback excluding_step.relaunch_s: regression",
        "rollback excluding_step.relaunch_s/excluding_step.naive_restart_s: regression",
    ]
    figures = got["benches"]["rollback"]["figures"]
    assert figures["excluding_step.naive_restart_s"]["verdict"] == "reference"
    assert figures["relaunch_s/naive_restart_s"]["ratio"] == 1.0


def test_table_has_a_line_per_figure_and_the_verdict():
    slow = scaled(CK, 1.5, ("write_s",))
    text = table(compare({"checkpoint": {"base": [CK], "head": [slow]}}, {"checkpoint": None}))
    lines = text.splitlines()
    rows = [line.split() for line in lines if line.startswith("checkpoint ")]
    write_row = next(row for row in rows if row[1] == "write_s")
    assert write_row[2:7] == ["2.0000", "3.0000", "1.50", "0.00", "regression"]
    assert [row[1] for row in rows if row[1] != "machine"] == [f.name for f in FIGURES["checkpoint"]]
    assert lines[-1] == "verdict: regression"


def test_imported_from_names_modules_outside_the_tree(tmp_path):
    tree = tmp_path / "tree"
    provenance = {
        "modules": {
            "supervisor": str(tree / "supervisor" / "__init__.py"),
            "supervisor.errors": str(tree / "supervisor" / "errors.py"),
            "supervisor.extra": "/elsewhere/supervisor/extra.py",
            "benchmarks.results": None,
        }
    }
    got = imported_from(provenance, tree)
    assert got["root"] == str(tree.resolve())
    assert got["foreign_modules"] == ["supervisor.extra"]


def _fake_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A tree whose `supervisor` lacks `errors`, and the isolation directory the harness puts on PYTHONPATH."""
    tree = tmp_path / "tree"
    (tree / "supervisor").mkdir(parents=True)
    (tree / "supervisor" / "__init__.py").write_text("")
    iso = tmp_path / "isolate"
    iso.mkdir()
    (iso / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return tree, iso


def _python(code: str, tree: Path, pythonpath: list[Path], **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", PROVENANCE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**env, **extra},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_isolation_keeps_a_side_inside_its_tree_and_records_it(tmp_path):
    tree, iso = _fake_tree(tmp_path)
    record = tmp_path / "imports.json"
    # The grandchild must be isolated too, and must not overwrite the child's record.
    code = (
        "import subprocess, sys, supervisor\n"
        "rc = subprocess.run([sys.executable, '-c', 'import supervisor.errors']).returncode\n"
        "sys.exit(10 + rc)\n"
    )
    proc = _python(code, tree, [tree, iso], **{PROVENANCE_ENV: str(record)})
    assert proc.returncode == 11, proc.stderr  # the grandchild found no supervisor.errors in the fake tree
    assert "No module named 'supervisor.errors'" in proc.stderr
    modules = json.loads(record.read_text())["modules"]
    assert modules == {"supervisor": str(tree / "supervisor" / "__init__.py")}


@pytest.mark.skipif(
    not any(getattr(f, "__module__", "").startswith("__editable__") for f in sys.meta_path),
    reason="the package is not installed in editable mode here",
)
def test_without_isolation_the_editable_install_leaks_into_a_tree(tmp_path):
    """Why the harness isolates: the venv's editable finder serves modules a tree lacks from the main checkout."""
    tree, _ = _fake_tree(tmp_path)
    proc = _python("import supervisor.errors; print(supervisor.errors.__file__)", tree, [tree])
    assert proc.returncode == 0, proc.stderr
    assert not Path(proc.stdout.strip()).is_relative_to(tree)


def test_options_are_checked_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--base", "HEAD", "--size", "tiny"])
    assert exc.value.code == 2
    assert "--params" in capsys.readouterr().err


@pytest.mark.skipif(not IN_GIT, reason="needs a git checkout")
def test_an_unknown_base_is_a_user_error(capsys, tmp_path):
    out = tmp_path / "c.json"
    assert main(["--base", "no-such-revision-15", "--params", "100K", "--json", str(out)]) == 2
    assert "no-such-revision-15" in capsys.readouterr().err
    assert not out.exists()


def _worktrees() -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list", "--porcelain"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(not IN_GIT, reason="needs a git checkout")
def test_end_to_end_head_commit_against_the_working_tree(tmp_path):
    out = tmp_path / "compare.json"
    # The checkpoint bench alone: what is compared does not depend on the bench (each one's figures are checked
    # against its own real JSON: the rollback bench's in tests/test_bench_rollback.py).
    args = "--base HEAD --bench checkpoint --params 100K --rounds 1 --reps 1 --timeout 240"
    cmd = [sys.executable, "-m", "benchmarks.compare_commits", *args.split(), "--json", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    # At this size the timings are milliseconds of noise, so either verdict is fine; a failed run (3) is not.
    # A run past --timeout fails (3) after the harness has stopped it and removed the worktree.
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(out.read_text())
    assert report["verdict"] in ("no regression", "regression")
    assert proc.stdout.splitlines()[-1] == f"verdict: {report['verdict']}"

    base, head = report["trees"]["base"], report["trees"]["head"]
    assert (base["worktree"], base["removed"], base["spec"]) == (True, True, "HEAD")
    assert not Path(base["path"]).exists()
    assert base["path"] not in _worktrees()
    assert (head["worktree"], Path(head["path"])) == (False, REPO)
    assert base["rev"] == head["rev"]

    runs = report["runs"]
    assert [(r["bench"], r["side"]) for r in runs] == [("checkpoint", "base"), ("checkpoint", "head")]
    for r in runs:
        tree = base["path"] if r["side"] == "base" else head["path"]
        assert r["imported"]["root"] == str(Path(tree).resolve())
        assert r["imported"]["supervisor"].startswith(r["imported"]["root"])
        assert r["imported"]["foreign_modules"] == []
    assert runs[0]["imported"]["root"] != runs[1]["imported"]["root"]
    assert 50_000 < runs[0]["result"]["params"] < 200_000  # --params 100K reached the benchmark

    for bench in ("checkpoint",):
        figures = report["benches"][bench]["figures"]
        assert list(figures) == [f.name for f in FIGURES[bench]]
        for name, f in figures.items():
            assert len(f["base"]) == len(f["head"]) == 1, name
            assert f["verdict"] in ("no regression", "regression", "reference"), name
        assert report["committed"][bench]["found"] is False  # nothing is committed at this size
    assert report["settings"]["rounds"] == 1
    assert set(report["machine"]["load_average_1m"]) == {"start", "end"}


def test_the_rollback_bench_skips_its_cpu_phase_where_the_tree_has_the_option(tmp_path):
    """No compared figure comes from `--overhead-steps`' phase; a base from before the option never gets it."""
    from benchmarks.compare_commits import Settings, bench_args

    settings = Settings(size="tiny", params="2M", reps=2)
    assert bench_args("rollback", settings, REPO)[-2:] == ["--overhead-steps", "0"]
    old = tmp_path / "old"
    (old / "benchmarks").mkdir(parents=True)
    (old / "benchmarks" / "bench_rollback.py").write_text("# a bench from before --overhead-steps\n")
    assert bench_args("rollback", settings, old) == ["--size", "tiny", "--reps", "2"]
    assert "--overhead-steps" not in bench_args("checkpoint", settings, REPO)
