"""`make demo`: the example under the palm-spike preset with a fault mix, supervised by the real flow.

Embedded defaults: a local MLflow sqlite store and checkpoints under `.rollback/`, Prefect's ephemeral server.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: A spike and a NaN (rolled back in process), a SIGKILL and a GPU falling off the bus (relaunched).
FAULTS = "spike@450,kill@520,hw@650,nan@760"
STEPS = 900


def main() -> int:
    workdir = REPO / ".rollback" / "demo"
    shutil.rmtree(workdir, ignore_errors=True)  # the demo starts a fresh lineage each time
    os.environ["ROLLBACK_SUPERVISOR_FAULTS"] = FAULTS
    print(f"demo: training examples/charlm.py for {STEPS} steps under policies/presets/palm-spike.yaml")
    print(f"demo: injecting faults {FAULTS}", flush=True)
    from supervisor.cli import main as cli

    code = cli(
        [
            "run",
            "--policy",
            str(REPO / "policies" / "presets" / "palm-spike.yaml"),
            "--lineage",
            "charlm-demo",
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
    print(f"demo: lineage record  {workdir / 'lineages' / 'charlm-demo' / 'lineage.json'}")
    print(f"demo: status          rollback-supervisor status --workdir {workdir}")
    print(f"demo: MLflow UI       mlflow ui --backend-store-uri sqlite:///{workdir / 'mlflow.db'}")
    print(
        "demo: the run's artifacts hold loss.png (anomalies, rollbacks, abandoned branches) and events.json"
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
