"""Resumable data position: torchdata's StatefulDataLoader with a complete generator state and skip_batches()."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.state import rank_seed


def shard(dataset: Any, rank: int, world_size: int) -> Any:
    """Rank `rank`'s strided share of `dataset`; every rank gets the same length (the remainder is dropped)."""
    if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(
            f"shard(): expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
        )
    if world_size == 1:
        return dataset
    usable = len(dataset) - len(dataset) % world_size
    return Subset(dataset, range(rank, usable, world_size))


class ResumableLoader(StatefulDataLoader):
    """A StatefulDataLoader whose state_dict() resumes mid-epoch and across epoch boundaries bit-exactly.

    It always owns a seeded generator (`seed`, or the one passed), so iterating never draws from torch's
    global RNG. StatefulDataLoader alone restores the sampler's generator to the start of the epoch plus
    the permutation draw, which misses the per-epoch base-seed draw; the next epoch would then shuffle
    differently from a run that never stopped. The generator's exact state is saved here and set last.

    With `world_size` > 1 (DDP) it reads only its rank's shard (see `shard`) and seeds its generator with
    `rank_seed(seed, rank, world_size)`, so each rank shuffles its own data reproducibly.
    """

    def __init__(
        self,
        dataset: Any,
        *args: Any,
        seed: int = 0,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world_size: int = 1,
        **kwargs: Any,
    ):
        dataset = shard(dataset, rank, world_size)
        if generator is None:
            generator = torch.Generator()
            generator.manual_seed(rank_seed(seed, rank, world_size))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*")  # torchdata's own deprecation noise
            super().__init__(dataset, *args, generator=generator, **kwargs)
        self.batches_skipped = 0

    def state_dict(self) -> dict[str, Any]:
        """Position in the epoch, the generator's exact state and the count of skipped batches."""
        inner = super().state_dict()
        return {
            "loader": inner,
            "generator": self.generator.get_state(),
            "batches_skipped": self.batches_skipped,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position; the next iter() yields exactly the batches an unbroken run would."""
        super().load_state_dict(state_dict["loader"])
        # Building the resumed iterator now (state_dict() does, and iter() reuses it) spends its generator
        # draws before the saved generator state is put back.
        super().state_dict()
        self.generator.set_state(state_dict["generator"].to(dtype=torch.uint8, device="cpu"))
        self.batches_skipped = int(state_dict.get("batches_skipped", 0))

    def skip_batches(self, n: int) -> int:
        """Advance the position by `n` batches without yielding them; returns the epoch ends crossed.

        Call it between epochs or before iterating (e.g. right after a restore): an epoch iterator already
        handed out is not advanced. Skipped batches are counted in `batches_skipped`.
        """
        if type(n) is not int or n < 0:
            raise ValueError(f"skip_batches(): n: expected an integer >= 0, got {n!r}")
        if n == 0:
            return 0
        crossed, done, empty_epochs = 0, 0, 0
        self.load_state_dict(self.state_dict())
        it = iter(self)
        while done < n:
            try:
                next(it)
            except StopIteration:
                crossed += 1
                empty_epochs += 1
                if empty_epochs > 1:
                    raise ValueError("skip_batches(): the loader yields no batches") from None
                it = iter(self)
                continue
            done += 1
            empty_epochs = 0
        self.batches_skipped += done
        self.load_state_dict(self.state_dict())
        return crossed
