"""The branch a manager saves on: commit numbering, the parent of the next save, and the last save or restore."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from supervisor.checkpoint.options import CheckpointInfo, make_id
from supervisor.checkpoint.writer import CheckpointMeta


class Branch:
    """Numbers saves (seq goes on after every seq the store already holds) and hangs each off the last one.

    After a restore or a rollback the branch moves: the next save's parent is the checkpoint restored.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        provenance: tuple[dict[str, str], str | None, str | None],
        held_seqs: Iterable[int] = (),
    ):
        self._clock = clock
        self._provenance = provenance
        self._next_seq = max(held_seqs, default=0) + 1
        self.parent: str | None = None
        self.last: CheckpointInfo | None = None

    def already_saved(self, step: int) -> CheckpointInfo | None:
        """The last save when it was of `step` (a step this branch already saved)."""
        if self.last is not None and self.last.step == step:
            return self.last
        return None

    def next_meta(self, step: int, metrics: Mapping[str, float]) -> CheckpointMeta:
        """The manifest record of the next save, its seq taken."""
        seq = self._next_seq
        self._next_seq += 1
        versions, commit, config = self._provenance
        return CheckpointMeta(
            make_id(step, seq), seq, step, self._clock(), dict(metrics), self.parent, versions, commit, config
        )

    def moved_to(self, info: CheckpointInfo) -> None:
        """`info` was saved, restored or rolled back to: the next save hangs off it."""
        self.parent, self.last = info.id, info


__all__ = ["Branch"]
