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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, SequentialSampler, Subset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler as StatefulBatchSampler
from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

from supervisor.errors import UserError
from supervisor.rng import capture_rng, rank_seed, restore_rng
from supervisor.stateful import Stateful

log = logging.getLogger("rollback_supervisor.checkpoint")


class LoaderError(UserError, ValueError):
    """A data loader whose position cannot be resumed exactly."""


#: The batch samplers a re-split epoch can stand in for (fixed batch_size over the loader's sampler).
_BATCH_SAMPLERS = (torch.utils.data.BatchSampler, StatefulBatchSampler)


def shard(dataset: Any, rank: int, world_size: int) -> Any:
    """Rank `rank`'s strided share of `dataset`; every rank gets the same length (the remainder is dropped)."""
    if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(
            f"shard(): expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
        )
    if world_size == 1:
        return dataset
    return Subset(dataset, shard_indices(len(dataset), rank, world_size))


def shard_indices(length: int, rank: int, world_size: int) -> range:
    """The dataset indices of rank `rank`'s strided share (what `shard` keeps), in order."""
    return range(rank, length - length % world_size, world_size)


@dataclass(frozen=True)
class EpochPosition:
    """Where one rank is in its current epoch: the dataset indices it reads this epoch, in order, and how many
    of them it has read."""

    order: tuple[int, ...]
    seen: int

    @property
    def unseen(self) -> tuple[int, ...]:
        return self.order[self.seen :]


def epoch_position(state: Mapping[str, Any], rank: int, world_size: int, length: int) -> EpochPosition:
    """The position a `ResumableLoader.state_dict()` of rank `rank` of `world_size` over a dataset of `length`
    describes (pure: the epoch's order is rebuilt from the sampler's saved generator state, as torchdata does).

    A loader between epochs (its epoch finished, or nothing of it read yet) has nothing unseen: its next epoch
    is drawn afresh wherever it is read."""
    remainder = state.get("remainder")
    if remainder is not None:  # itself in a re-split epoch
        return EpochPosition(tuple(int(i) for i in remainder["indices"].tolist()), int(remainder["seen"]))
    inner = state["loader"]
    main = inner["_snapshot"]["_main_snapshot"] if "_snapshot" in inner else inner  # worker processes or not
    it = main.get("_sampler_iter_state")
    if it is None or (not inner.get("_iterator_finished") and int(it["samples_yielded"]) == 0):
        return EpochPosition((), 0)
    base = shard_indices(length, rank, world_size)
    sampler_it = it.get("sampler_iter_state")
    if sampler_it is None:  # SequentialSampler: no state of its own
        order = tuple(base)
    elif set(sampler_it) == {"yielded", "generator"}:  # torchdata's RandomSampler, without replacement
        generator = torch.Generator()
        generator.set_state(sampler_it["generator"].to(dtype=torch.uint8, device="cpu"))
        order = tuple(base[p] for p in torch.randperm(len(base), generator=generator).tolist())
    else:
        raise LoaderError(
            f"rank {rank}'s data loader state has a sampler this version cannot re-split "
            f"(sampler state keys: {sorted(sampler_it)}; expected shuffle=True or shuffle=False)"
        )
    seen = len(order) if inner.get("_iterator_finished") else int(it["samples_yielded"])
    if not 0 <= seen <= len(order):
        raise LoaderError(
            f"rank {rank}'s data loader state: samples_yielded={seen} does not fit its shard of {len(order)} "
            f"samples (rank {rank} of {world_size} over {length}); was the dataset the same size?"
        )
    return EpochPosition(order, seen)


