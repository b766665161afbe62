"""The errors a save, load or removal raises: one class per cause, to catch what you mean."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "NotACheckpointError",
]


class CheckpointError(RuntimeError):
    """A Megatron-FSDP checkpoint could not be saved, loaded or removed."""


class NotACheckpointError(CheckpointError):
    """The path is not a complete checkpoint directory written by this library."""


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint's files are missing, truncated, or fail their checksum."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's layout fingerprint does not match the state it is loaded into."""


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; the previous checkpoint under that name is untouched."""
