"""Uneven validation, test and predict data: a rank that runs out of batches joins its peers'
forwards with dummy steps (one small all-gather per step, no logging or metric effects), as
torch's ``Join`` does for DDP, because every forward of a sharded model is a collective and
a rank that left the loop would hang the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor

from lightning_megatron_fsdp import _lightning
from lightning_megatron_fsdp.agreement import Ranks, describe, peer_failures_explained

__all__ = ["UnevenBatchJoin", "join_uneven_batches", "refuse_uneven_batches"]

StepRunner = Callable[[tuple[Any, ...], dict[str, Any]], Any]

# One row per rank in each round's all-gather.
_HAS_BATCH, _DATALOADER, _HAS_EXAMPLE = range(3)


def join_uneven_batches(
    trainer: pl.Trainer,
    *,
    step_name: str,
    counts: Sequence[float],
    run_step: StepRunner,
    device: torch.device,
    where: str,
) -> UnevenBatchJoin | None:
    """Set up the join for the stage that is starting, if ranks' batch counts may differ.

    Call from the strategy's ``on_{validation,test,predict}_start`` on every rank (one
    collective): the loop has created its fetcher and reads it right after these hooks.
    Equal, known counts on every rank install nothing, so an even stage runs as it would
    without this module, with no collective per step.

    Args:
        trainer: The running Trainer.
        step_name: ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
        counts: This rank's batch count per dataloader (``inf`` when unknown).
        run_step: Runs the step as the strategy does for a real batch, without
            :meth:`UnevenBatchJoin.before_step` (what a dummy step runs).
        device: Device of the per-round tensors (the root device; CUDA for NCCL).
        where: Prefix of error messages.

    Returns:
        The join, whose :meth:`~UnevenBatchJoin.before_step` the strategy calls before
        every real step; ``None`` when nothing needs joining.

    Raises:
        ValueError: On every rank, if the counts differ and the loop cannot be joined (a
            ``dataloader_iter`` step).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    gathered = Ranks.of().all_gather([float(c) for c in counts])
    first = gathered[0]
    if all(c == first for c in gathered) and float("inf") not in first:
        return None
    join = UnevenBatchJoin(
        step_name=step_name,
        run_step=run_step,
        module=trainer.lightning_module,
        num_dataloaders=len(counts),
        device=device,
        where=where,
    )
    reason = _install(trainer, join)
    if reason is not None:
        raise ValueError(_uneven_message(step_name.removesuffix("_step"), gathered, reason, where))
    return join


