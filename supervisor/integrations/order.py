"""A plain torch `DataLoader`'s order made resumable: each epoch's shuffle replayed from the RNG state it drew from.

A plain `DataLoader(shuffle=True)` draws each epoch's permutation when that epoch's iterator starts (from its
sampler's generator, or from torch's global RNG when it has none), and has no position to save. `PlainOrder`
puts a batch sampler of its own between the loader and the loader's own (`object.__setattr__`, past
`DataLoader.__setattr__`'s guard; put back by `uninstall()`), which notes the RNG state each epoch's order is
drawn from and hands out exactly what the loader's own sampler would: a run that never resumed sees the batches
it would see without the supervisor, and the global RNG streams see the same draws. A checkpoint holds that
state, how many batches of the epoch the loop has fetched, and the loader's generators; a resume draws the same
order again from the saved state (the global RNG left as it was) and goes on after the fetched batches.

Supported samplers, by exact type: torch's `SequentialSampler`, `RandomSampler`, `SubsetRandomSampler` and
`WeightedRandomSampler` (each draws its whole order from `generator` or the global RNG when its epoch starts,
or from `generator` as it goes), and any sampler with `set_epoch(epoch)` whose order depends on the epoch alone
(`DistributedSampler`). Others, a custom batch sampler, an `IterableDataset` and `in_order=False` with worker
processes are refused (`LoaderError`). Not exact: random draws inside the dataset's `__getitem__` in worker
processes (`num_workers > 0`), whose RNG streams are not the loader's; `supervisor.data.ResumableLoader` saves
those.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from supervisor.data import LoaderError
from supervisor.errors import CheckpointError, UserError

log = logging.getLogger("rollback_supervisor.data")

#: Samplers whose whole order comes from `generator` (or the global torch RNG without one), by exact type.
DRAWING_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)


class DataPositionMismatch(CheckpointError, UserError):
    """The checkpoint's data position was written for another loader than this one."""


def is_plain(loader: Any) -> bool:
    """A torch DataLoader with no position of its own (neither a StatefulDataLoader nor one with state_dict())."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    return (
        isinstance(loader, DataLoader)
        and not isinstance(loader, StatefulDataLoader)
        and not (
            callable(getattr(loader, "state_dict", None))
            and callable(getattr(loader, "load_state_dict", None))
        )
    )


def check_plain(loader: DataLoader) -> None:
    """Refuse a plain loader whose order a resume cannot reproduce (LoaderError saying what to use)."""
    if isinstance(loader.dataset, IterableDataset):
        raise LoaderError(
            f"the train loader reads an IterableDataset ({type(loader.dataset).__name__}), which has no sampler "
            "whose order a resume could replay; return a torchdata StatefulDataLoader over a dataset with "
            "state_dict()/load_state_dict(), or use a map-style dataset"
        )
    batched = loader.batch_sampler is not None
    if batched and type(loader.batch_sampler) is not BatchSampler:
        raise LoaderError(
            f"the train loader's batch_sampler is {type(loader.batch_sampler).__name__}, whose order a resume "
            "cannot reproduce; pass batch_size= and a sampler= (or shuffle=) instead, or return a torchdata "
            "StatefulDataLoader, whose state holds its position"
        )
    sampler = loader.batch_sampler.sampler if batched else loader.sampler
    if not (
        type(sampler) is SequentialSampler
        or type(sampler) in DRAWING_SAMPLERS
        or callable(getattr(sampler, "set_epoch", None))
    ):
        raise LoaderError(
            f"the train loader's sampler is {type(sampler).__name__}, whose order a resume cannot reproduce: "
            "the callback replays the RNG state torch's own samplers draw from (SequentialSampler, RandomSampler, "
            "SubsetRandomSampler, WeightedRandomSampler; shuffle=True gives RandomSampler) and calls "
            "set_epoch(epoch) on a sampler whose order depends on its epoch alone; use one of those, or return a "
            "torchdata StatefulDataLoader, whose state holds its position"
        )
    if loader.num_workers > 0 and not getattr(loader, "in_order", True):
        raise LoaderError(
            f"the train loader has num_workers={loader.num_workers} and in_order=False: its batches come in the "
            "order the workers finish them, which no resume can reproduce; leave in_order=True"
        )


class _Resume:
    """Where the next iteration of the order starts: an epoch's order replayed, or a new one drawn."""

    def __init__(self, epoch: int, skip: int, *, start: torch.Tensor | None = None, new: bool = False):
        self.epoch, self.skip, self.start, self.new = epoch, skip, start, new


