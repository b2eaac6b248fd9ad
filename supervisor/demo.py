"""`make demo`: the example under the palm-spike preset with a fault mix, supervised by the real flow.

Embedded defaults: a local MLflow sqlite store and checkpoints under `.rollback/`, Prefect's ephemeral server
with its home in `.rollback/prefect`, no telemetry. Run outside make (`python -m supervisor.demo`), it sets the
same quiet defaults itself; a variable already set in the environment wins.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: A spike and a NaN (rolled back in process), a SIGKILL and a GPU falling off the bus (relaunched).
FAULTS = "spike@450,kill@520,hw@650,nan@760"
STEPS = 900
LINEAGE = "charlm-demo"
#: Where the Makefile puts Prefect's home: one database for every demo run, so the UI shows them all.
PREFECT_HOME = REPO / ".rollback" / "prefect"
PREFECT_UI_PORT = 4200


def quiet_defaults() -> None:
    """The Makefile's quiet, offline settings, without overriding the user's; before Prefect is imported."""
    from flows.prefect_env import apply_defaults

    # Prefect's first-run notice ("collects anonymous usage data") is printed by the client on import, in a
    # terminal; PREFECT_SERVER_ANALYTICS_ENABLED does not reach it, DO_NOT_TRACK does (MLflow's telemetry too).
    os.environ.setdefault("DO_NOT_TRACK", "true")
    os.environ.setdefault("PREFECT_HOME", str(PREFECT_HOME))  # the Makefile's, not the lineage workdir's
    apply_defaults(PREFECT_HOME.parent)  # the rest, and PREFECT_HOME's directory


def shown(path: Path, cwd: Path) -> str:
    """`path` relative to `cwd` when it lies under it (what `make demo` prints), else absolute."""
    try:
        return str(path.resolve().relative_to(cwd.resolve()))
    except ValueError:
        return str(path.resolve())


def next_steps(workdir: Path, bin_dir: Path, environ: Mapping[str, str], cwd: Path) -> list[tuple[str, str]]:
    """(what, the command or file to paste) for looking at the demo's lineage afterwards; paths relative to cwd."""
    lineage_dir = workdir / "lineages" / LINEAGE
    mlflow_ui = f"{shown(bin_dir / 'mlflow', cwd)} ui --backend-store-uri sqlite:///{shown(workdir / 'mlflow.db', cwd)}"
    api = environ.get("PREFECT_API_URL")
    if api:  # the flow ran on the user's own server: its UI has the run
        prefect_ui = [("Prefect UI", api.removesuffix("/").removesuffix("/api"))]
    else:  # the ephemeral server kept its database in PREFECT_HOME: a server on it shows the run
        home = shown(Path(environ.get("PREFECT_HOME", PREFECT_HOME)).expanduser(), cwd)
        prefect_ui = [
            (
                "Prefect UI",
                f"PREFECT_HOME={home} PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=true "
                f"{shown(bin_dir / 'prefect', cwd)} server start --host 127.0.0.1 --port {PREFECT_UI_PORT}",
            ),
            ("", f"then open http://127.0.0.1:{PREFECT_UI_PORT} (Runs: the demo's flow run)"),
        ]
    return [
        ("status", f"{shown(bin_dir / 'rollback-supervisor', cwd)} status --workdir {shown(workdir, cwd)}"),
        ("loss plot", shown(lineage_dir / "loss.png", cwd)),
        ("MLflow UI", mlflow_ui),
        *prefect_ui,
    ]


def main() -> int:
    quiet_defaults()
    workdir = REPO / ".rollback" / "demo"
    shutil.rmtree(workdir, ignore_errors=True)  # the demo starts a fresh lineage each time
    os.environ["ROLLBACK_SUPERVISOR_FAULTS"] = FAULTS
    print(f"demo: training examples/charlm.py for {STEPS} steps under policies/presets/palm-spike.yaml")
    print(f"demo: injecting faults {FAULTS}", flush=True)
    started = time.monotonic()
    from supervisor.cli import main as cli

    code = cli(
        [
            "run",
            "--policy",
            str(REPO / "policies" / "presets" / "palm-spike.yaml"),
            "--lineage",
            LINEAGE,
            "--workdir",
            str(workdir),
            "--stop-grace",
            "20",
            "--",
            "python",
            str(REPO / "examples" / "charlm.py"),
            "--steps",
            str(STEPS),
            "--eval-every",
            "50",
        ]
    )
    print(f"demo: {'done' if code == 0 else f'exit {code}'} in {time.monotonic() - started:.0f} s; next:")
    steps = next_steps(workdir, Path(sys.executable).parent, os.environ, Path.cwd())
    width = max(len(what) for what, _ in steps)
    for what, how in steps:
        print(f"  {what:<{width}}  {how}")
    return code


if __name__ == "__main__":
    sys.exit(main())
