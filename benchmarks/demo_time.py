"""`make demo` end to end, in a pseudo-terminal as a user sees it: its wall time and how quiet it is.

    python -m benchmarks.demo_time [--json benchmarks/results/demo.json] [--output demo-console.txt]

The child gets a clean environment (no PREFECT_*, MLFLOW_*, DO_NOT_TRACK or CI variables from ours), so the
Makefile and the demo must quieten Prefect themselves. By default Prefect's home is a fresh temporary
directory (a first run: cold database, and the first-run notice would show); `--prefect-home DIR` names one,
`--makefile-home` keeps the Makefile's `.rollback/prefect`. The venv step runs only if the Makefile's install stamp is stale; the JSON
says whether it did.
"""

from __future__ import annotations

import argparse
import os
import pty
import re
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, machine, write_json

#: Output that a quiet run never shows: (name, pattern). Each is counted in the JSON.
NOISE = (
    ("prefect_telemetry_notice", re.compile(r"collects anonymous usage data")),
    ("pip_location_ignored", re.compile(r"Location '.*' is ignored")),
    ("setuptools_editable_banner", re.compile(r"editable install|\*{10}")),
    ("traceback", re.compile(r"^Traceback \(most recent call last\)")),
    ("warning", re.compile(r"\bWARNING\b|Warning:")),
)
#: Variables of ours that would quieten the child for the Makefile: the measurement must not inherit them.
_NOT_INHERITED = re.compile(r"^(PREFECT_|MLFLOW_|ROLLBACK_SUPERVISOR_|DO_NOT_TRACK$|CI$|COLUMNS$|LINES$)")
_CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")


def screen_text(raw: str) -> list[str]:
    """The lines a terminal shows after `raw`: carriage returns, cursor-up and erase-line applied.

    Enough of a terminal for rich's live display (which redraws its lines in place) and plain output; colours
    and other escape sequences are dropped.
    """
    lines: list[str] = [""]
    row = col = 0
    pos = 0
    for match in list(_CSI.finditer(raw)) + [None]:
        end = match.start() if match else len(raw)
        for ch in raw[pos:end]:
            if ch == "\n":
                row, col = row + 1, 0
                if row == len(lines):
                    lines.append("")
            elif ch == "\r":
                col = 0
            elif ch >= " " or ch == "\t":
                line = lines[row].ljust(col)
                lines[row] = line[:col] + ch + line[col + 1 :]
                col += 1
        if match is None:
            break
        pos = match.end()
        arg, op = match.group(1), match.group(2)
        if op == "A":  # cursor up
            row = max(0, row - int(arg or 1))
        elif op == "K" and arg in ("2", ""):  # erase the line (2) or to its end ("")
            lines[row] = "" if arg == "2" else lines[row][:col]
    while lines and not lines[-1].strip():
        lines.pop()
    return [line.rstrip() for line in lines]


def run_in_pty(argv: list[str], env: dict[str, str], cwd: Path, timeout_s: float) -> tuple[int, str, float]:
    """(exit code, everything written to the terminal, wall seconds) of `argv` on an 50x160 pseudo-terminal."""
    import fcntl
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=cwd, start_new_session=True
    )
    os.close(follower)
    chunks: list[bytes] = []
    try:
        while True:
            if time.monotonic() - started > timeout_s:
                os.killpg(proc.pid, 9)
                raise TimeoutError(f"{' '.join(argv)} ran past {timeout_s:.0f} s")
            ready, _, _ = select.select([leader], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(leader, 1 << 16)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        code = proc.wait(timeout=60)
    finally:
        os.close(leader)
    return code, b"".join(chunks).decode(errors="replace"), time.monotonic() - started


def child_env(environ: dict[str, str]) -> dict[str, str]:
    """Our environment less what would quieten Prefect or MLflow for the Makefile; a terminal that can redraw."""
    env = {k: v for k, v in environ.items() if not _NOT_INHERITED.match(k)}
    env.setdefault("TERM", "xterm-256color")
    return env


def noise_counts(lines: list[str]) -> dict[str, int]:
    return {name: sum(bool(pattern.search(line)) for line in lines) for name, pattern in NOISE}


def measure(
    prefect_home: Path | None, first_run: bool, timeout_s: float, make_vars: list[str] = ()
) -> tuple[dict[str, Any], list[str], str]:
    """One `make demo`: the result document, the lines the terminal showed and what it was sent."""
    argv = ["make", "--no-print-directory", "demo", *make_vars]
    if prefect_home is not None:
        argv.append(f"PREFECT_HOME={prefect_home}")
    load_before = os.getloadavg()
    code, raw, wall = run_in_pty(argv, child_env(dict(os.environ)), REPO, timeout_s)
    load_after = os.getloadavg()
    lines = screen_text(raw)
    setup = [line for line in lines if line.startswith("setup: done in ")]
    result = {
        "benchmark": "demo",
        "command": " ".join(argv),
        "exit_code": code,
        "wall_seconds": round(wall, 1),
        "setup_ran": bool(setup),
        "setup_seconds": int(setup[0].split()[3]) if setup else None,
        "prefect_home": str(prefect_home) if prefect_home else "the Makefile's .rollback/prefect",
        "prefect_first_run": first_run,
        "terminal_lines": len(lines),
        "noise": noise_counts(lines),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "machine": machine(),
    }
    return result, lines, raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "demo.json")
    parser.add_argument("--output", type=Path, help="Also write the terminal's lines here.")
    parser.add_argument("--raw", type=Path, help="Also write the bytes as the terminal got them here.")
    homes = parser.add_mutually_exclusive_group()
    homes.add_argument("--prefect-home", type=Path, help="Prefect's home (default: a fresh temporary one).")
    homes.add_argument("--makefile-home", action="store_true", help="Use the Makefile's PREFECT_HOME.")
    parser.add_argument(
        "--make-var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="Passed to make, e.g. VENV=.rollback/venv for a first run that does not touch .venv.",
    )
    parser.add_argument("--notes", default="", help="Said in the JSON: what else ran on the machine.")
    parser.add_argument("--timeout", type=float, default=1800.0, help="Seconds before the demo is killed.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="demo-prefect-") as tmp:
        home = None if args.makefile_home else (args.prefect_home or Path(tmp) / "prefect").resolve()
        first_run = home is not None and not (home / "prefect.db").exists()
        result, lines, raw = measure(home, first_run, args.timeout, args.make_var)
    if args.notes:
        result["notes"] = args.notes
    write_json(result, args.json)
    if args.output:
        args.output.write_text("\n".join(lines) + "\n")
    if args.raw:
        args.raw.write_text(raw)
    print(f"make demo: exit {result['exit_code']} in {result['wall_seconds']} s; noise {result['noise']}")
    print(f"wrote {args.json}")
    return 0 if result["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
