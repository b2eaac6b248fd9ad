"""Typed errors. Every message says what was expected, what was found, and how to fix it."""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of every error this package raises on purpose."""

    exit_code = 1


class UserError(SupervisorError):
    """Bad input from the user (file, flag, YAML). The CLI prints it without a traceback and exits 2."""

    exit_code = 2


class PolicyError(UserError):
    """A policy file is invalid. `problems` holds one `file:line:col: key: message` line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class CheckpointError(SupervisorError):
    """A checkpoint could not be written or read."""


class CheckpointNotFound(CheckpointError):
    """No checkpoint matches the request."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint failed verification (checksum, size, missing file, bad manifest)."""

    def __init__(self, checkpoint_id: str, reason: str):
        self.checkpoint_id = checkpoint_id
        self.reason = reason
        super().__init__(f"checkpoint {checkpoint_id} is invalid: {reason}")


class UnsupportedStateError(CheckpointError, UserError):
    """A state dict holds a value we cannot store without pickle."""

    def __init__(self, key_path: str, found: object):
        self.key_path = key_path
        super().__init__(
            f"{key_path}: expected a tensor, number, string, bool, None, list, tuple or dict, "
            f"got {type(found).__module__}.{type(found).__qualname__}; convert it in state_dict() "
            "or register it as a tensor/JSON extra"
        )


class BackgroundSaveError(CheckpointError):
    """An asynchronous save failed; raised on the next call, wait() or close()."""


class LeaseHeldError(SupervisorError):
    """Another supervisor holds the lineage lease (or took it from us). The CLI exits 2: nothing started."""

    exit_code = 2
