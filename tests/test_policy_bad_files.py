"""The invalid-policy corpus: every file gets its exact message, from the library and from the CLI (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policies import PRESETS_DIR, PolicyError, load_policy, parse_policy
from supervisor.cli import main

BAD = Path(__file__).parent / "data" / "bad_policies"
CASES = sorted(BAD.glob("*.yaml"))
EXE = Path(sys.executable).with_name("rollback-supervisor")


def _expected(path: Path) -> str:
    return path.with_suffix(".expected").read_text()


def test_corpus_has_at_least_25_files_each_with_its_message():
    assert len(CASES) >= 25
    assert sorted(p.stem for p in BAD.glob("*.expected")) == sorted(p.stem for p in CASES)


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_bad_policy_gives_its_exact_message(path: Path):
    with pytest.raises(PolicyError) as info:
        parse_policy(path.read_text(), path.name)
    assert "\n".join(info.value.problems) + "\n" == _expected(path)
    for problem in info.value.problems:
        assert problem.startswith(f"{path.name}:")
        assert ": expected " in problem and ", got " in problem


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.stem)
def test_cli_validate_exits_2_with_the_message(path: Path, monkeypatch, capsys):
    monkeypatch.chdir(BAD)
    assert main(["policy", "validate", path.name]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == _expected(path) + "1 of 1 policy file(s) invalid\n"


def test_load_policy_names_the_path_it_was_given():
    path = BAD / "lr-scale-string.yaml"
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert str(info.value) == f'{path}:8:15: rules[0].lr_scale: expected a number > 0, got "half"'


@pytest.mark.e2e
def test_console_script_reports_without_traceback():
    preset = PRESETS_DIR / "palm-spike.yaml"
    out = subprocess.run(
        [str(EXE), "policy", "validate", str(preset), "lr-scale-string.yaml", "several-problems.yaml"],
        cwd=BAD,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stdout == f"ok: {preset}\n"
    expected = _expected(BAD / "lr-scale-string.yaml") + _expected(BAD / "several-problems.yaml")
    assert out.stderr == expected + "2 of 3 policy file(s) invalid\n"
    assert "Traceback" not in out.stderr
    explain = subprocess.run(
        [str(EXE), "policy", "explain", "unknown-action.yaml"],
        cwd=BAD,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert explain.returncode == 2
    assert explain.stderr == "error: " + _expected(BAD / "unknown-action.yaml")
    assert "Traceback" not in explain.stderr