class _ReplayingSampler:
    """The batch sampler put in the loader's place: the loader's own order, noted, or replayed from a `_Resume`."""

    def __init__(self, inner: Any, sampler: Any, epoch_now: Callable[[], int]):
        self.inner, self.sampler = inner, sampler
        self.epoch_now = epoch_now
        self.resume: _Resume | None = None
        self.start: torch.Tensor | None = None  # the RNG state this epoch's order was drawn from
        self.epoch = 0
        # An iteration began since the last resume was set: the loop's counters are the position.
        self.live = False

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        """Pass the epoch on to a `set_epoch` sampler (Lightning finds this where it is `loader.sampler`)."""
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        resume, self.resume = self.resume, None
        self.live = True
        if resume is None:  # a new epoch, as the loader itself starts one
            self.epoch, self.start = self.epoch_now(), self._source_state()
            yield from self.inner
            return
        self.epoch = resume.epoch
        self.set_epoch(resume.epoch)  # a replay may go back across an epoch's end: the sampler's epoch too
        if resume.new:  # a new order, drawn now from where the RNG streams are
            self.start = self._source_state()
            yield from itertools.islice(self.inner, resume.skip, None)
            return
        self.start = resume.start
        yield from itertools.islice(self._replayed(resume.start), resume.skip, None)

    def _replayed(self, start: torch.Tensor | None) -> Iterator[Any]:
        """This epoch's order drawn again from `start` (a drawing sampler draws at its first batch)."""
        it = iter(self.inner)
        if start is None:
            yield from it
            return
        generator = getattr(self.sampler, "generator", None)
        if generator is not None:
            generator.set_state(start)  # it goes on from there as it did: later draws come from it too
            yield from it
            return
        kept = torch.get_rng_state()
        torch.set_rng_state(start)
        try:
            first = next(it, None)
        finally:
            torch.set_rng_state(kept)  # the global stream is the checkpoint's, not the replay's
        if first is not None:
            yield first
            yield from it

    def _source_state(self) -> torch.Tensor | None:
        if type(self.sampler) not in DRAWING_SAMPLERS:
            return None
        generator = getattr(self.sampler, "generator", None)
        return generator.get_state() if generator is not None else torch.get_rng_state()


