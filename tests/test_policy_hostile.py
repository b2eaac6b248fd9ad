"""Hostile policy files (issue 14, section 4): each is refused by `policy validate` with exit 2, one message
naming the file (and line:col where there is one), no traceback, in under 3 s and 500 MB.

Each case runs the real CLI in a child process and reads the child's own peak RSS (VmHWM) and the time
the command took inside it (the interpreter's start-up is the same for any file). Before the guard these took
17-60 s and 1.4-3.6 GB, raised ValueError/RecursionError/MemoryError tracebacks, or hung on a FIFO.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from policies import PRESETS_DIR, PolicyError, parse_policy
from policies.loader import MAX_PROBLEMS
from policies.yaml_guard import MAX_BYTES, MAX_NODES, brief

SECONDS, PEAK_MB, HANG_S = 3.0, 500, 60.0
HEAD = "version: 1\nname: hostile\nrules:\n  - when: [spike]\n    action: fail\n"
#: Runs the CLI's entry point on argv[1:-1]; writes how long the command itself took and the process's own
#: peak RSS (VmHWM: its address space's high-water mark since exec) to argv[-1]. The rusage of a waited child
#: is no good here: Linux carries the forking parent's peak RSS over into it (a big pytest process reads as
#: a big child).
CHILD = """\
import json, sys, time
from supervisor.cli import main
t0 = time.perf_counter()
code = main(["policy", "validate", *sys.argv[1:-1]])
seconds = time.perf_counter() - t0
hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
with open(sys.argv[-1], "w") as fh:
    json.dump({"seconds": seconds, "peak_kb": int(hwm.split()[1])}, fh)
sys.exit(code)
"""


def _bomb() -> str:
    """Block-style billion laughs: 10 levels of 9 aliases each, the last used as a value (9^10 leaves)."""
    lines = ["version: 1", "lol: &a0", "  - lol"]
    for i in range(1, 11):
        lines += [f"l{i}: &a{i}", *[f"  - *a{i - 1}"] * 9]
    return "\n".join([*lines, "name: *a10", "rules: [{when: [spike], action: fail}]"]) + "\n"


def _unknown_keys(n: int) -> str:
    return HEAD + "".join(f"unknown_key_{i:07d}: 1\n" for i in range(n))


def _bad_detectors(n: int) -> str:
    return HEAD + "monitor:\n  detectors:\n" + "".join(f"    - {{type: bogus{i}}}\n" for i in range(n))


#: name -> (file text, or a path to use as is; what stderr must say). {f} is the file as passed.
CASES = {
    "alias-bomb": (_bomb(), "{f}:40:5: (syntax): expected aliases that bring in at most"),
    "420k-unknown-keys-10MB": (
        _unknown_keys(420_000),
        "{f}: expected a policy file of at most 1048576 bytes",
    ),
    "20k-unknown-keys": (_unknown_keys(20_000), f"{{f}}: {20_000 - MAX_PROBLEMS} more problem(s) not shown"),
    "100k-invalid-detectors": (
        _bad_detectors(100_000),
        "{f}: expected a policy file of at most 1048576 bytes",
    ),
    "15k-invalid-detectors": (
        _bad_detectors(15_000),
        f"{{f}}: {15_000 - MAX_PROBLEMS} more problem(s) not shown",
    ),
    "5000-digit-integer": (
        HEAD + "checkpoint: {every_steps: " + "9" * 5000 + "}\n",
        "{f}:6:27: (syntax): expected valid YAML, got an integer of 5000 digits",
    ),
    "nested-20k-flow": (
        HEAD + "x: " + "[" * 20_000 + "]" * 20_000 + "\n",
        "{f}:6:67: (syntax): expected nesting",
    ),
    "nested-20k-block": (HEAD + "x:\n  " + "- " * 20_000 + "y\n", "{f}:7:129: (syntax): expected nesting"),
    "recursive-alias": (HEAD + "x: &r [1, *r]\n", "{f}:6:11: (syntax): expected an alias to a finished node"),
    "too-many-nodes": (
        HEAD + "x: [" + ",".join(["1"] * MAX_NODES) + "]\n",
        "expected at most 50000 YAML nodes",
    ),
    "dev-zero": (
        Path("/dev/zero"),
        "{f}: expected a policy file, got a character device: not a regular file",
    ),
    "fifo": (None, "{f}: expected a policy file, got a FIFO: not a regular file"),
}


def _validate(tmp_path: Path, *files: str) -> dict:
    """Run `policy validate FILES` in a child: exit code, stderr, peak RSS (MB), command and total seconds."""
    timing = tmp_path / "timing.json"
    err_path = tmp_path / "stderr.txt"
    started = time.monotonic()
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *files, str(timing)], stdout=subprocess.DEVNULL, stderr=err
        )
        killer = threading.Timer(HANG_S, proc.kill)  # the old loader hangs on a FIFO
        killer.start()
        try:
            _, status = os.waitpid(proc.pid, 0)
        finally:
            killer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    measured = json.loads(timing.read_text()) if timing.exists() else {}
    return {
        "code": proc.returncode,
        "stderr": err_path.read_text(errors="replace"),
        "peak_mb": measured.get("peak_kb", float("inf")) / 1024,
        "seconds": measured.get("seconds"),
        "total_seconds": time.monotonic() - started,
    }


@pytest.mark.e2e
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_file_is_refused_quickly_with_little_memory(tmp_path: Path, case: str):
    content, expected = CASES[case]
    if isinstance(content, Path):
        target = str(content)
    else:
        target = str(tmp_path / f"{case}.yaml")
        if content is None:
            os.mkfifo(target)  # no writer: reading it would wait forever
        else:
            Path(target).write_text(content)
    run = _validate(tmp_path, target)
    print(
        f"{case}: {run['seconds']} s in the command, {run['total_seconds']:.2f} s in all, {run['peak_mb']:.0f} MB"
    )
    assert run["code"] == 2, run["stderr"][-2000:]
    assert "Traceback" not in run["stderr"]
    assert expected.format(f=target) in run["stderr"], run["stderr"][:2000]
    assert run["stderr"].endswith("1 of 1 policy file(s) invalid\n")
    assert len(run["stderr"].splitlines()) <= MAX_PROBLEMS + 2
    assert max(len(line) for line in run["stderr"].splitlines()) < 400  # nothing is dumped whole
    assert run["seconds"] is not None and run["seconds"] < SECONDS
    assert run["peak_mb"] < PEAK_MB


@pytest.mark.e2e
def test_every_preset_still_validates_in_the_same_child(tmp_path: Path):
    presets = sorted(str(p) for p in PRESETS_DIR.glob("*.yaml"))
    run = _validate(tmp_path, *presets)
    assert run["code"] == 0, run["stderr"]
    assert run["seconds"] < SECONDS and run["peak_mb"] < PEAK_MB


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    return info.value.problems


@pytest.mark.parametrize(
    ("version", "shown"), [("true", "true"), ("1.0", "1.0"), ('"1"', '"1"'), ("2", "2"), ("0x1", "0x1")]
)
def test_only_the_integer_1_is_version_1(version: str, shown: str):
    text = HEAD.replace("version: 1", f"version: {version}")
    if version == "0x1":  # YAML 1.1 hex: the integer 1 written another way is still the integer 1
        assert parse_policy(text).version == 1
        return
    assert _problems(text) == [f"p.yaml:1:10: version: expected 1, got {shown}"]


MERGED = """\
version: 1
name: merged
rules:
  - when: [spike]
    action: rollback
    target: &base {select: before, lookback_steps: 100}
  - when: [divergence]
    action: rollback
    target:
      <<: *base
      lookback_steps: 200
