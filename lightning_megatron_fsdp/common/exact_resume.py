"""What a resumed ``fit`` needs beyond tensors to continue bit-exactly: every rank's random
streams saved in ``meta.pt`` and restored where the uninterrupted run stood, validation
inside ``fit`` on a copy of them, and the train sampler's epoch set before Lightning
restores a resumable loader (:class:`ExactResume`, driven by the strategy's hooks).
"""

from __future__ import annotations

import math
import random
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DistributedSampler

from lightning_megatron_fsdp import _lightning, _torch

__all__ = [
    "RNG_STATES_KEY",
    "ExactResume",
    "align_sampler_epoch",
    "capture_rng_states",
    "continue_progress_bar",
    "restore_rng_states",
    "rng_states_of",
    "shuffle_by_epoch",
]

#: Key of the per-rank random states in Lightning's checkpoint dict (written to ``meta.pt``):
#: ``{"world_size": N, "states": [rank 0's states, ..., rank N-1's]}``, each as
#: :func:`capture_rng_states` returns them.
RNG_STATES_KEY = "megatron_fsdp_rng_states"

_STREAMS = {
    "torch": "torch CPU",
    "cuda": "torch CUDA",
    "numpy": "numpy",
    "python": "Python random",
}


def _stream_names(states: dict[str, Any]) -> str:
    """The readable names of the streams in one rank's ``states``, in a fixed order."""
    return ", ".join(name for key, name in _STREAMS.items() if key in states)