class PlainOrder:
    """The registered data position of a plain DataLoader (see the module docstring).

    `fetched()` is how many batches of the current epoch the training loop has fetched (a skip counted as
    fetched); `epoch_now()` the loop's epoch, which a `set_epoch` sampler is given.
    """

    def __init__(self, loader: DataLoader, fetched: Callable[[], int], epoch_now: Callable[[], int]):
        check_plain(loader)
        self.loader = loader
        self.per_epoch = len(loader)
        self._fetched = fetched
        self._batched = loader.batch_sampler is not None
        inner = loader.batch_sampler if self._batched else loader.sampler
        sampler = inner.sampler if self._batched else inner
        self._inner = inner
        self.order = _ReplayingSampler(inner, sampler, epoch_now)
        self._loaded: dict[str, Any] | None = None
        self._generators: dict[str, torch.Tensor] = {}  # set once the loop's iterator is rebuilt
        self.batches_skipped = 0

    @property
    def sampler_name(self) -> str:
        return type(self.order.sampler).__name__

    def install(self) -> None:
        """Put the replaying sampler in the loader's place."""
        object.__setattr__(self.loader, "batch_sampler" if self._batched else "sampler", self.order)

    def uninstall(self) -> None:
        """Give the loader its own sampler back."""
        object.__setattr__(self.loader, "batch_sampler" if self._batched else "sampler", self._inner)

    @property
    def replaying(self) -> bool:
        """Whether the next iteration replays an epoch's order already drawn (else it draws a new one)."""
        resume = self.order.resume
        return resume is not None and not resume.new

    def _own_generators(self) -> dict[str, torch.Generator]:
        out = {}
        if self.loader.generator is not None:
            out["generator"] = self.loader.generator
        own = getattr(self.order.sampler, "generator", None)
        if isinstance(own, torch.Generator) and own is not self.loader.generator:
            out["sampler_generator"] = own
        return out

    def state_dict(self) -> dict[str, Any]:
        if not self.order.live:
            if self._loaded is not None:  # nothing fetched since the restore: the restored position
                return {**self._loaded, "batches_skipped": self.batches_skipped}
            return self._undrawn()
        state: dict[str, Any] = {
            "batches": int(self._fetched()),
            "batches_per_epoch": self.per_epoch,
            "epoch": int(self.order.epoch),
            "sampler": self.sampler_name,
            "order_drawn": True,
            "batches_skipped": self.batches_skipped,
        }
        if self.order.start is not None:
            state["order_rng"] = self.order.start.clone()
        for key, generator in self._own_generators().items():
            state[key] = generator.get_state()
        return state

    def _undrawn(self) -> dict[str, Any]:
        """The position before the first epoch's order was drawn."""
        return {
            "batches": 0,
            "batches_per_epoch": self.per_epoch,
            "epoch": int(self.order.epoch_now()),
            "sampler": self.sampler_name,
            "order_drawn": False,
            "batches_skipped": self.batches_skipped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batches_per_epoch" not in state or "sampler" not in state:
            raise DataPositionMismatch(
                f"data: the checkpoint's data position has keys {sorted(state)}, written for another kind of "
                "loader than this plain DataLoader (a StatefulDataLoader's?); resume with the train loader it was "
                "written with"
            )
        saved = int(state["batches_per_epoch"])
        if saved != self.per_epoch:
            raise DataPositionMismatch(
                f"data.batches_per_epoch: the checkpoint was written with {saved} batches per epoch, this train "
                f"loader has {self.per_epoch}; resume with the dataset, batch_size and drop_last it was written with"
            )
        if state["sampler"] != self.sampler_name:
            raise DataPositionMismatch(
                f"data.sampler: the checkpoint's order was drawn by {state['sampler']}, this train loader's sampler "
                f"is {self.sampler_name}; resume with the sampler (shuffle=) it was written with"
            )
        self._loaded = {k: v for k, v in state.items() if k != "batches_skipped"}
        self.batches_skipped = int(state.get("batches_skipped", 0))
        self._generators = {k: state[k] for k in ("generator", "sampler_generator") if k in state}
        batches, epoch = int(state["batches"]), int(state["epoch"])
        if (
            batches >= self.per_epoch
        ):  # at an epoch's end: the next epoch's order is drawn as the loader would
            resume = _Resume(epoch + 1, 0, new=True)
        elif not state.get("order_drawn", True):
            resume = _Resume(epoch, batches, new=True)
        else:
            start = state.get("order_rng")
            resume = _Resume(epoch, batches, start=None if start is None else start.to(torch.uint8).cpu())
        self.order.resume, self.order.live = resume, False

    def skip_batches(self, n: int) -> int:
        """Move the position `n` batches on (a plan's skip); the epoch ends crossed (a new order is drawn)."""
        state = self.state_dict()
        position = int(state["batches"]) + n
        crossed = position // self.per_epoch
        if crossed:
            state = {k: v for k, v in state.items() if k != "order_rng"}
            state.update(
                batches=position % self.per_epoch, epoch=int(state["epoch"]) + crossed, order_drawn=False
            )
        else:
            state["batches"] = position
        skipped = self.batches_skipped + n
        self.load_state_dict(state)
        self.batches_skipped = skipped
        return crossed

    def reopen(self, open_iterator: Callable[[bool], None], *, draw: bool) -> None:
        """Rebuild the loop's iterator over the loader through `open_iterator(kept)`, from the loaded position.

        A replay spends no draw of the global RNG streams (`kept`), and the loader's generators are set to the
        checkpoint's after it; with `draw`, a new epoch's iterator is opened as the loader would open it, from
        the checkpoint's generators and the (restored) global streams.
        """
        if draw and not self.replaying:
            self._set_generators()
            open_iterator(False)
            return
        open_iterator(True)
        self._set_generators()

    def _set_generators(self) -> None:
        for key, generator in self._own_generators().items():
            if key in self._generators:
                generator.set_state(self._generators[key].to(torch.uint8).cpu())


@contextmanager
def deferred_iterators() -> Iterator[None]:
    """While inside, iterating a plain DataLoader opens nothing and draws nothing (Lightning's early set-up).

    Its first epoch's iterator is opened later, where the loop would open it, so the RNG streams see the draws
    (the worker base seed, a shuffle) in the same order as without the supervisor.
    """
    original = DataLoader.__iter__

    def deferred(self: DataLoader) -> Iterator[Any]:
        return iter(()) if is_plain(self) else original(self)

    DataLoader.__iter__ = deferred  # type: ignore[method-assign]
    try:
        yield
    finally:
        DataLoader.__iter__ = original  # type: ignore[method-assign]
