"""What both end-to-end benchmarks share: the example's location, child-process environment, JSON output."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from supervisor.errors import SupervisorError, UserError

REPO = Path(__file__).resolve().parents[1]
CHARLM = REPO / "examples" / "charlm.py"
#: The example's size presets (kept in sync with examples/charlm.py SIZES; checked there at run time).
SIZES = ("tiny", "small", "10M", "100M")
#: Keeps MLflow's own clients quiet and off the network in every child process.
QUIET_ENV = {
    "GIT_PYTHON_REFRESH": "quiet",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "PYTHONUNBUFFERED": "1",
}


class BenchError(UserError):
    """A benchmark option is out of range, or the source checkout it needs is missing."""


class BenchRunError(SupervisorError):
    """A benchmark's child process failed or did not do what the measurement needs; the message says where."""


def check_size(size: str) -> str:
    if size not in SIZES:
        raise BenchError(f"--size: expected one of {', '.join(SIZES)}, got {size!r}")
    if not CHARLM.exists():
        raise BenchError(
            f"{CHARLM}: the example workload is missing; run the benchmark from a source checkout"
        )
    return size


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark child: ours, the repository importable, no inherited drill or plan."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBACK_SUPERVISOR_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return {**env, **QUIET_ENV, **extra}


def load_charlm() -> ModuleType:
    """Import examples/charlm.py as the module `charlm` (examples/ is not a package)."""
    if "charlm" in sys.modules:
        return sys.modules["charlm"]
    spec = importlib.util.spec_from_file_location("charlm", CHARLM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["charlm"] = module
    spec.loader.exec_module(module)
    return module


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def target(value: float | None, goal: float, *, at_least: bool = False) -> dict[str, Any]:
    """A measured ratio next to its goal, and whether it was met."""
    met = None if value is None else (value >= goal if at_least else value <= goal)
    return {"value": value, "target": goal, "met": met}


def machine() -> dict[str, Any]:
    """Where the numbers came from: a busy 2-core machine reads very differently from an idle one."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_json(result: dict[str, Any], path: Path | None) -> str:
    text = json.dumps(result, indent=2)
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return text
