"""Where a script's segment starts: the version put back in place, and the arguments that make it resume.

The first segment runs the command as given. A relaunch puts the decision's checkpoint back in place (the
newest healthy one after an interrupted supervisor) and appends `script.relaunch.args`, filled in:

- `{checkpoint}`: the restored file's path relative to the working directory (their common directory when a
  version holds several files);
- `{step}`: the version's step;
- `{lr_scale}`: the factor in effect when the version was saved times the decision's own, the way a `Session`
  scales the learning rate it restores from a checkpoint (so a resume after a rollback keeps the lower rate);
- `{skip_batches}`: the decision's;
- and the policy's `values`.

A relaunch from scratch (`allow_scratch` with no checkpoint) runs the command as given: the template's
arguments name a checkpoint, so none of them can be honoured then.

A version that cannot be put back (a damaged blob or manifest) is skipped, with the reason logged, for the next
older healthy version of the surviving branch, as the training side's restorer falls back to older commits;
the relaunch fails only when none is left.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from supervisor.checkpoint import open_store
from supervisor.checkpoint.view import MergedCatalog
from supervisor.errors import CheckpointError, CheckpointNotFound
from supervisor.runtime.plan import RestoreSpec
from supervisor.script.files import Restored, ScriptFiles
from supervisor.script.template import ArgTemplate

log = logging.getLogger("rollback_supervisor.script")


@dataclass(frozen=True)
class Start:
    """How a segment starts: its command, the version it resumes (None: as given), and the LR factor in effect."""

    command: tuple[str, ...]
    version: Restored | None
    lr_scale: float

    @property
    def step(self) -> int:
        return self.version.step if self.version is not None else 0


def plan_start(
    files: ScriptFiles,
    template: ArgTemplate,
    values: dict[str, float],
    command: tuple[str, ...],
    restore: RestoreSpec,
    *,
    first: bool,
    allow_nonfinite: bool = False,
) -> Start:
    """Put the version `restore` names back in place (with `files`, not yet open) and fill in the arguments."""
    target = None if first or restore.from_scratch else restore.checkpoint_id
    if target is None and not first and not restore.from_scratch and any(files.store_dir.glob("ckpt-*")):
        newest = MergedCatalog([open_store(files.store_dir)], allow_nonfinite=allow_nonfinite).latest()
        target = newest.id if newest is not None else None
    if target is None:
        if not first:
            why = "a relaunch from scratch" if restore.from_scratch else "no checkpoint to resume from"
            log.warning("relaunching the script as first given: %s", why)
        return Start(tuple(command), None, 1.0)
    files.open(baseline=False)
    try:
        version = _restore_or_older(files, target, restore.rollback, allow_nonfinite)
    finally:
        files.close()
    carried = version.notes.get("lr_scale", 1.0)
    lr_scale = (carried if isinstance(carried, int | float) else 1.0) * restore.lr_scale
    fields = {
        **values,
        "checkpoint": _where(version.files),
        "step": version.step,
        "lr_scale": lr_scale,
        "skip_batches": restore.skip_batches,
    }
    args = template.render(fields)
    log.info("relaunching the script from checkpoint %s (step %d) with %s", target, version.step, args)
    return Start((*command, *args), version, lr_scale)


def _restore_or_older(files: ScriptFiles, target: str, rollback: bool, allow_nonfinite: bool) -> Restored:
    """Put `target` back, or else the newest older usable version (each failure logged with its reason)."""
    catalog = MergedCatalog([files.catalog], allow_nonfinite=allow_nonfinite)
    infos = catalog.list()
    wanted = next((i for i in infos if i.id == target), None)
    tries = [target] + [
        i.id
        for i in reversed(infos)
        if wanted is not None and i.seq < wanted.seq and not i.abandoned and (i.healthy or allow_nonfinite)
    ]
    reasons = []
    for cid in tries:
        try:
            version = files.restore(cid, rollback=rollback)
        except CheckpointError as exc:
            reasons.append(f"{cid}: {exc}")
            log.warning("Not restoring checkpoint %s (%s); trying the previous one", cid, exc)
            continue
        if cid != target:
            log.warning("relaunching from checkpoint %s instead of %s, which cannot be put back", cid, target)
        return version
    raise CheckpointNotFound(
        f"no version in {files.store_dir} can be put back for the relaunch ({'; '.join(reasons)})"
    )


def _where(files: tuple[str, ...]) -> str:
    return files[0] if len(files) == 1 else os.path.commonpath(files) or "."
