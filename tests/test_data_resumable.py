"""Exact data position: ResumableLoader (workers' RNG included), a registered plain StatefulDataLoader, and the
refusal of loaders that cannot resume; identical batches after a resume at any position, across epochs."""

from __future__ import annotations

import copy
import random
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.data import LoaderError, ResumableLoader, StatefulLoaderState, WorkerRNG
from supervisor.errors import UserError
from supervisor.state import TrainingState

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata's own noise

DATA = torch.arange(23)
EPOCHS = 3


def make(**kw) -> ResumableLoader:
    return ResumableLoader(DATA, batch_size=4, shuffle=True, seed=7, **kw)


def epochs(loader, n: int = EPOCHS) -> list[list[int]]:
    return [b.tolist() for _ in range(n) for b in loader]


REFERENCE = epochs(make())


def take(loader, k: int) -> list[list[int]]:
    """Consume `k` batches the way a training loop does (one `for` per epoch, break mid-epoch)."""
    got: list[list[int]] = []
    while len(got) < k:
        for b in loader:
            got.append(b.tolist())
            if len(got) == k:
                break
    return got


@pytest.mark.parametrize("k", range(0, len(REFERENCE) + 1))
def test_resume_at_every_position_yields_the_same_batches(k):
    loader = make()
    seen = take(loader, k)
    saved = copy.deepcopy(loader.state_dict())
    global_rng = torch.get_rng_state()
    resumed = make()
    resumed.load_state_dict(saved)
    rest = [b.tolist() for _ in range(EPOCHS + 1) for b in resumed]
    assert (seen + rest)[: len(REFERENCE)] == REFERENCE
    assert torch.equal(torch.get_rng_state(), global_rng), (
        "the loader must never draw from torch's global RNG"
    )


def test_plain_stateful_dataloader_diverges_after_the_epoch_boundary():
    """Why ResumableLoader saves the generator itself: this is the behaviour it fixes."""

    def plain():
        return StatefulDataLoader(
            DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
        )

    reference = epochs(plain())
    loader = plain()
    seen = take(loader, 2)
    resumed = plain()
    resumed.load_state_dict(loader.state_dict())
    assert (seen + epochs(resumed))[: len(reference)] != reference


@pytest.mark.parametrize(
    "start,n,crossed", [(0, 3, 0), (2, 4, 0), (0, 6, 0), (0, 7, 1), (5, 13, 2), (1, 0, 0)]
)
def test_skip_batches_after_a_resume_advances_without_yielding(start, n, crossed):
    loader = make()
    seen = take(loader, start)
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(loader.state_dict()))
    assert resumed.skip_batches(n) == crossed
    assert resumed.batches_skipped == n
    rest = [b.tolist() for _ in range(EPOCHS + 1) for b in resumed]
    expected = [*REFERENCE[:start], *REFERENCE[start + n :]]
    assert (seen + rest)[: len(expected)] == expected


def test_skip_batches_on_a_fresh_loader_starts_from_the_first_batch():
    loader = make()
    loader.skip_batches(2)
    assert [b.tolist() for b in loader] == REFERENCE[2:6]


def test_skip_count_survives_a_resume():
    loader = make()
    loader.skip_batches(3)
    resumed = make()
    resumed.load_state_dict(copy.deepcopy(loader.state_dict()))
    assert resumed.batches_skipped == 3
    assert next(iter(resumed)).tolist() == REFERENCE[3]


@pytest.mark.parametrize("bad", [-1, 1.5, "2"])
def test_skip_batches_rejects_bad_counts(bad):
    with pytest.raises(ValueError, match="skip_batches"):
        make().skip_batches(bad)


@pytest.mark.slow
def test_resume_with_worker_processes():
    reference = epochs(make(num_workers=2))  # worker processes draw seeds differently: its own reference
    for k in (3, 6):
        loader = make(num_workers=2)
        seen = take(loader, k)
        resumed = make(num_workers=2)
        resumed.load_state_dict(copy.deepcopy(loader.state_dict()))
        rest = [b.tolist() for _ in range(EPOCHS + 1) for b in resumed]
        assert (seen + rest)[: len(reference)] == reference


class Augmented(Dataset):
    """Each sample carries one draw from torch, NumPy and Python `random`, made where the sample is read."""

    def __len__(self) -> int:
        return len(DATA)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), float(np.random.rand()), random.random()])


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _registered(make) -> tuple[TrainingState, object]:
    state = TrainingState()
    loader = make()
    state.register("data", loader)
    return state, loader


def _differences(make, k: int, total: int = 3 * 6) -> list[str]:
    """What differs (nothing when exact) between a run that never stopped and one resumed at batch `k`: the
    batches, and each of the process's RNG streams after them.

    The saved state goes through TrainingState (as a checkpoint does) into a fresh loader built after the
    process's RNG streams moved on, as in a new process. A stream that moved names the threads alive: one
    left running by an earlier test in this worker that draws from it would move it too.
    """
    _seed_everything(0)
    reference = take(_registered(make)[1], total)
    after = (torch.rand(2), np.random.rand(), random.random())
    _seed_everything(0)
    state, loader = _registered(make)
    seen = take(loader, k)
    saved = copy.deepcopy(state.state_dict())
    del loader
    _seed_everything(123)
    state, resumed = _registered(make)
    state.load_state_dict(saved)
    got = seen + take(resumed, total - k)
    again = (torch.rand(2), np.random.rand(), random.random())
    differences = [] if reference == got else [f"batches (first at {_first_difference(reference, got)})"]
    for name, a, b in zip(("torch", "numpy", "random"), after, again, strict=True):
        if not (torch.equal(a, b) if name == "torch" else a == b):
            threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
            differences.append(f"the {name} stream after them (threads alive: {threads})")
    return differences


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _inexact(make, ks) -> dict[int, list[str]]:
    """Resume positions that were not exact, with what differed."""
    return {k: d for k in ks if (d := _differences(make, k))}


