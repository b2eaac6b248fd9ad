"""`rollback-supervisor policy validate | schema | explain | reference`, through the real root CLI."""

from __future__ import annotations

import json
from pathlib import Path

import policies
from policies import PRESETS_DIR
from supervisor.cli import main

GOLDEN = Path(__file__).parent / "data" / "golden"
REPO = Path(__file__).resolve().parents[1]


def test_validate_prints_ok_for_each_valid_file(capsys):
    files = sorted(str(p) for p in PRESETS_DIR.glob("*.yaml"))
    assert main(["policy", "validate", *files]) == 0
    out = capsys.readouterr()
    assert out.out == "".join(f"ok: {f}\n" for f in files)
    assert out.err == ""


def test_validate_without_files_is_a_usage_error(capsys):
    assert main(["policy", "validate"]) == 2
    assert "Missing argument" in capsys.readouterr().err


def test_schema_prints_the_json_schema(capsys):
    assert main(["policy", "schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == policies.json_schema()
    assert printed["additionalProperties"] is False
    assert set(printed["required"]) == {"version", "name", "rules"}


def test_explain_palm_spike_matches_the_golden_text(capsys):
    assert main(["policy", "explain", str(PRESETS_DIR / "palm-spike.yaml")]) == 0
    assert capsys.readouterr().out == (GOLDEN / "palm-spike.explain.txt").read_text()


def test_explain_says_something_for_every_event_type_of_every_preset(capsys):
    from supervisor.events import EVENT_TYPES

    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        assert main(["policy", "explain", str(path)]) == 0
        out = capsys.readouterr().out
        section = out.split("On each event\n")[1].split("\n\n")[0].splitlines()
        assert [line.split()[0] for line in section] == list(EVENT_TYPES)


def test_explain_of_an_invalid_file_exits_2(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text("version: 1\nname: x\nrules: [{when: [oom], action: explode}]\n")
    assert main(["policy", "explain", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f'error: {bad}:3:31: rules[0].action: expected one of resume, rollback, stop, fail, warn, got "explode"\n'
    )


def test_reference_prints_the_generated_markdown(capsys):
    assert main(["policy", "reference"]) == 0
    assert capsys.readouterr().out == (REPO / "policies" / "REFERENCE.md").read_text()
