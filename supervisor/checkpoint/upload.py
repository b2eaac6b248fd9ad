"""The upload stage of the write pipeline: committed local checkpoints to the remote tier, in the background."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import Future

from supervisor.checkpoint.asyncwriter import AsyncWriter, BackgroundErrors
from supervisor.checkpoint.holds import Holds
from supervisor.checkpoint.local import LocalStore
from supervisor.checkpoint.manifest import ABANDONED, CKPT_PREFIX, Manifest
from supervisor.checkpoint.remote import RemoteTier
from supervisor.checkpoint.retention import RetentionPolicy

log = logging.getLogger("rollback_supervisor.checkpoint")


class Uploader:
    """Uploads each committed checkpoint on its own thread, then applies retention to the remote.

    An upload holds its checkpoint against local retention until it is done; a failure is recorded in
    `errors` (raised by the manager's next call).
    """

    def __init__(
        self,
        remote: RemoteTier,
        store: LocalStore,
        holds: Holds,
        policy: Callable[[], RetentionPolicy | None],
        errors: BackgroundErrors,
    ):
        self.remote = remote
        self._store = store
        self._holds = holds
        self._policy = policy
        self._worker = AsyncWriter("ckpt-upload", errors)

    def submit(self, manifest: Manifest) -> Future[None]:
        self._holds.uploading(manifest.id)
        return self._worker.submit(manifest.id, self._upload, manifest)

    def _upload(self, manifest: Manifest) -> None:
        try:
            self.remote.upload(self._store, manifest)
            log.info("Uploaded checkpoint %s to %s", manifest.id, self.remote.url)
            abandoned = self._store.path(CKPT_PREFIX + manifest.id, ABANDONED)
            if os.path.exists(abandoned):  # a rollback marked it while the upload ran: the remote copy too
                with open(abandoned, encoding="utf-8", errors="replace") as fh:
                    self.remote.mark_abandoned(manifest.id, fh.read())
            self.remote.apply_retention(self._policy())
        finally:
            self._holds.uploaded(manifest.id)

    def futures(self) -> list[Future[None]]:
        return self._worker.futures()

    def prune(self) -> None:
        self._worker.prune()

    def drain(self) -> None:
        self._worker.drain()

    def close(self) -> None:
        self._worker.close()


__all__ = ["Uploader"]