def resplit(positions: Sequence[EpochPosition], rank: int, world_size: int) -> list[int]:
    """Rank `rank` of `world_size`'s share of what the old ranks (`positions`, by old rank) had not yet read
    this epoch (pure).

    The unseen remainders are interleaved in a fixed order (old rank 0's first unseen, rank 1's first, ...,
    rank 0's second, ...) and rank `rank` takes every `world_size`-th from its own offset. Every unseen sample
    goes to exactly one new rank; the first `R mod world_size` ranks get one more than the others.
    """
    if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(
            f"resplit(): expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
        )
    unseen = [p.unseen for p in positions]
    depth = max((len(u) for u in unseen), default=0)
    interleaved = [u[i] for i in range(depth) for u in unseen if i < len(u)]
    return interleaved[rank::world_size]


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
        self._source, self._split = dataset, (rank, world_size)
        #: The dataset indices of a re-split epoch (after a restore at another world size) and how many were read.
        self._remainder: list[int] | None = None
        self._remainder_seen = 0
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
        rank, world_size = self._split
        state: dict[str, Any] = {
            "loader": inner,
            "generator": self.generator.get_state(),
            "batches_skipped": self.batches_skipped,
            "split": {"rank": rank, "world_size": world_size},
        }
        if not isinstance(self._source, IterableDataset):
            state["split"]["length"] = len(self._source)
        if self._remainder is not None:
            indices = torch.tensor(self._remainder, dtype=torch.int64)
            state["remainder"] = {"indices": indices, "seen": self._remainder_seen}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume at the saved position; the next iter() yields exactly the batches an unbroken run would."""
        super().load_state_dict(state_dict["loader"])
        # Building the resumed iterator now (state_dict() does, and iter() reuses it) spends its generator
        # draws before the saved generator state is put back.
        super().state_dict()
        self.generator.set_state(state_dict["generator"].to(dtype=torch.uint8, device="cpu"))
        self.batches_skipped = int(state_dict.get("batches_skipped", 0))
        remainder = state_dict.get("remainder")
        self._remainder = None if remainder is None else [int(i) for i in remainder["indices"].tolist()]
        self._remainder_seen = 0 if remainder is None else int(remainder["seen"])

    def __iter__(self) -> Iterator[Any]:
        if self._remainder is not None:
            return self._iter_remainder()
        return super().__iter__()

    def _iter_remainder(self) -> Iterator[Any]:
        """The re-split epoch: this rank's share, in order, batch by batch (read in this process)."""
        assert self._remainder is not None
        size = self.batch_size or 1
        while self._remainder_seen < len(self._remainder):
            chunk = self._remainder[self._remainder_seen : self._remainder_seen + size]
            getitems = getattr(self._source, "__getitems__", None)
            samples = getitems(chunk) if callable(getitems) else [self._source[i] for i in chunk]
            self._remainder_seen += len(chunk)
            yield self.collate_fn(samples)
        self._remainder, self._remainder_seen = None, 0  # the next epoch is an ordinary one

    def resume_resplit(
        self, saved: Sequence[Mapping[str, Any]], saved_world_size: int, seed: int
    ) -> tuple[list[int], int]:
        """Continue, at this loader's world size, the epoch the `saved` states (by old rank) were in.

        This rank reads its `resplit` share of what they had not read, then ordinary epochs of its own shard
        with its generator seeded from `seed`. Returns (its share, the unseen total R). An epoch this loader
        had begun itself is dropped.
        """
        rank, world_size = self._split
        self._check_resplittable()
        length = len(self._source)
        positions = []
        for old_rank, state in enumerate(saved):
            split = state.get("split")
            if split is not None and "length" in split and int(split["length"]) != length:
                raise LoaderError(
                    f"the checkpoint's data loader of rank {old_rank} read a dataset of {split['length']} "
                    f"samples, this one has {length}; restore it with the same dataset"
                )
            positions.append(epoch_position(state, old_rank, saved_world_size, length))
        share = resplit(positions, rank, world_size)
        self._remainder, self._remainder_seen = (share or None), 0
        super().load_state_dict({})  # drop any iterator built before: the next ordinary epoch is drawn afresh
        self.generator.manual_seed(seed)
        return share, sum(len(p.unseen) for p in positions)

    def _check_resplittable(self) -> None:
        why = None
        if isinstance(self._source, IterableDataset):
            why = "its dataset is an IterableDataset (no index to share out)"
        elif self.batch_sampler is not None and type(self.batch_sampler) not in _BATCH_SAMPLERS:
            why = f"it has a custom batch_sampler ({type(self.batch_sampler).__qualname__})"
        elif not isinstance(self.sampler, SequentialSampler | StatefulRandomSampler) or (
            isinstance(self.sampler, StatefulRandomSampler)
            and (self.sampler.replacement or self.sampler._num_samples is not None)
        ):
            why = f"its sampler ({type(self.sampler).__qualname__}) is not shuffle=True or shuffle=False"
        if why is not None:
            raise LoaderError(
                f"ResumableLoader: cannot re-split the data position at another world size: {why}; restore "
                "at the world size that saved the checkpoint, or use shuffle=True/False over a map-style dataset"
            )

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
