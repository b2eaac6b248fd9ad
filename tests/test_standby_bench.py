"""`bench rollback`'s standby figures: `relaunch_standby_s` beside `relaunch_s` and `naive_restart_s`, its target,
and the integration bench's `relaunch_standby_s` against the framework's own resume (summary arithmetic only;
test_bench_rollback.py's tiny CLI run checks the keys of a real run)."""

from __future__ import annotations

import pytest

from benchmarks.integration import summarize as summarize_integration
from benchmarks.rollback import summarize
from tests.test_bench_integration import INPROC as INT_INPROC
from tests.test_bench_integration import PREP, fresh
from tests.test_bench_rollback import INPROC, NAIVE, RELAUNCH

STANDBY = [
    {
        "total_s": t,
        "ready_s": t - 1,
        "activate_s": 0.01,
        "import_s": 0.01,
        "build_s": 1.0,
        "session_s": 0.1,
        "restore_s": 0.2,
        "step_s": 1.0,
        "parked_imports_s": 2.0,
        "parked_rss_bytes": 200 << 20,
    }
    for t in (3.0, 2.0, 4.0)
]


def test_the_standby_relaunch_is_reported_beside_the_others_with_its_target():
    got = summarize(
        INPROC,
        RELAUNCH,
        NAIVE,
        standbys=STANDBY,
        size="tiny",
        reps=3,
        batch_size=1,
        threads=None,
        load_start=0,
    )
    assert (got["relaunch_s"], got["relaunch_standby_s"], got["naive_restart_s"]) == (12.0, 3.0, 11.0)
    assert got["excluding_step"]["relaunch_standby_s"] == 2.0
    assert got["targets"]["relaunch_standby_s/naive_restart_s"] == {
        "value": pytest.approx(3 / 11),
        "target": 0.3,
        "met": True,
    }
    assert got["targets"]["relaunch_standby_s/naive_restart_s (step excluded)"]["value"] == pytest.approx(0.2)
    assert got["relaunch_standby"]["parked_rss_bytes"] == 200 << 20
    assert got["relaunch_standby"]["activate_s"] == 0.01 and len(got["relaunch_standby"]["samples"]) == 3


PARKED = [
    {
        "total_s": t,
        "ready_s": t - 1,
        "activate_s": 0.02,
        "restore_s": 0.2,
        "step_s": 1.0,
        "parked_s": 5.0,
        "parked_build_s": 1.3,
        "parked_rss_bytes": 900 << 20,
    }
    for t in (1.5, 2.0, 1.0)
]


def test_the_relaunch_parked_at_its_plan_is_reported_with_its_target():
    common = {"size": "tiny", "reps": 3, "batch_size": 1, "threads": None, "load_start": 0}
    got = summarize(INPROC, RELAUNCH, NAIVE, standbys=STANDBY, parked=PARKED, **common)
    assert (got["relaunch_parked_s"], got["excluding_step"]["relaunch_parked_s"]) == (1.5, 0.5)
    assert got["targets"]["relaunch_parked_s/naive_restart_s"] == {
        "value": pytest.approx(1.5 / 11),
        "target": 0.3,
        "met": True,
    }
    assert "relaunch_parked_s/naive_restart_s (step excluded)" in got["targets"]
    assert got["relaunch_parked"]["parked_build_s"] == 1.3 and got["relaunch_parked"]["activate_s"] == 0.02
    assert (
        got["relaunch_parked"]["parked_rss_bytes"] == 900 << 20
        and len(got["relaunch_parked"]["samples"]) == 3
    )
    assert "relaunch_parked_s" not in summarize(INPROC, RELAUNCH, NAIVE, standbys=STANDBY, **common)


def test_the_relaunch_through_a_preloading_standby_is_reported_with_its_target():
    common = {"size": "tiny", "reps": 3, "batch_size": 1, "threads": None, "load_start": 0}
    preloaded = [{**row, "total_s": row["total_s"] * 3, "ready_s": row["ready_s"] + 0.5} for row in PARKED]
    got = summarize(INPROC, RELAUNCH, NAIVE, standbys=STANDBY, parked=PARKED, preloaded=preloaded, **common)
    assert (got["relaunch_preloaded_s"], got["excluding_step"]["relaunch_preloaded_s"]) == (4.5, 1.0)
    assert got["targets"]["relaunch_preloaded_s/naive_restart_s"] == {
        "value": pytest.approx(4.5 / 11),
        "target": 0.3,
        "met": False,
    }
    assert got["relaunch_preloaded"]["samples"] == preloaded and got["relaunch_parked"]["samples"] == PARKED
    without = summarize(INPROC, RELAUNCH, NAIVE, standbys=STANDBY, parked=PARKED, **common)
    assert "relaunch_preloaded_s" not in without


def test_the_integration_bench_reports_the_standby_against_the_framework_resume():
    standbys = [
        {**r, "activate_s": 0.01, "parked_imports_s": 5.0, "parked_rss_bytes": 1}
        for r in fresh((2.0,), 1.0, True)
    ]
    for row in standbys:
        del row["interpreter_s"]
    common = {"size": "tiny", "reps": 1, "batch_size": None, "threads": None, "load_start": 0.0}
    got = summarize_integration(
        "lightning",
        PREP,
        INT_INPROC,
        fresh((9.0,), 2.0, True),
        fresh((10.0,), 1.0, False),
        standbys=standbys,
        **common,
    )
    assert got["relaunch_standby_s"] == 2.0
    assert got["relaunch_standby"]["ratios"] == {
        "relaunch_standby_s/framework_resume_s": pytest.approx(0.2),
        "relaunch_standby_s/framework_resume_s (step excluded)": pytest.approx(1 / 9),
    }
    without = summarize_integration(
        "transformers", PREP, None, fresh((9.0,), 2.0, True), fresh((10.0,), 1.0, False), **common
    )
    assert "relaunch_standby_s" not in without  # none measured (the script's relaunch has no standby path)
