"""`make demo`: the example workload on embedded defaults (local MLflow sqlite, local checkpoints)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    workdir = REPO / ".rollback"
    cmd = [sys.executable, str(REPO / "examples" / "charlm.py"), "--steps", "300", "--workdir", str(workdir)]
    print("demo:", " ".join(cmd), flush=True)
    code = subprocess.call(cmd, cwd=REPO)
    print(f"demo: exit {code}; MLflow store: sqlite:///{workdir / 'mlflow.db'}")
    print(f"demo: view it with `mlflow ui --backend-store-uri sqlite:///{workdir / 'mlflow.db'}`")
    return code


if __name__ == "__main__":
    sys.exit(main())