"""


def test_a_merge_then_an_override_is_allowed():
    policy = parse_policy(MERGED)
    assert [r.target.lookback_steps for r in policy.rules] == [100, 200]


def test_a_real_duplicate_is_still_refused_next_to_a_merge():
    text = MERGED + "      lookback_steps: 300\n"
    assert _problems(text) == [
        'p.yaml:12:7: rules[1].target.lookback_steps: expected each key once, got "lookback_steps" again '
        "(first on line 11)"
    ]


def test_a_problem_in_an_overriding_key_points_at_the_override():
    text = MERGED.replace("lookback_steps: 200", "lookback_steps: -5")
    assert _problems(text) == [
        "p.yaml:11:23: rules[1].target.lookback_steps: expected an integer >= 0, got -5"
    ]


def test_problems_past_the_first_are_counted_not_listed():
    problems = _problems(_unknown_keys(MAX_PROBLEMS + 5))
    assert len(problems) == MAX_PROBLEMS + 1
    assert problems[0].startswith('p.yaml:6:1: unknown_key_0000000: expected a known key, got unknown key "')
    assert problems[-1] == "p.yaml: 5 more problem(s) not shown; fix the ones above first"


def test_a_huge_key_or_value_is_cut_in_the_message():
    long = "k" * 1000  # YAML's longest simple key
    (problem,) = _problems(HEAD + f"{long}: 1\n")
    assert len(problem) < 300 and problem.startswith("p.yaml:6:1: kkk")
    for value in ("[" + ", ".join(["x"] * 20_000) + "]", "\n" + "  - x\n" * 20_000):  # flow and block style
        (problem,) = _problems(HEAD.replace("name: hostile", f"name: {value}"))
        assert len(problem) < 200 and problem.endswith("..."), problem


def test_an_impossible_date_is_located():
    assert _problems(HEAD + "x: 2001-13-45\n") == [
        'p.yaml:6:4: (syntax): expected valid YAML, got timestamp "2001-13-45" (month must be in 1..12)'
    ]


def test_text_over_the_cap_is_refused_before_parsing():
    assert _problems("#" * (MAX_BYTES + 1)) == [
        f"p.yaml: expected a policy file of at most {MAX_BYTES} bytes (1 MiB), got {MAX_BYTES + 1} bytes; "
        "a policy is a small YAML file"
    ]


def test_a_directory_is_not_a_regular_file(tmp_path: Path):
    from policies import load_policy

    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path)
    assert str(info.value) == f"{tmp_path}: expected a policy file, got a directory: not a regular file"


def test_brief_never_encodes_more_than_it_shows():
    class Endless(list):
        def __iter__(self):  # an encoder that read it all would never return
            while True:
                yield "lol"

    assert brief(Endless([1])) == '["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", ...'