def refuse_uneven_batches(stage: str, counts: Sequence[float], *, where: str) -> None:
    """Raise on every rank if ranks would run different numbers of steps (one collective).

    For training: Lightning pads training samplers, so only a user's own sampler or data
    split gets here, and a training step cannot be joined by a dummy (its backward and
    optimizer step would change the weights).

    Raises:
        ValueError: Naming each rank's batch counts.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    gathered = Ranks.of().all_gather([float(c) for c in counts])
    if any(c != gathered[0] for c in gathered):
        why = "a training step cannot be joined (a dummy step would change the weights)"
        raise ValueError(_uneven_message(stage, gathered, why, where))


def _uneven_message(stage: str, gathered: Sequence[Any], why: str, where: str) -> str:
    per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(gathered))
    return (
        f"{where}: the {stage} dataloaders give ranks different numbers of batches "
        f"({per_rank}), and {why}. Every forward all-gathers parameters from all ranks, so "
        "every rank must run the same number of steps: give every rank the same number of "
        "batches (a sampler that pads or drops the remainder)."
    )


def _evaluation_loop_of(trainer: pl.Trainer) -> Any:
    """The loop now running validation, test or prediction (public attributes only)."""
    if trainer.predicting:
        return trainer.predict_loop
    if trainer.testing:
        return trainer.test_loop
    if trainer.state.fn == TrainerFn.FITTING:
        return trainer.fit_loop.epoch_loop.val_loop
    return trainer.validate_loop


def _install(trainer: pl.Trainer, join: UnevenBatchJoin) -> str | None:
    """Put ``join`` between the running loop and its data fetcher.

    Returns:
        ``None`` when installed, else why the loop cannot be joined (a ``dataloader_iter``
        step, or a Lightning whose loop no longer has the fetcher where expected).
    """
    loop = _evaluation_loop_of(trainer)
    fetcher = _lightning.data_fetcher(loop)  # see the module docstring
    if fetcher is None:
        return (
            f"this Lightning version's {type(loop).__name__} keeps no data fetcher where "
            "lightning_megatron_fsdp joins uneven ranks (loop._data_fetcher)"
        )
    if isinstance(fetcher, _lightning.DataLoaderIterDataFetcher):
        return "a step that takes `dataloader_iter` pulls its own batches and cannot be joined"
    _lightning.set_data_fetcher(loop, _JoiningFetcher(fetcher, join))
    return None


@dataclasses.dataclass(kw_only=True, eq=False, repr=False)
class UnevenBatchJoin:
    """One stage's join state: which dataloader the rank is in, and its example batches.

    Attributes:
        step_name: ``"validation_step"``, ``"test_step"`` or ``"predict_step"``.
        run_step: Runs the stage's step exactly as the strategy does for a real batch
            (precision context, root unit), without :meth:`before_step`.
        module: The LightningModule (its logging is silenced during dummy steps).
        num_dataloaders: Dataloaders of the stage, the same on every rank.
        device: Device of the round tensors (the strategy's root device; CUDA for NCCL).
        where: Prefix of error messages.
    """

    step_name: str
    run_step: StepRunner
    module: pl.LightningModule
    num_dataloaders: int
    device: torch.device
    where: str
    _dataloader: int = dataclasses.field(default=0, init=False)
    _examples: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = dataclasses.field(
        default_factory=dict, init=False
    )

    def __post_init__(self) -> None:
        if self.num_dataloaders < 1:
            raise ValueError(
                f"{self.where}: num_dataloaders must be >= 1, got {self.num_dataloaders}."
            )

    def before_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Announce a real step (caching its batch as this dataloader's example).

        Collective: every rank is either here or in a join round of the same dataloader.
        """
        self._examples.setdefault(self._dataloader, (args, dict(kwargs)))
        self._round(has_batch=True)

    def enter_dataloader(self, index: int) -> None:
        """Join the rest of every dataloader before ``index`` (the loop moves on to it).

        Raises:
            RuntimeError: If ``index`` goes backwards (not a sequential loader).
        """
        if index < self._dataloader or index > self.num_dataloaders:
            raise RuntimeError(
                f"{self.where}: {self.step_name} moved from dataloader {self._dataloader} to "
                f"{index}; expected dataloaders in order 0..{self.num_dataloaders - 1} "
                "(CombinedLoader mode 'sequential')."
            )
        while self._dataloader < index:
            while self._round(has_batch=False):
                self._dummy_step()
            self._dataloader += 1

    def _round(self, *, has_batch: bool) -> bool:
        """One agreement: does any rank run a real step of this dataloader now?

        Every rank sees the same rows, so all take the same decisions, including the
        broadcast that gives an example batch to ranks that never had one.

        Raises:
            RuntimeError: On every rank, if ranks are in different dataloaders.
        """
        mine = [int(has_batch), self._dataloader, int(self._dataloader in self._examples)]
        with peer_failures_explained(f"{self.where}: {self.step_name} (uneven batches)"):
            rows = _all_gather_rows(torch.tensor(mine, dtype=torch.int64, device=self.device))
        if len({row[_DATALOADER] for row in rows}) != 1:
            found = ", ".join(f"rank {r}: {row[_DATALOADER]}" for r, row in enumerate(rows))
            raise RuntimeError(
                f"{self.where}: ranks are in different dataloaders of {self.step_name} ({found}); "
                "expected the same dataloaders, in the same order, on every rank."
            )
        if not any(row[_HAS_BATCH] for row in rows):
            return False
        if not all(row[_HAS_EXAMPLE] for row in rows):
            source = next(r for r, row in enumerate(rows) if row[_HAS_EXAMPLE])
            self._share_example(source)
        return True

    def _share_example(self, source: int) -> None:
        """Broadcast ``source``'s example batch to the ranks that have none.

        The source serialises first and broadcasts a failure instead of a batch when it
        cannot, so every rank raises the same error instead of waiting.

        Raises:
            RuntimeError: On every rank, if the source's batch cannot be pickled.
        """
        payload: Any = None
        if dist.get_rank() == source:
            try:
                payload = pickle.dumps(move_data_to_device(self._examples[self._dataloader], "cpu"))
            except Exception as err:
                payload = _ShareFailure(describe(err))
        box = [payload]
        with peer_failures_explained(f"{self.where}: {self.step_name} (uneven batches)"):
            dist.broadcast_object_list(box, src=source)
        (payload,) = box
        if isinstance(payload, _ShareFailure):
            raise RuntimeError(
                f"{self.where}: rank {source} could not send a {self.step_name} batch of "
                f"dataloader {self._dataloader} to a rank that has none ({payload.error}). A "
                "rank without batches runs the step on a peer's batch to join its forwards; "
                "make the batch picklable, or give every rank at least one batch."
            )
        if self._dataloader not in self._examples:
            example = move_data_to_device(pickle.loads(payload), self.device)
            self._examples[self._dataloader] = example

    def _dummy_step(self) -> None:
        """Run the step on this dataloader's example batch, dropping every effect we can."""
        args, kwargs = self._examples[self._dataloader]
        with _effects_dropped(self.module, self.step_name, self.where):
            self.run_step(args, dict(kwargs))


@contextlib.contextmanager
def _effects_dropped(module: pl.LightningModule, step_name: str, where: str) -> Iterator[None]:
    """Silence logging, restore torchmetrics states and mark the step as running."""
    from torchmetrics import Metric

    saved = [(m, _MetricState.of(m)) for m in module.modules() if isinstance(m, Metric)]
    previous_fx = _lightning.current_fx_name(module)  # see the module docstring
    _lightning.set_current_fx_name(module, step_name)
    module.__dict__["log"] = _DummyLog(where, step_name, "log")
    module.__dict__["log_dict"] = _DummyLog(where, step_name, "log_dict")
    try:
        yield
    finally:
        module.__dict__.pop("log", None)
        module.__dict__.pop("log_dict", None)
        _lightning.set_current_fx_name(module, previous_fx)
        for metric, state in saved:
            state.restore(metric)


class _MetricState:
    """A torchmetrics ``Metric``'s states and counters, restorable in place.

    States are restored into their original tensor and list objects (torchmetrics
    updates some in place, others by re-binding), so a ``MetricCollection`` whose
    compute groups share state objects keeps sharing them.
    """

    def __init__(self, states: dict[str, tuple[Any, Any]], counters: dict[str, Any]) -> None:
        self.states = states
        self.counters = counters

    @classmethod
    def of(cls, metric: Any) -> _MetricState:
        states = {}
        for name in _lightning.metric_state_names(
            metric
        ):  # torchmetrics' registry of state names (add_state)
            value = getattr(metric, name)
            if isinstance(value, Tensor):
                states[name] = (value, value.detach().clone())
            elif isinstance(value, list):
                states[name] = (value, list(value))
        return cls(states, _lightning.metric_counters(metric))

    def restore(self, metric: Any) -> None:
        for name, (original, saved) in self.states.items():
            if isinstance(original, Tensor):
                original.copy_(saved)
            else:
                original[:] = saved
            setattr(metric, name, original)
        _lightning.set_metric_counters(metric, self.counters)


_LOG_SIGNATURES = {
    "log": inspect.signature(pl.LightningModule.log),
    "log_dict": inspect.signature(pl.LightningModule.log_dict),
}


class _DummyLog:
    """``LightningModule.log``/``log_dict`` during a dummy step: nothing is recorded."""

    def __init__(self, where: str, step_name: str, method: str) -> None:
        self._where = where
        self._step_name = step_name
        self._method = method

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        arguments = _LOG_SIGNATURES[self._method].bind(None, *args, **kwargs).arguments
        syncs_now = arguments.get("sync_dist") and arguments.get("on_step")
        if syncs_now and not arguments.get("rank_zero_only"):
            raise RuntimeError(
                f"{self._where}: self.{self._method}(..., sync_dist=True, on_step=True) in "
                f"{self._step_name} syncs every step, but the ranks have different numbers of "
                "batches: this rank has run out and cannot contribute a value. Log with "
                "on_step=False (synced once per epoch, the default in evaluation), or give "
                "every rank the same number of batches."
            )


class _ShareFailure:
    """What a source rank broadcasts when its example batch cannot be pickled."""

    def __init__(self, error: str) -> None:
        self.error = error


class _JoiningFetcher(Iterator):
    """The loop's data fetcher, with joins where this rank's dataloaders end.

    Delegates everything else (``done``, ``teardown``, counters) to the fetcher it wraps.
    """

    def __init__(self, fetcher: Any, join: UnevenBatchJoin) -> None:
        self._fetcher = fetcher
        self._join = join

    def __iter__(self) -> _JoiningFetcher:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._fetcher)
        except StopIteration:
            self._join.enter_dataloader(self._join.num_dataloaders)
            raise
        self._join.enter_dataloader(item[2])  # (batch, batch_idx, dataloader_idx)
        return item

    @property
    def done(self) -> bool:
        return self._fetcher.done

    def teardown(self) -> None:
        self._fetcher.teardown()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fetcher, name)


def _all_gather_rows(mine: Tensor) -> list[list[int]]:
    """Every rank's row, by rank (one all-gather on the default group)."""
    world_size = dist.get_world_size()
    gathered = torch.empty(world_size * mine.numel(), dtype=mine.dtype, device=mine.device)
    dist.all_gather_single(gathered, mine)
    return gathered.view(world_size, -1).tolist()
