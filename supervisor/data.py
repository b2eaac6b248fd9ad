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
import itertools
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
    """Where one rank is in its current epoch: the dataset indices it reads this epoch, in order, how many of
    them it has read, and how many it reads in all (`stop`; None: all of them, else drop_last drops the rest).
    `begun` is False between epochs (nothing of the next one drawn yet)."""

    order: tuple[int, ...]
    seen: int
    stop: int | None = None
    begun: bool = True

    @property
    def end(self) -> int:
        return len(self.order) if self.stop is None else self.stop

    @property
    def unseen(self) -> tuple[int, ...]:
        """What this rank would still have read this epoch."""
        return self.order[self.seen : self.end]

    @property
    def dropped(self) -> tuple[int, ...]:
        """What its epoch end drops (drop_last) and it has not read: never going to be read this epoch."""
        return self.order[max(self.seen, self.end) :]


_BETWEEN_EPOCHS = EpochPosition((), 0, begun=False)


def epoch_position(
    state: Mapping[str, Any], rank: int, world_size: int, length: int, *, batch_size: int, drop_last: bool
) -> EpochPosition:
    """The position a `ResumableLoader.state_dict()` of rank `rank` of `world_size` over a dataset of `length`,
    read in batches of `batch_size` (with `drop_last`), describes (pure: the epoch's order is rebuilt from the
    sampler's saved generator state, as torchdata does).

    A loader between epochs (its epoch ended, or nothing of the next one drawn) has nothing unseen: its next
    epoch is drawn afresh wherever it is read. With worker processes the position is the last snapshot's plus
    the batches read since (`snapshot_every_n_steps` > 1), each a full batch but the epoch's last."""
    remainder = state.get("remainder")
    if remainder is not None:  # itself in a re-split epoch: it reads all of its share, drop_last or not
        return EpochPosition(tuple(int(i) for i in remainder["indices"].tolist()), int(remainder["seen"]))
    inner = state["loader"]
    workers = "_snapshot" in inner
    main = inner["_snapshot"]["_main_snapshot"] if workers else inner
    since = int(inner.get("_steps_since_snapshot", 0)) if workers else 0
    it = main.get("_sampler_iter_state")
    if it is None or inner.get("_iterator_finished") or int(it["samples_yielded"]) + since == 0:
        return _BETWEEN_EPOCHS
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
    drawn = int(it["samples_yielded"])  # at the last snapshot, with worker processes
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    batches = -(-stop // batch_size)  # in the whole epoch
    if (
        not 0 <= drawn <= len(order)
        or (drawn % batch_size and drawn != len(order))
        or (drawn + since * batch_size > batches * batch_size)
    ):
        raise LoaderError(
            f"rank {rank}'s data loader state: samples_yielded={drawn}"
            + (f" plus {since} batches read since the last snapshot" if since else "")
            + f" is not a whole number of batches of {batch_size} within its epoch of {batches} batches over "
            f"{len(order)} samples (rank {rank} of {world_size} over {length}); restore it with the dataset, "
            "batch_size and drop_last that saved it"
        )
    return EpochPosition(order, min(drawn + since * batch_size, stop), stop if drop_last else None)


def interleave(positions: Sequence[EpochPosition]) -> list[int]:
    """What the old ranks (`positions`, by old rank) had not read of the epoch, in one fixed order: old rank
    0's first unseen, rank 1's first, ..., rank 0's second, ... (pure)."""
    unseen = [p.unseen for p in positions]
    depth = max((len(u) for u in unseen), default=0)
    return [u[i] for i in range(depth) for u in unseen if i < len(u)]


def even_cut(n: int, parts: int) -> list[int]:
    """`n` items cut into `parts` sizes as even as possible, the larger first (pure)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)] if parts else []


@dataclass(frozen=True)
class Resplit:
    """One new rank's part of a re-split epoch (see `resplit`)."""

    batches: tuple[tuple[int, ...], ...]
    """This rank's batches of the re-split epoch, in order; every new rank has the same number of them."""
    in_epoch: bool
    """Whether the old ranks were inside an epoch: then every new rank has a re-split epoch (maybe empty)."""
    unread: int
    """R: the samples the old ranks had not read and would have (drop_last's dropped ones excluded)."""
    per_rank: int
    """q = R // W': every rank's share is q or q + 1 samples."""
    skipped: tuple[int, ...]
    """q == 0 only: the R unread samples, which no rank reads (fewer than the new ranks)."""
    dropped: tuple[int, ...]
    """drop_last only: what the old ranks' epoch ends would have dropped (never read at any world size)."""

    @property
    def share(self) -> list[int]:
        return [i for b in self.batches for i in b]


def resplit(positions: Sequence[EpochPosition], rank: int, world_size: int, batch_size: int) -> Resplit:
    """Rank `rank` of `world_size`'s part of what the old ranks (`positions`, by old rank) had not yet read
    this epoch, in batches of about `batch_size` (pure).

    The R unseen samples are `interleave`d and rank `rank` takes every `world_size`-th from its own offset:
    q = R // W' or q + 1 of them (the first R mod W' ranks get one more). Every rank reads the same number of
    batches, nb = ceil(q / batch_size), so all end the epoch at the same step (FSDP's collectives and later
    checkpoints need that): its share is cut into nb batches as evenly as possible, the larger first, so a
    batch may hold batch_size + 1 samples (when batch_size divides q) and none is empty. No unseen sample is
    skipped or read twice, except when q == 0 (R < W'): no rank can read a batch then without the others
    reading one of nothing, so the R samples are skipped (`skipped`) and the re-split epoch is empty on every
    rank. What drop_last would have dropped at the old ranks' epoch ends is in `dropped`, never read.
    """
    if type(world_size) is not int or world_size < 1 or type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(
            f"resplit(): expected 0 <= rank < world_size, got rank={rank!r}, world_size={world_size!r}"
        )
    if type(batch_size) is not int or batch_size < 1:
        raise ValueError(f"resplit(): batch_size: expected an integer >= 1, got {batch_size!r}")
    interleaved = interleave(positions)
    unread, per_rank = len(interleaved), len(interleaved) // world_size
    dropped = tuple(i for p in positions for i in p.dropped)
    in_epoch = any(p.begun for p in positions)
    if per_rank == 0:
        return Resplit((), in_epoch, unread, 0, tuple(interleaved), dropped)
    share = interleaved[rank::world_size]
    batches, start = [], 0
    for size in even_cut(len(share), -(-per_rank // batch_size)):
        batches.append(tuple(share[start : start + size]))
        start += size
    return Resplit(tuple(batches), in_epoch, unread, per_rank, (), dropped)


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
        #: A re-split epoch (after a restore at another world size): its dataset indices, its batch sizes and
        #: how many samples were read.
        self._remainder: list[int] | None = None
        self._remainder_sizes: list[int] = []
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
            state["remainder"] = {
                "indices": torch.tensor(self._remainder, dtype=torch.int64),
                "sizes": torch.tensor(self._remainder_sizes, dtype=torch.int64),
                "seen": self._remainder_seen,
            }
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
        self._remainder, self._remainder_sizes, self._remainder_seen = None, [], 0
        if remainder is not None:
            self._remainder = [int(i) for i in remainder["indices"].tolist()]
            self._remainder_seen = int(remainder["seen"])
            if "sizes" in remainder:
                self._remainder_sizes = [int(n) for n in remainder["sizes"].tolist()]
            else:  # saved before equal batch counts: full batches, the last one short
                size, n = self.batch_size or 1, len(self._remainder)
                self._remainder_sizes = [size] * (n // size) + ([n % size] if n % size else [])
            ends = {0, *itertools.accumulate(self._remainder_sizes)}
            if sum(self._remainder_sizes) != len(self._remainder) or self._remainder_seen not in ends:
                raise LoaderError(
                    f"ResumableLoader: the saved re-split epoch is inconsistent: {len(self._remainder)} indices, "
                    f"batch sizes {self._remainder_sizes}, {self._remainder_seen} read (not a batch boundary); "
                    "the checkpoint's rank state was altered"
                )

    def __iter__(self) -> Iterator[Any]:
        if self._remainder is not None:
            return self._iter_remainder()
        return super().__iter__()

    def _iter_remainder(self) -> Iterator[Any]:
        """The re-split epoch: this rank's share, in order, in its planned batches (read in this process)."""
        assert self._remainder is not None
        start = 0
        for size in self._remainder_sizes:
            if start >= self._remainder_seen:
                chunk = self._remainder[start : start + size]
                getitems = getattr(self._source, "__getitems__", None)
                samples = getitems(chunk) if callable(getitems) else [self._source[i] for i in chunk]
                self._remainder_seen = start + size
                yield self.collate_fn(samples)
            start += size
        self._remainder, self._remainder_sizes, self._remainder_seen = None, [], 0  # next: an ordinary epoch

    def resume_resplit(self, saved: Sequence[Mapping[str, Any]], saved_world_size: int, seed: int) -> Resplit:
        """Continue, at this loader's world size, the epoch the `saved` states (by old rank) were in.

        This rank reads its `resplit` batches of what they had not read (every rank the same number of
        batches, one of which may hold batch_size + 1 samples; none at all when there are fewer unread samples
        than ranks: those are skipped), then ordinary epochs of its own shard with its generator seeded from
        `seed`. With drop_last, what the old ranks' epoch ends would have dropped stays dropped. Returns the
        `Resplit` (the caller logs it). An epoch this loader had begun itself is dropped. The loader must be
        built with the batch_size and drop_last that saved `saved`.
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
            positions.append(
                epoch_position(
                    state,
                    old_rank,
                    saved_world_size,
                    length,
                    batch_size=self.batch_size,
                    drop_last=self.drop_last,
                )
            )
        plan = resplit(positions, rank, world_size, self.batch_size)
        # Inside an epoch every rank has a re-split one, even an empty one: its first iter() then ends at once,
        # so every rank's loop counts the same epoch end at the same step.
        self._remainder = plan.share if plan.in_epoch else None
        self._remainder_sizes, self._remainder_seen = [len(b) for b in plan.batches], 0
        super().load_state_dict({})  # drop any iterator built before: the next ordinary epoch is drawn afresh
        self.generator.manual_seed(seed)
        return plan

    def _check_resplittable(self) -> None:
        why = None
        if isinstance(self._source, IterableDataset):
            why = "its dataset is an IterableDataset (no index to share out)"
        elif self.batch_sampler is not None and type(self.batch_sampler) not in _BATCH_SAMPLERS:
            why = f"it has a custom batch_sampler ({type(self.batch_sampler).__qualname__})"
        elif self.batch_size is None:
            why = (
                "it has batch_size=None (no batches to count; give it batch_size=1 to read one sample a step)"
            )
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
