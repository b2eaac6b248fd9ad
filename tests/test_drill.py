"""The drill's judge: each injected fault must be seen as the right event, decided per policy, recovered."""

from __future__ import annotations

import pytest

from policies import load_preset
from supervisor.drill import EXPECTED, judge, standard_faults
from supervisor.errors import UserError
from supervisor.runtime.faults import Fault, parse_faults

PALM = load_preset("palm-spike")


def row(event, step, action, **kw):
    return {"event": event, "step": step, "onset_step": kw.get("onset", step), "action": action}


CASES = [
    # (faults, timeline rows, run status, expected pass flags)
    ("spike@100", [row("spike", 101, "rollback")], "finished", [True]),
    ("spike@100", [], "finished", [False]),  # never detected
    ("spike@100", [row("spike", 90, "rollback")], "finished", [False]),  # an earlier, unrelated spike
    ("kill@50", [row("unknown_exit", None, "resume")], "finished", [True]),
    ("hw@50", [row("unknown_exit", None, "resume")], "finished", [False]),  # misclassified
    (
        "nan@10,kill@20",
        [row("non_finite", 11, "rollback"), row("unknown_exit", None, "resume")],
        "finished",
        [True, True],
    ),
    ("nan@10", [row("non_finite", 11, "resume")], "finished", [False]),  # wrong action for the policy
    ("exc@10", [row("software_error", None, "fail")], "failed", [True]),  # fail is what palm-spike says
]


@pytest.mark.parametrize(("spec", "rows", "status", "expected"), CASES)
def test_judge(spec, rows, status, expected):
    verdicts = judge(parse_faults(spec), rows, PALM, status)
    assert [v.passed for v in verdicts] == expected


def test_standard_mix_is_spaced_and_covers_recoverable_kinds():
    mix = standard_faults(60, 40)
    assert [f.step for f in mix] == [60, 100, 140, 180, 220]
    assert {EXPECTED[f.kind] for f in mix} == {
        "spike",
        "non_finite",
        "unknown_exit",
        "preemption",
        "hardware_fault",
    }


@pytest.mark.parametrize("bad", ["nan", "nan@", "boom@3", "nan@0", "nan@x"])
def test_bad_fault_spec_names_the_item(bad):
    with pytest.raises(UserError, match=bad.replace("@", "@")):
        parse_faults(bad)


def test_parse_faults_round_trip():
    assert parse_faults("nan@3, kill@7") == [Fault("nan", 3), Fault("kill", 7)]