def _augmented(**kw) -> ResumableLoader:
    return ResumableLoader(Augmented(), batch_size=4, shuffle=True, seed=7, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent-workers"])
def test_worker_augmentation_draws_resume_exactly(persistent):
    """num_workers=2, random draws inside the workers: mid-epoch, at an epoch's end and in the next epoch."""
    make = lambda: _augmented(num_workers=2, persistent_workers=persistent)  # noqa: E731
    assert _inexact(make, (1, 4, 6, 9)) == {}


@pytest.mark.parametrize("k", [0, 2, 5, 6, 8, 13])
@pytest.mark.parametrize("seeded", [True, False], ids=["generator", "global-rng"])
def test_a_registered_plain_stateful_dataloader_resumes_exactly(k, seeded):
    """The README's "anything with state_dict()": torchdata's own loader, shuffled, registered as it is."""

    def make():
        gen = torch.Generator().manual_seed(7) if seeded else None
        return StatefulDataLoader(Augmented(), batch_size=4, shuffle=True, generator=gen)

    assert _differences(make, k) == []
    assert isinstance(_registered(make)[0]["data"], StatefulLoaderState)


def test_resumable_loader_without_workers_resumes_augmentation_exactly():
    assert _inexact(_augmented, (0, 3, 6, 7, 12)) == {}


def test_skip_batches_works_on_a_registered_plain_stateful_dataloader():
    state, loader = _registered(
        lambda: StatefulDataLoader(
            DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
        )
    )
    reference = epochs(
        StatefulDataLoader(DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)), 2
    )
    assert state["data"].skip_batches(8) == 1
    assert state["data"].batches_skipped == 8
    assert [b.tolist() for b in loader] == reference[8:12]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_plain_dataloader_is_refused_naming_resumable_loader(shuffle):
    with pytest.raises(LoaderError, match="ResumableLoader") as info:
        TrainingState().register("data", DataLoader(DATA, batch_size=4, shuffle=shuffle))
    assert isinstance(info.value, UserError) and "register('data')" in str(info.value)
    assert ("shuffle=True" in str(info.value)) == shuffle


def test_a_stateful_dataloader_with_workers_is_refused_unless_its_dataset_saves_itself():
    with pytest.raises(LoaderError, match=r"num_workers=2.*ResumableLoader"):
        TrainingState().register("data", StatefulDataLoader(Augmented(), batch_size=4, num_workers=2))

    class SavesItself(Augmented):
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    loader = StatefulDataLoader(SavesItself(), batch_size=4, num_workers=2)
    assert TrainingState().register("data", loader) is loader


def test_resumable_loader_refuses_an_iterable_dataset_with_workers():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    with pytest.raises(LoaderError, match="IterableDataset"):
        ResumableLoader(Stream(), batch_size=2, num_workers=2)
    assert [b.tolist() for b in ResumableLoader(Stream(), batch_size=4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_worker_rng_wraps_only_with_workers_and_keeps_batched_reads():
    class Batched(Augmented):
        def __getitems__(self, indices):
            return [torch.tensor([float(i), 0.0, 0.0, 0.0]) for i in indices]

    assert not isinstance(_augmented().dataset, WorkerRNG)
    loader = ResumableLoader(Batched(), batch_size=4, num_workers=1)
    assert isinstance(loader.dataset, WorkerRNG)
    assert next(iter(loader))[:, 1:].abs().sum().item() == 0.0  # read through __getitems__


@pytest.mark.slow
def test_a_plain_stateful_dataloader_with_workers_resumes_exactly_over_worker_rng():
    def make():
        gen = torch.Generator().manual_seed(7)
        return StatefulDataLoader(
            WorkerRNG(Augmented()), batch_size=4, shuffle=True, generator=gen, num_workers=2
        )

    assert _inexact(make, (3, 7)) == {}


def test_a_plain_stateful_dataloader_still_loads_a_state_saved_without_the_wrapper():
    def make():
        return StatefulDataLoader(
            DATA, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7)
        )

    reference = epochs(make(), 1)
    old = make()
    take(old, 2)
    state, loader = _registered(make)
    state.load_state_dict({"data": copy.deepcopy(old.state_dict())})
    assert [b.tolist() for b in loader] == reference[2:6]


def test_loop_refuses_an_unregistered_torch_data_loader(tmp_path):
    """Iterating a DataLoader the session does not checkpoint would resume at the wrong batch (issue 14)."""
    import pytest
    import torch

    from supervisor.errors import UserError
    from supervisor.runtime import Session

    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    sess = Session.attach(workdir=tmp_path)
    model = torch.nn.Linear(1, 1)
    sess.register(model=model)
    with sess, pytest.raises(UserError, match="not registered.*ResumableLoader"):
        next(iter(sess.loop(torch.utils.data.DataLoader(data, batch_size=2), max_steps=2)))
