"""The training command as the supervisor runs it, and the lineage name it defaults to (no heavy imports)."""

from __future__ import annotations

import sys
from pathlib import Path


def default_lineage(command: tuple[str, ...]) -> str:
    """A lineage name from the script name: `charlm` for `python examples/charlm.py ...`."""
    for arg in command:
        if arg.endswith(".py"):
            return Path(arg).stem
    return Path(command[0]).name if command else "run"


def python_command(command: list[str]) -> tuple[str, ...]:
    """Run `python x.py` with this interpreter, so the training sees the same environment."""
    if command and command[0] in ("python", "python3"):
        return (sys.executable, *command[1:])
    return tuple(command)
