"""The errors a save, load or removal raises: one class per cause, to catch what you mean.

Each class names its category, a stable string under which it travels between ranks: when
one rank fails, every rank raises the same class (``agreement.Ranks.agree``), and the rank
that receives the failure looks the class up by its category here. Neither the message's
words nor a position in some list decide the class, so rewording a message or adding a
class cannot change what the other ranks raise. Exceptions that are not ours travel only
as the built-in classes registered here (``TypeError`` and ``ValueError``: the caller's
input was wrong, on every rank alike); any other is mapped by type (:func:`traveling_class`).
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CheckpointCorruptedError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "NotACheckpointError",
    "error_category",
    "error_class",
    "traveling_class",
]

# Category -> class: every class that may travel between ranks in an agreement.
_CLASSES: dict[str, type[Exception]] = {"type": TypeError, "value": ValueError}


def _register(cls: type[Exception]) -> None:
    category = cls.__dict__["category"]
    if _CLASSES.setdefault(category, cls) is not cls:
        raise TypeError(
            f"{cls.__qualname__}: category {category!r} is already "
            f"{_CLASSES[category].__qualname__}'s; give each error class its own."
        )


class CheckpointError(RuntimeError):
    """A Megatron-FSDP checkpoint could not be saved, loaded or removed."""

    #: How the class travels between ranks and what a summary line counts it as.
    category: ClassVar[str] = "other"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "category" in cls.__dict__:  # else it travels as its nearest registered base
            _register(cls)


class NotACheckpointError(CheckpointError):
    """The path is not a complete checkpoint directory written by this library."""

    category = "not a checkpoint"


class CheckpointCorruptedError(CheckpointError):
    """A checkpoint's files are missing, truncated, or fail their checksum."""

    category = "damaged"


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's layout fingerprint does not match the state it is loaded into."""

    category = "mismatch"


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank; the previous checkpoint under that name is untouched."""

    category = "save failed"


_register(CheckpointError)


def error_category(cls: type[BaseException]) -> str:
    """The category under which ``cls`` travels between ranks.

    Raises:
        TypeError: If ``cls`` may not travel (not a class registered here): map it first
            with :func:`traveling_class`.
    """
    for category, registered in _CLASSES.items():
        if registered is cls:
            return category
    raise TypeError(
        f"{cls!r} cannot travel between ranks: expected one of "
        f"{sorted(k.__name__ for k in _CLASSES.values())}; map it with traveling_class()."
    )


def error_class(category: str) -> type[Exception]:
    """The class that travels as ``category`` (the inverse of :func:`error_category`).

    Raises:
        KeyError: If no class has that category (a peer running another version).
    """
    return _CLASSES[category]


def traveling_class(cls: type[BaseException], default: type[Exception]) -> type[Exception]:
    """The most precise registered class that ``cls`` is and that is a ``default``; else
    ``default``.

    The defined mapping for any exception, by type only, never by message: one of ours
    travels as itself (a subclass without its own category as its nearest registered
    base), while an ``OSError``, a ``KeyError`` or a backend's ``RuntimeError`` becomes
    ``default``.
    """
    for base in cls.__mro__:
        if base is default or (
            issubclass(base, default) and _CLASSES.get(base.__dict__.get("category", "")) is base
        ):
            return base
    return default
