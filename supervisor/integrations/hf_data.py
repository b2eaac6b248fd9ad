"""The HF Trainer's data position: which batch of its own shuffled order comes next, kept across resumes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from supervisor.errors import CheckpointError, UserError


class BatchCountMismatch(CheckpointError, UserError):
    """The checkpoint's data position counts batches of another size of epoch than this Trainer's."""


class DataPosition:
    """How many batches of the Trainer's shuffled order were consumed, skips included: the loader's state."""

    def __init__(self, per_epoch: int):
        self.per_epoch = per_epoch
        self.batches = 0
        self.batches_skipped = 0

    def state_dict(self) -> dict[str, int]:
        return {"batches": self.batches, "batches_per_epoch": self.per_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = int(state["batches_per_epoch"])
        if saved != self.per_epoch:
            raise BatchCountMismatch(
                f"data.batches_per_epoch: the checkpoint was written with {saved} batches per epoch, this "
                f"Trainer has {self.per_epoch}; resume with the dataset, batch size and drop_last it was "
                "written with"
            )
        self.batches = int(state["batches"])

    def skip_batches(self, n: int) -> int:
        """Skip the next `n` batches of the order (a plan's `skip_batches`)."""
        self.batches += n
        self.batches_skipped += n
        return n

    def epoch_of(self, position: int) -> tuple[int, int]:
        """(data epoch, batch within it) of the batch at absolute `position`."""
        return divmod(position, self.per_epoch)


class ResumableOrder:
    """A batch sampler continuing the Trainer's own order from `position`: `len(inner)` batches per iteration.

    Each data epoch is the inner batch sampler's order for that epoch (its sampler's `set_epoch(epoch)`), so
    a run that never resumed sees exactly the batches it would have seen without the supervisor. Which
    batches it handed out is kept (by position) until the callback says they were trained on. Once `ended`
    it hands out nothing: the Trainer's loop then ends without a step (a segment restored at its last step).
    """

    def __init__(self, inner: Any, position: DataPosition):
        self.inner, self.position = inner, position
        self.issued: dict[int, list[int]] = {}
        self.ended = False

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(()) if self.ended else self._from(self.position.batches)

    def _from(self, start: int) -> Iterator[list[int]]:
        epoch, skip = self.position.epoch_of(start)
        handed = 0
        while handed < len(self.inner):
            # Under DDP the inner sampler is accelerate's BatchSamplerShard over the Trainer's batch sampler.
            sampler = getattr(getattr(self.inner, "batch_sampler", self.inner), "sampler", None)
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)
            for index, batch in enumerate(self.inner):
                if index < skip:
                    continue
                self.issued[start + handed] = list(batch)
                yield batch
                handed += 1
                if handed == len(self.inner):
                    return
            epoch, skip = epoch + 1, 0

    def consumed(self, position: int) -> list[int]:
        """The sample indices of the batch at `position`, now trained on (forgotten here)."""
        for old in [p for p in self.issued if p < position]:
            del self.issued[old]
        return self.issued.pop(position, [])
