"""Exact data position: ResumableLoader, the registered form of any torch loader, and worker RNG streams.

What a resume guarantees per kind of loader (`loader_part` decides when it is registered):
- `ResumableLoader`: the exact batches, order and every worker's RNG streams, mid-epoch and across epochs.
- a plain torchdata `StatefulDataLoader`: registered through `StatefulLoaderState`, which adds the exact state
  of its generator (or spends its draws from torch's global RNG before that RNG is restored); with worker
  processes only if its dataset checkpoints its own state, since the workers' RNG streams are not its own.
- a plain torch `DataLoader`: refused; it has no position to save.
- anything else with `state_dict()`/`load_state_dict()`: exactly what its own state holds.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.errors import UserError
from supervisor.rng import capture_rng, rank_seed, restore_rng
from supervisor.stateful import Stateful

log = logging.getLogger("rollback_supervisor.checkpoint")


class LoaderError(UserError, ValueError):
    """A data loader whose position cannot be resumed exactly."""


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


class WorkerRNG(Dataset):
    """A map-style dataset whose state is the RNG streams of the worker process that reads it.

    torchdata asks a worker's dataset for its state after each batch and gives it back to the restarted worker
    after seeding it, so augmentation drawn from torch, NumPy or Python `random` inside `__getitem__` continues
    where the interrupted run was. A dataset that has its own state keeps it (under "dataset").
    """

    def __init__(self, dataset: Any):
        self.dataset = dataset
        if callable(getattr(dataset, "__getitems__", None)):
            self.__getitems__ = dataset.__getitems__  # torch's fetcher reads whole batches through it

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def state_dict(self) -> dict[str, Any]:
        """This worker's Python, NumPy and torch CPU RNG states (CUDA is never used in a forked worker)."""
        state: dict[str, Any] = {"rng": capture_rng(cuda=False)}
        if isinstance(self.dataset, Stateful):
            state["dataset"] = self.dataset.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state["rng"])
        if "dataset" in state:
            self.dataset.load_state_dict(state["dataset"])


def _num_workers(dataset: Any, args: tuple, kwargs: dict[str, Any]) -> int:
    bound = inspect.signature(StatefulDataLoader.__init__).bind(None, dataset, *args, **kwargs)
    return int(bound.arguments.get("num_workers", 0) or 0)


class ResumableLoader(StatefulDataLoader):
    """A StatefulDataLoader whose state_dict() resumes mid-epoch and across epoch boundaries bit-exactly.

    It always owns a seeded generator (`seed`, or the one passed), so iterating never draws from torch's
    global RNG. StatefulDataLoader alone restores the sampler's generator to the start of the epoch plus
    the permutation draw, which misses the per-epoch base-seed draw; the next epoch would then shuffle
    differently from a run that never stopped. The generator's exact state is saved here and set last.

    With `world_size` > 1 (DDP) it reads only its rank's shard (see `shard`) and seeds its generator with
    `rank_seed(seed, rank, world_size)`, so each rank shuffles its own data reproducibly.

    With worker processes the dataset is wrapped in `WorkerRNG`, so each worker's RNG streams are part of
    the state and random augmentation inside `__getitem__` resumes exactly too.
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
        if _num_workers(dataset, args, kwargs) > 0:
            if isinstance(dataset, IterableDataset) and not isinstance(dataset, Stateful):
                raise LoaderError(
                    "ResumableLoader(num_workers>0): an IterableDataset's workers cannot be resumed exactly "
                    "unless it has state_dict()/load_state_dict() (holding its workers' RNG streams too); "
                    "give it those, use num_workers=0, or a map-style dataset"
                )
            if not isinstance(dataset, IterableDataset):
                dataset = WorkerRNG(dataset)
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
        return skip_batches(self, self, n)


def skip_batches(part: Any, loader: Any, n: int) -> int:
    """Advance `part` (the registered state of `loader`) by `n` batches of `loader`; the epoch ends crossed."""
    if type(n) is not int or n < 0:
        raise ValueError(f"skip_batches(): n: expected an integer >= 0, got {n!r}")
    if n == 0:
        return 0
    crossed, done, empty_epochs = 0, 0, 0
    part.load_state_dict(part.state_dict())
    it = iter(loader)
    while done < n:
        try:
            next(it)
        except StopIteration:
            crossed += 1
            empty_epochs += 1
            if empty_epochs > 1:
                raise ValueError("skip_batches(): the loader yields no batches") from None
            it = iter(loader)
            continue
        done += 1
        empty_epochs = 0
    part.batches_skipped += done
    part.load_state_dict(part.state_dict())
    return crossed


class StatefulLoaderState:
    """The registered state of a plain StatefulDataLoader: its own state plus what it misses for an exact resume.

    Its own state puts the sampler's generator back at the start of the epoch plus the permutation draw,
    which misses the per-epoch base-seed draw, and a resumed iterator draws again (from the generator, or
    from torch's global RNG when it has none). Here the generator's exact state is saved and set last, and
    the resumed iterator is built while loading, so a global-RNG draw happens before the RNG is restored.
    """

    def __init__(self, loader: StatefulDataLoader):
        self.loader = loader
        self.batches_skipped = 0

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"loader": self.loader.state_dict(), "batches_skipped": self.batches_skipped}
        if self.loader.generator is not None:
            state["generator"] = self.loader.generator.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "loader" not in state:  # a checkpoint written before this wrapper: the loader's own state alone
            log.warning(
                "the checkpoint holds no generator state for the data loader; its next epoch may differ"
            )
            state = {"loader": state}
        self.loader.load_state_dict(state["loader"])
        self.loader.state_dict()  # builds the resumed iterator now, spending its draws before the states below
        if "generator" in state and self.loader.generator is not None:
            self.loader.generator.set_state(state["generator"].to(dtype=torch.uint8, device="cpu"))
        self.batches_skipped = int(state.get("batches_skipped", 0))

    def skip_batches(self, n: int) -> int:
        """Advance the position by `n` batches without yielding them (see ResumableLoader.skip_batches)."""
        return skip_batches(self, self.loader, n)


def loader_part(name: str, loader: DataLoader) -> Any:
    """What a TrainingState keeps for the torch DataLoader registered as `name`, or a LoaderError saying why not."""
    if isinstance(loader, ResumableLoader):
        return loader
    if not isinstance(loader, StatefulDataLoader):
        if callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        ):
            return loader  # a DataLoader subclass that saves its own position: exactly what its state holds
        shuffled = isinstance(loader.sampler, RandomSampler)
        raise LoaderError(
            f"register({name!r}): a plain torch DataLoader{' with shuffle=True' if shuffled else ''} has no data "
            "position to checkpoint, so a resume would replay its epoch from the start"
            f"{' in another order' if shuffled else ''}; build it as supervisor.data.ResumableLoader(dataset, "
            "batch_size=..., shuffle=..., seed=...), which resumes at the exact batch"
        )
    if loader.num_workers > 0 and not isinstance(loader.dataset, Stateful):
        raise LoaderError(
            f"register({name!r}): a StatefulDataLoader with num_workers={loader.num_workers} does not save its "
            "worker processes' RNG streams, so random augmentation in the dataset would differ after a resume; "
            "build it as supervisor.data.ResumableLoader(dataset, num_workers=..., ...), which saves them, or "
            "pass supervisor.data.WorkerRNG(dataset), or a dataset with its own state_dict()/load_state_dict()"
        )
    return StatefulLoaderState(loader)
