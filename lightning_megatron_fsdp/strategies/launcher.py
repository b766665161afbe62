"""Lightning launchers that resolve ``ckpt_path="last"`` to a *complete* checkpoint: Lightning
picks the newest ``last*`` entry before the strategy sees the run, which may be damaged or,
after a crash mid-overwrite, absent; the launcher's ``launch`` is the one earlier hook, so
these launchers recover and choose there.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.storage import (
    MANIFEST_FILE,
    latest_complete_checkpoint,
    locate,
    request_deadline,
)

__all__ = ["resolving_last_launcher"]


def resolving_last_launcher(
    inner: _lightning.Launcher | None, timeout: timedelta | None
) -> _lightning.Launcher | None:
    """Wrap Lightning's launcher so ``ckpt_path="last"`` means a complete checkpoint.

    Args:
        inner: The launcher Lightning configured: ``None`` when processes are created
            externally (torchrun, SLURM, ...), else its script launcher.
        timeout: The strategy's collective timeout: each object-store request of the
            lookup gives up after half of it, as the checkpoint's load would.

    Returns:
        The wrapping launcher, or ``inner`` itself for a launcher this does not know.
    """
    launcher: _ResolvesLast
    if inner is None:
        launcher = _ResolvingLastLauncher()
    elif type(inner) is _lightning.SubprocessScriptLauncher:
        launcher = _ResolvingLastSubprocessScriptLauncher(
            inner.cluster_environment, inner.num_processes, inner.num_nodes
        )
    else:
        return inner
    launcher.deadline = request_deadline(timeout)
    return launcher


def _with_last_resolved(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainer: pl.Trainer | None,
    deadline: float | None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``function``'s arguments with ``ckpt_path="last"`` replaced by a complete checkpoint.

    ``function`` is the Trainer stage (``_fit_impl``, ``_validate_impl``, ...); its
    ``ckpt_path`` argument is found by name. Unchanged when it is not ``"last"`` or no
    complete ``last*`` checkpoint exists (Lightning then warns and starts fresh).
    """
    if trainer is None:
        return args, kwargs
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    if bound.arguments.get("ckpt_path") != "last":
        return args, kwargs
    resolved = _latest_complete_last_checkpoint(trainer, deadline)
    if resolved is None:
        return args, kwargs
    bound.arguments["ckpt_path"] = str(resolved)
    return bound.args, bound.kwargs


def _latest_complete_last_checkpoint(trainer: pl.Trainer, deadline: float | None) -> str | None:
    """The most recently written complete checkpoint Lightning's ``"last"`` could mean.

    Candidates are Lightning's: the ``last*`` entries of every ``ModelCheckpoint``
    directory (local, or a URL: the newest complete version of each ``last*`` checkpoint
    there, by when its manifest was written) and the ``OnExceptionCheckpoint`` paths.
    """
    found: list[tuple[float, str]] = []
    options = getattr(trainer.strategy.checkpoint_io, "storage_options", None)
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        dirpath = _checkpoint_dir(callback, trainer)
        if dirpath is None:
            continue
        pattern = f"{callback.CHECKPOINT_NAME_LAST}*{callback.FILE_EXTENSION}"
        location = locate(dirpath, options, deadline=deadline)
        latest = location.latest(pattern, on_restored=rank_zero_warn)
        if latest is not None:
            found.append((latest[0], str(latest[1])))
    crashed = [
        Path(callback.ckpt_path)
        for callback in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(callback, OnExceptionCheckpoint)
    ]
    newest = latest_complete_checkpoint(crashed, by="written")
    if newest is not None:
        found.append(((newest / MANIFEST_FILE).stat().st_mtime, str(newest)))
    return max(found)[1] if found else None


def _checkpoint_dir(callback: ModelCheckpoint, trainer: pl.Trainer) -> _lightning.PATH | None:
    """The directory ``callback`` saves to, resolved exactly as its ``"last"`` lookup does.

    Before ``setup`` a ``ModelCheckpoint`` without ``dirpath`` has not resolved it yet;
    Lightning's lookup calls the callback's private resolver (callbacks/model_checkpoint.py
    ``__resolve_ckpt_dir``), and so does this.
    """
    resolve = _lightning.checkpoint_dir_resolver(callback)
    if resolve is not None:
        with contextlib.suppress(Exception):
            return resolve(trainer)
    return callback.dirpath


class _ResolvesLast(_lightning.Launcher):
    """Resolves ``ckpt_path="last"``, then launches as the launcher after it in the MRO."""

    deadline: float | None = None
    """Seconds each object-store request of the lookup may take (``None``: no limit)."""

    @override
    def launch(
        self,
        function: Callable[..., Any],
        *args: Any,
        trainer: pl.Trainer | None = None,
        **kwargs: Any,
    ) -> Any:
        args, kwargs = _with_last_resolved(function, args, kwargs, trainer, self.deadline)
        return super().launch(function, *args, trainer=trainer, **kwargs)


class _InProcessLauncher(_lightning.Launcher):
    """For processes created externally: run the stage here."""

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("trainer", None)  # the stage is bound to its Trainer already
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: this launcher started no process."""


class _ResolvingLastLauncher(_ResolvesLast, _InProcessLauncher):
    """For processes created externally: run the stage here, ``ckpt_path="last"`` resolved."""


class _ResolvingLastSubprocessScriptLauncher(_ResolvesLast, _lightning.SubprocessScriptLauncher):
    """Lightning's script launcher, with ``ckpt_path="last"`` resolved before it spawns."""
