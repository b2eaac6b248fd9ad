"""When a script's checkpoint glob that has matched no file yet deserves a warning.

A script saves when it likes: nanoGPT first saves at its `eval_interval` (step 250 of shakespeare_char), so
"nothing after N scans" warned about every healthy script that saves later than N scans. The warning waits
instead for evidence: the script printed a step past the one its first save was expected by
(`script.checkpoints.expect_within_steps`), or `warn_after_seconds` passed since the segment started. Pure: the
caller passes the elapsed time and the step printed last.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FirstSave:
    """When a segment's first checkpoint file is overdue: a step past `start_step + within_steps`, or a time."""

    start_step: int = 0
    """The step the segment started at (a relaunch resumes mid-run)."""
    within_steps: int | None = None
    """The script's first save comes within this many steps of `start_step`; None: no step is expected."""
    after_seconds: float | None = None
    """Overdue this many seconds after the segment started (the policy's default is 300); None: never by time."""

    def overdue(self, elapsed: float, printed: int | None) -> str | None:
        """Why the first save is overdue `elapsed` seconds into the segment with step `printed` read last, or None."""
        if self.within_steps is not None and printed is not None:
            due = self.start_step + self.within_steps
            if printed > due:
                return (
                    f"the script printed step {printed}, past step {due} by which its first save was expected "
                    f"(script.checkpoints.expect_within_steps: {self.within_steps} from step {self.start_step})"
                )
        if self.after_seconds is not None and elapsed >= self.after_seconds:
            return (
                f"it is {elapsed:.0f} s since the segment started (script.checkpoints.warn_after_seconds: "
                f"{self.after_seconds:g})"
            )
        return None
