"""Per-test wall and CPU seconds, to find the tests that wait rather than work (`ROLLBACK_TEST_CPU=FILE`).

On 2 cores a test that sleeps or polls leaves a core idle; `--durations` cannot tell it from one that trains.
With the variable set, each test (setup, call and teardown together) appends one JSON line to FILE: its wall
seconds and the CPU seconds of the worker process and of the children it reaped meanwhile (a session
server's CPU is not counted). Summarise with `python -m tests.cpu_profile FILE`.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

ENV = "ROLLBACK_TEST_CPU"
_path: str | None = None  # read once; the variable is then taken out of the environment tests compare


def pytest_configure(config: pytest.Config) -> None:
    global _path
    _path = os.environ.get(ENV)
    # xdist's controller keeps it for the workers it starts; a process that runs tests drops it.
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        os.environ.pop(ENV, None)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    path = _path
    if not path:
        yield
        return
    wall, cpu = time.perf_counter(), _cpu()
    yield
    row = {
        "test": item.nodeid,
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(_cpu() - cpu, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),  # its rows are in the order it ran them
    }
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")


def main(argv: list[str]) -> int:
    rows = [json.loads(line) for line in Path(argv[0]).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: r["wall_s"] - r["cpu_s"], reverse=True)
    wall, cpu = sum(r["wall_s"] for r in rows), sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests: {wall:.0f} s wall, {cpu:.0f} s CPU; most idle first (wall - CPU):")
    for r in rows[: int(argv[1]) if len(argv) > 1 else 30]:
        print(f"{r['wall_s'] - r['cpu_s']:7.1f} {r['wall_s']:7.1f} {r['cpu_s']:7.1f}  {r['test']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
