"""The launch plan: what the supervisor tells one training segment (which checkpoint, skip, LR scale).

`load_plan` is also the park point of a `relaunch.park: plan` standby: the parked process runs the training
script up to its first `load_plan` (reached by `Session.attach` and the Lightning / Hugging Face callbacks at
fit / train start) and waits there for its segment. So nothing of ours reads per-segment state before it: the
plan file, and every `ROLLBACK_SUPERVISOR_*` variable (`PLAN_ENV`, the drill's `ROLLBACK_SUPERVISOR_FAULTS`),
are read from `load_plan` on, never at import or while a model is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.errors import UserError

PLAN_ENV = "ROLLBACK_SUPERVISOR_PLAN"
#: The module a parked standby puts in `sys.modules` (`supervisor/launcher/standby_child.py`, same name).
PARK_MODULE = "_rollback_supervisor_park"
log = logging.getLogger("rollback_supervisor.runtime")


@dataclass(frozen=True)
class RestoreSpec:
    """Where a segment starts: a checkpoint id (None = latest valid, or scratch), batches to skip, LR factor.

    `rollback` marks every checkpoint committed after the target as an abandoned branch.
    """

    checkpoint_id: str | None = None
    skip_batches: int = 0
    lr_scale: float = 1.0
    from_scratch: bool = False
    rollback: bool = False


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one training segment needs; written by the supervisor as JSON, read by the training side."""

    lineage: str
    workdir: str
    checkpoint_dir: str
    tracking_uri: str
    checkpoint_remote: str | None = None
    experiment: str = "rollback-supervisor"
    run_id: str | None = None
    segment: int = 0
    policy_path: str | None = None
    # The policy the supervisor validated, as plain data (`policies.plain.policy_data`), so that the training
    # side reads it without pydantic; None (a stand-alone run, an older supervisor): `policy_path` is read.
    policy: dict[str, Any] | None = None
    restore: RestoreSpec = field(default_factory=RestoreSpec)
    history: dict[str, Any] = field(default_factory=dict)
    supervised: bool = True
    supervisor_pid: int | None = None  # the training side stops (emergency checkpoint) if it vanishes
    lineage_seconds: float = 0.0  # how long the lineage's earlier segments ran (the adaptive cadence's MTBF)
    # Where to append metric points for the supervisor to ship to `run_id` (supervisor/spool.py); None: the
    # training process logs to MLflow itself.
    metrics_spool: str | None = None

    @property
    def events_path(self) -> Path:
        return Path(self.workdir) / "events.jsonl"

    @property
    def heartbeat_path(self) -> Path:
        return Path(self.workdir) / "heartbeat.json"

    @property
    def faults_path(self) -> Path:
        return Path(self.workdir) / "faults-fired.json"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchPlan:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:  # a plan from another release of the supervisor: what we know of it still applies
            log.warning("launch plan: ignoring keys this version does not know: %s", ", ".join(unknown))
        data = {k: v for k, v in data.items() if k in known}
        data["restore"] = RestoreSpec(**data.get("restore", {}))
        return cls(**data)

    def write(self, path: Path) -> Path:
        """Write atomically (temp file + rename); processes writing the same plan at once (the ranks of a
        stand-alone job) each use a temp file of their own."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, path: Path) -> LaunchPlan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except FileNotFoundError:
            raise UserError(f"{PLAN_ENV}={path}: plan file does not exist") from None
        except (json.JSONDecodeError, TypeError) as exc:
            raise UserError(
                f"{path}: expected a launch plan written by rollback-supervisor, got: {exc}"
            ) from None


def standalone_plan(run_name: str, workdir: Path | None, policy: Path | None) -> LaunchPlan:
    """A plan for running without a supervisor: everything local under `.rollback/`."""
    root = Path(workdir) if workdir else Path.cwd() / ".rollback"
    run_dir = root / "standalone" / f"{run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    return LaunchPlan(
        lineage=run_dir.name,
        workdir=str(run_dir),
        checkpoint_dir=str(run_dir / "checkpoints"),
        tracking_uri=f"sqlite:///{(root / 'mlflow.db').resolve()}",
        policy_path=str(policy) if policy else None,
        supervised=False,
    )


def park_point() -> None:
    """In a parked standby, wait here for the segment (its per-segment variables are set on return); elsewhere,
    and on every later call, return at once. A preloading standby (`relaunch.preload`) reads the lineage's
    newest checkpoint before it reports ready and follows newer commits while it waits."""
    park = sys.modules.pop(PARK_MODULE, None)
    if park is None:
        return
    root = getattr(park, "preload", None)  # policy `relaunch.preload`: the lineage's local checkpoint store
    if not root:
        park.wait({})
        return
    # Only a preloading standby pays for this import here.
    from supervisor.checkpoint.preload import FIRST_READ_WAIT_SECONDS, Preloader

    left = getattr(park, "park_seconds_left", lambda: float("inf"))()
    preloader = Preloader(root).start(first_wait=max(0.0, min(FIRST_READ_WAIT_SECONDS, left / 2)))
    try:
        park.wait({"preloaded": preloader.held})
    finally:
        preloader.finish(_target())


def _target() -> str | None:
    """The checkpoint id the segment's plan restores (None: the latest), as far as it can be known here; the
    plan's own errors are load_plan's to report."""
    path = os.environ.get(PLAN_ENV)
    try:
        restore = LaunchPlan.read(Path(path)).restore if path else None
    except Exception:  # load_plan reads it next, and says what is wrong with it
        return None
    if restore is None:
        return None
    return "" if restore.from_scratch else restore.checkpoint_id  # "": from scratch, no checkpoint is wanted


def load_plan(run_name: str, workdir: Path | None = None, policy: Path | None = None) -> LaunchPlan:
    """The supervisor's plan from `$ROLLBACK_SUPERVISOR_PLAN`, or a stand-alone one (after the park point)."""
    park_point()
    path = os.environ.get(PLAN_ENV)
    if path:
        return LaunchPlan.read(Path(path))
    return standalone_plan(run_name, workdir, policy)
