"""Where a version of a script's checkpoint files gets its step: the file's name, a sidecar file, or the output.

- `NameStep`: the `step` group of a regex over the file's path (`step_(?P<step>\\d+)\\.pt`). Exact, and each step
  is its own version (`per_file`).
- `SidecarStep`: a number the script writes beside its checkpoint (`{"iter_num": 2000}`). Exact if the script
  writes the sidecar before the checkpoint file settles; the version is a snapshot of every matched file.
- `OutputStep`: for one overwritten file (nanoGPT's `ckpt.pt`), the step of the last output line read at or
  before the file's modification time. The file system stamps mtimes from a coarse clock (a few ms behind), so
  lines read up to `MTIME_SLACK` after it still count: that errs toward a later step, the safe side for a
  rollback (a version is chosen only if its step is far enough before the anomaly). What it cannot see is a
  line the script printed before the save but that the supervisor had not yet read (the pipe's lag, usually
  well under a step); keep `lookback_steps` well above that.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from supervisor.smallfile import read_small_file

log = logging.getLogger("rollback_supervisor.script")

#: Seconds after a file's mtime within which an output line still counts as printed before the save.
MTIME_SLACK = 0.02
#: A sidecar is a few bytes of JSON or text; anything larger is not one.
MAX_SIDECAR = 1 << 16


class StepRule(Protocol):
    """The step of a changed checkpoint file, or None when it is not known yet (the file waits)."""

    per_file: bool
    """True: each step is its own version (the files whose names carry it); False: a version is a snapshot."""

    def step(self, rel: str, mtime: float) -> int | None: ...


class NameStep:
    """The step in the file's path, from the `step` group of `pattern`."""

    per_file = True

    def __init__(self, pattern: str):
        self.pattern = re.compile(pattern)
        self._warned: set[str] = set()

    def step(self, rel: str, mtime: float = 0.0) -> int | None:
        match = self.pattern.search(rel)
        if match is None or not (match.group("step") or "").isdigit():
            if rel not in self._warned:
                self._warned.add(rel)
                log.warning(
                    "%s matches script.checkpoints.glob but not step_pattern /%s/; it is not versioned",
                    rel,
                    self.pattern.pattern,
                )
            return None
        return int(match.group("step"))


class SidecarStep:
    """The step in a sidecar file: a JSON object's `key`, or (no key) the whole text."""

    per_file = False

    def __init__(self, path: Path, key: str | None):
        self.path, self.key = Path(path), key

    def step(self, rel: str = "", mtime: float = 0.0) -> int | None:
        try:
            text = read_small_file(str(self.path), MAX_SIDECAR).decode()
            value = json.loads(text)[self.key] if self.key is not None else int(text.strip())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("sidecar %s: expected %s, got %s; waiting", self.path, self._expected(), exc)
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            log.warning("sidecar %s: expected %s, got %r; waiting", self.path, self._expected(), value)
            return None
        return value

    def _expected(self) -> str:
        return f'a JSON object with an integer "{self.key}"' if self.key else "an integer"


class OutputStep:
    """The step of the last output line read at or before the file changed (see the module docstring)."""

    per_file = False

    def __init__(self, step_at: Callable[[float], int]):
        self.step_at = step_at

    def step(self, rel: str, mtime: float) -> int | None:
        return self.step_at(mtime + MTIME_SLACK)
