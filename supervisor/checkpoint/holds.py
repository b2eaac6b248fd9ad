"""Retention holds: the checkpoints retention must keep right now, and the policy the options and holds make."""

from __future__ import annotations

import threading
from collections.abc import Iterable

from supervisor.checkpoint.options import CheckpointOptions
from supervisor.checkpoint.retention import RetentionPolicy, policy_from_settings


class Holds:
    """Ids held by a caller (targets of a pending rollback) and by the uploader (uploads under way); thread-safe."""

    def __init__(self) -> None:
        self._protected: set[str] = set()
        self._uploading: set[str] = set()
        self._lock = threading.Lock()

    def protect(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._protected |= set(ids)

    def unprotect(self, ids: Iterable[str]) -> None:
        with self._lock:
            self._protected -= set(ids)

    def uploading(self, checkpoint_id: str) -> None:
        with self._lock:
            self._uploading.add(checkpoint_id)

    def uploaded(self, checkpoint_id: str) -> None:
        with self._lock:
            self._uploading.discard(checkpoint_id)

    def held(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._protected | self._uploading)

    def policy(self, options: CheckpointOptions) -> RetentionPolicy | None:
        """The retention the options ask for, keeping every held id; None when they ask for none."""
        return policy_from_settings(
            options.keep_last, options.keep_best, options.keep_every_steps, protected=self.held()
        )


__all__ = ["Holds"]
