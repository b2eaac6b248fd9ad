"""benchmarks/demo_time.py: the terminal model it reads `make demo`'s output with, and its noise counts."""

from __future__ import annotations

import pytest

from benchmarks.demo_time import child_env, noise_counts, screen_text


@pytest.mark.parametrize(
    ("raw", "lines"),
    [
        ("a\r\nb\r\n", ["a", "b"]),
        ("progress 1\rprogress 2\r\n", ["progress 2"]),
        ("\x1b[1mbold\x1b[0m plain\n", ["bold plain"]),
        # rich's live display: hide the cursor, draw two lines, go back up over them, draw again
        (
            "\x1b[?25lseg 0 · step 1\nfoo\r\x1b[2K\x1b[1A\x1b[2Kseg 0 · step 2\nbar\x1b[?25h\r\ndone\r\n",
            ["seg 0 · step 2", "bar", "done"],
        ),
        ("abc\r\x1b[Kx\n", ["x"]),  # erase to the end of the line
        ("long line\rshort\n", ["shortline"]),  # a carriage return overwrites, it does not erase
        ("\n\n", []),
    ],
)
def test_screen_text_applies_what_a_terminal_would(raw, lines):
    assert screen_text(raw) == lines


def test_noise_counts_name_each_kind_of_noise():
    lines = [
        "Prefect collects anonymous usage data to improve the product.",
        "WARNING: Location 'file:///opt/pypi-more/simple/x/' is ignored: it is either a non-existing path",
        "demo: done in 130 s; next:",
    ]
    counts = noise_counts(lines)
    assert counts["prefect_telemetry_notice"] == 1 and counts["pip_location_ignored"] == 1
    assert counts["traceback"] == 0


def test_the_child_inherits_none_of_our_quiet_settings():
    env = child_env({"PREFECT_HOME": "/x", "DO_NOT_TRACK": "1", "CI": "1", "MLFLOW_X": "1", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "TERM": "xterm-256color"}