def _current_device() -> torch.device:
    """This process's CUDA device if it has used CUDA, else the CPU."""
    if torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def capture_rng_states(device: torch.device) -> dict[str, Any]:
    """This process's random states, in a form ``torch.load(weights_only=True)`` accepts.

    Args:
        device: The rank's device; its CUDA generator is included when it is a CUDA device
            (only that device's, never other ranks').

    Returns:
        ``{"torch": ByteTensor, "python": tuple, "numpy": dict, "cuda": ByteTensor}``
        (``numpy`` without numpy, ``cuda`` on other devices are left out).
    """
    states: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    numpy = _numpy()
    if numpy is not None:
        kind, keys, position, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype("int64")),
            "pos": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict[str, Any], device: torch.device) -> list[str]:
    """Set this process's random streams from :func:`capture_rng_states`' output.

    Args:
        states: One rank's states.
        device: The rank's device (its CUDA generator is set when both sides have one).

    Returns:
        The streams that could not be restored, as readable names (empty when all were):
        the CUDA stream when one side ran on CUDA and the other did not, numpy when it is
        missing on either side.
    """
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    missing = []
    numpy = _numpy()
    saved_numpy = states.get("numpy")
    if numpy is not None and saved_numpy is not None:
        numpy.random.set_state(
            (
                saved_numpy["kind"],
                saved_numpy["keys"].numpy().astype("uint32"),
                saved_numpy["pos"],
                saved_numpy["has_gauss"],
                saved_numpy["cached_gaussian"],
            )
        )
    elif numpy is not None or saved_numpy is not None:
        missing.append(_STREAMS["numpy"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)
    elif device.type == "cuda" or "cuda" in states:
        missing.append(_STREAMS["cuda"])
    return missing


def shuffle_by_epoch(dataloader: object) -> None:
    """Shuffle a ``StatefulDataLoader(shuffle=True)`` as Lightning shuffles a ``DataLoader``.

    Lightning replaces torch's ``RandomSampler`` with a ``DistributedSampler(shuffle=True)``
    (its order is a function of seed and epoch, so a restored position replays it), but it
    does not recognise torchdata's ``RandomSampler`` and wraps it in a
    ``DistributedSamplerWrapper`` instead: each epoch first draws a permutation from the
    inner sampler's own generator, which nothing checkpoints, so a resumed run's epochs
    get other orders. This puts the ``DistributedSampler`` Lightning would have built in
    the wrapper's place (same replicas, rank, seed, ``drop_last``). Only that exact case
    is changed: torchdata's ``RandomSampler`` without replacement over the whole dataset.
    """
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    wrapper = getattr(batch_sampler, "sampler", None)
    if not isinstance(wrapper, DistributedSamplerWrapper):
        return
    try:
        from torchdata.stateful_dataloader.sampler import RandomSampler
    except ImportError:
        return
    inner = _lightning.wrapped_sampler(wrapper.dataset)
    if (
        type(inner) is not RandomSampler
        or inner.replacement
        or _torch.random_sampler_num_samples(inner) is not None
    ):
        return
    batch_sampler.sampler = DistributedSampler(  # type: ignore[union-attr]
        inner.data_source,
        num_replicas=wrapper.num_replicas,
        rank=wrapper.rank,
        shuffle=True,
        seed=wrapper.seed,
        drop_last=wrapper.drop_last,
    )


def align_sampler_epoch(dataloader: object, epoch: int) -> None:
    """Set the epoch of ``dataloader``'s sampler (and batch sampler's sampler) to ``epoch``.

    Called for the train loader before Lightning restores its state and creates its
    iterator, with the epoch Lightning will pass to ``set_epoch`` right after; a sampler
    without ``set_epoch`` is left alone.
    """
    _lightning.set_sampler_epoch(dataloader, epoch)


def continue_progress_bar(trainer: pl.Trainer) -> None:
    """Label a mid-epoch resume's progress bar with its epoch and total, as an epoch start does.

    Lightning (2.6) calls ``on_train_epoch_start`` when an epoch starts, not when a resume
    continues one, so the bar Lightning's ``TQDMProgressBar`` created in ``on_train_start``
    would keep the label "Training" and no total. The bar then counts batches of the epoch
    (``batch_idx + 1``), so its total is where this run will stop in the epoch: the end of
    the epoch, or ``max_steps`` steps on from the batches already run. Other progress bars
    are left as Lightning leaves them.
    """
    fit_loop = trainer.fit_loop
    bar = trainer.progress_bar_callback
    if not (fit_loop.restarted_mid_epoch and isinstance(bar, TQDMProgressBar)):
        return
    if not bar.is_enabled or bar.train_progress_bar is None:
        return
    done = fit_loop.epoch_loop.batch_progress.current.processed
    total = min(trainer.num_training_batches, done + bar.total_train_batches)
    tqdm = bar.train_progress_bar
    tqdm.reset(total=None if math.isinf(total) else int(total))
    tqdm.initial = tqdm.n = done  # the rate and the estimate count this run's batches
    tqdm.set_description(f"Epoch {trainer.current_epoch}")  # as on_train_epoch_start; refreshes


def rng_states_of(states: list[Any]) -> dict[str, Any]:
    """What ``meta.pt`` holds under :data:`RNG_STATES_KEY`: every rank's streams, by rank."""
    return {"world_size": len(states), "states": states}


class ExactResume:
    """A ``fit``'s random streams and data position across saves, resumes and validation.

    One per strategy; see the module docstring for when each method runs and why.

    Args:
        where: Name used in warnings (the strategy's).
    """

    def __init__(self, where: str) -> None:
        self._where = where
        self._validation_snapshot: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        self._resuming = False

    def states_for_checkpoint(self, device: torch.device) -> Any:
        """This rank's training streams for the checkpoint (rank-local, no collective).

        During a validation run inside ``fit`` the streams captured when it began are
        recorded (the training run's), not the live ones validation has advanced. The save
        gathers every rank's into rank 0's ``meta.pt`` (:func:`rng_states_of`).
        """
        return self._validation_snapshot or capture_rng_states(device)

    def checkpoint_loaded(self, checkpoint: dict[str, Any], *, fitting: bool) -> None:
        """Keep this rank's saved streams for the resume (a ``fit`` only).

        Warns once (rank 0) when they cannot be restored: saved at another world size, or
        not saved at all (another strategy's checkpoint, or one older than this feature).
        """
        self._pending = None
        self._resuming = fitting
        if not fitting:
            return
        saved = checkpoint.get(RNG_STATES_KEY)
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        if not isinstance(saved, dict) or not isinstance(saved.get("states"), list):
            streams = _stream_names(capture_rng_states(_current_device()))
            rank_zero_warn(
                f"{self._where}: the checkpoint holds no random states, so the random "
                f"streams ({streams}) were not restored: each rank continues from its seed, and "
                "dropout masks and other random draws after the resume differ from an "
                "uninterrupted run's. Checkpoints this strategy writes hold them."
            )
            return
        if saved.get("world_size") != world_size or len(saved["states"]) != world_size:
            first = saved["states"][0] if saved["states"] else {}
            streams = _stream_names(first if isinstance(first, dict) else {})
            rank_zero_warn(
                f"{self._where}: the checkpoint's random states were saved by "
                f"{saved.get('world_size')} ranks and this run has {world_size}, so the "
                f"random streams ({streams}) were not restored (they belong to ranks that no "
                "longer exist): each rank continues from its seed, and dropout masks and "
                "other random draws after the resume differ from an uninterrupted run's. "
                "Model, optimizer, loop and data-loader state were restored."
            )
            return
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending = saved["states"][rank]

    def train_loader(self, trainer: pl.Trainer, dataloader: object, device: torch.device) -> None:
        """Prepare a train loader of ``fit`` before Lightning restores its position.

        Makes a ``StatefulDataLoader(shuffle=True)`` shuffle by epoch
        (:func:`shuffle_by_epoch`) and sets the sampler's epoch to the one about to run
        (in every fit, resumed or not, so both shuffle alike). On the first call after a
        checkpoint saved after the last batch of an epoch, also drops the saved loader
        positions, keeps a ``max_steps`` run from restarting the finished epoch, and
        restores the random streams (see the module docstring).
        """
        fit_loop = trainer.fit_loop
        progress = fit_loop.epoch_progress.current
        epoch = progress.processed
        if self._resuming and fit_loop.epoch_loop.batch_progress.is_last_batch:
            epoch = progress.ready  # every batch of the last started epoch was trained
            _lightning.forget_dataloader_states_to_load(fit_loop)  # the finished epoch's end
            if progress.processed == progress.ready:
                # Saved at or after on_train_epoch_end: nothing of that epoch is left to
                # restart. FitLoop's own setter forces restarting under max_steps.
                _lightning.Loop.restarting.fset(fit_loop, False)  # type: ignore[attr-defined]
            self.train_starting(device)
        shuffle_by_epoch(dataloader)
        align_sampler_epoch(dataloader, epoch)

    def train_starting(self, device: torch.device) -> None:
        """Restore the streams a checkpoint load kept (once), right before training resumes."""
        self._resuming = False
        pending, self._pending = self._pending, None
        if pending is None:
            return
        missing = restore_rng_states(pending, device)
        if missing:
            rank_zero_warn(
                f"{self._where}: restored the random states saved in the checkpoint except "
                f"{', '.join(missing)}, which only one of the saving and the resuming run "
                "had; that stream continues from its seed."
            )

    def validation_started(self, device: torch.device) -> None:
        """Capture the training streams before a validation run inside ``fit``."""
        self._validation_snapshot = capture_rng_states(device)

    def validation_ended(self, device: torch.device) -> None:
        """Put the training streams back as they were when validation started."""
        snapshot, self._validation_snapshot = self._validation_snapshot, None
        if snapshot is not None:
            restore_rng_states(snapshot, device)

    @staticmethod
    def continue_progress_bar(trainer: pl.Trainer) -> None:
        """:func:`continue_progress_bar`, for the strategy's ``on_train_start``."""
        continue_progress_bar(trainer)

    def reset(self) -> None:
        """Forget anything a stage left (called at teardown)."""
        self._validation_snapshot = None
        self._pending = None
        self._resuming = False


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with Lightning
        return None
    return numpy
