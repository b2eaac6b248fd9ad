"""ResumableLoader: identical batches after a resume at any position, across epochs; skip_batches()."""

from __future__ import annotations

import copy

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from supervisor.data import ResumableLoader

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
