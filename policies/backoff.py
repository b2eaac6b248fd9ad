"""The delay before a relaunch, from tenacity's wait strategies with a seeded jitter (no clock, no global RNG)."""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

from tenacity.wait import wait_base, wait_exponential

from policies.schema import Backoff


@dataclass(frozen=True)
class Attempt:
    """The one field of tenacity's RetryCallState that wait strategies read."""

    attempt_number: int


class wait_seeded_jitter(wait_base):
    """Scale another wait to a uniform draw between half and all of it, from an injected generator."""

    def __init__(self, inner: wait_base, rng: random.Random):
        self.inner = inner
        self.rng = rng

    def __call__(self, retry_state: Attempt) -> float:  # type: ignore[override]
        full = self.inner(retry_state)
        return full * (0.5 + 0.5 * self.rng.random())


def wait_strategy(backoff: Backoff, rng: random.Random) -> wait_base:
    """The tenacity strategy a `limits.backoff` block describes."""
    strategy: wait_base = wait_exponential(
        multiplier=backoff.initial_seconds, max=backoff.max_seconds, exp_base=backoff.multiplier
    )
    return wait_seeded_jitter(strategy, rng) if backoff.jitter else strategy


def seed_for(*parts: object) -> int:
    """A stable seed from the decision's inputs, for callers that pass none (same inputs, same delay)."""
    return zlib.crc32("\x1f".join(map(str, parts)).encode())


def relaunch_delay(backoff: Backoff, attempt_number: int, seed: int) -> float:
    """Seconds to wait before relaunch number `attempt_number` (1 for the first in the reset window)."""
    return float(wait_strategy(backoff, random.Random(seed))(Attempt(attempt_number)))
