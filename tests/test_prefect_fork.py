"""A process that ran a Prefect flow can still fork: `flows/prefect_fork.py` works around Prefect 3.8's
at-exit assertion in forked children (a DataLoader worker forked after a flow exited with code 1)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

CHILD = textwrap.dedent(
    """
    import multiprocessing, sys
    if sys.argv[1] == "with-workaround":
        import flows.supervised  # noqa: F401  (installs flows.prefect_fork)
    from prefect import flow

    @flow
    def noop():
        return 1

    noop()
    child = multiprocessing.get_context("fork").Process(target=int)
    child.start()
    child.join()
    print("exitcode", child.exitcode)
    """
)


@pytest.mark.e2e
def test_a_child_forked_after_a_flow_exits_cleanly_and_the_prefect_bug_is_still_there(prefect_api):
    env = {**os.environ, "PREFECT_API_URL": prefect_api.api_url, "PYTHONPATH": str(REPO)}
    runs = {
        mode: subprocess.Popen(
            [sys.executable, "-c", CHILD, mode],
            cwd=REPO,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for mode in ("with-workaround", "without")
    }
    out = {mode: p.communicate(timeout=120) for mode, p in runs.items()}
    for mode, p in runs.items():
        assert p.returncode == 0, f"{mode}: {out[mode][1][-2000:]}"
    assert "exitcode 0" in out["with-workaround"][0], out["with-workaround"]
    # Without the workaround the forked child fails on Prefect's exit hook (silently: the assertion is raised
    # after multiprocessing's bootstrap has set the exit code). When a Prefect release fixes that, this
    # fails: delete flows/prefect_fork.py and this assertion.
    assert "exitcode 1" in out["without"][0], out["without"]
