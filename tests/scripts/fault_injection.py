"""Fault injectors and rank-side helpers for the fault-tolerance tests.

Problem: proving that a checkpoint survives a crash needs the crash to happen at an exact
point of a real save or load -- before any shard is written, after some, before the
commit -- on one chosen rank of a real process group, without mocking torch or DCP.

How: every injector is a real DCP component or a documented seam of our own:

* :class:`FaultyWriter` is the plugin's default writer (``ChecksummingFileSystemWriter``,
  a torch ``FileSystemWriter``) and :class:`FaultyReader` its default reader
  (``VerifyingFileSystemReader``, a torch ``FileSystemReader``); each runs the real method
  and, on the chosen rank at the chosen phase, raises an ``OSError`` or SIGKILLs its own
  process. They reach the plugin through its public ``storage_writer_factory`` /
  ``storage_reader_factory``.
* Commit steps, which no writer sees, go through ``commit._FAULT_HOOK``
  (:func:`arm_commit_fault`).
* A full disk is the kernel's: :func:`file_size_limit` sets ``RLIMIT_FSIZE``, so the real
  writer's ``write`` fails with ``EFBIG``.

Phases, in the order a save reaches them (``*`` = coordinator, rank 0, only)::

    plan          FaultyWriter.prepare_local_plan    nothing written yet
    global-plan*  FaultyWriter.prepare_global_plan
    write:before  FaultyWriter.write_data            before this rank's shard files
    write:after   FaultyWriter.write_data            this rank's shard files on disk
    metadata*     FaultyWriter.finish                every shard on disk, no .metadata
    commit:...    commit._FAULT_HOOK          see its docstring

and a load: ``read:metadata``, ``read:plan``, ``read:global-plan*``, ``read:before``,
``read:after`` (this rank's data read into the load's buffers).

The module also holds what every test rank does: build and train the tiny model, build
Lightning's checkpoint dict (the picklable "facts" and their checks are in
``tests/shard_facts.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import logging
import os
import resource
import signal
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import lightning_megatron_fsdp.storage.commit as commit
from lightning_megatron_fsdp import (
    MegatronFSDPCheckpointIO,
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    ensure_optimizer_state,
)
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.storage.filesystem import (
    ChecksummingFileSystemWriter,
    VerifyingFileSystemReader,
)
from tests.models import lm_loss, make_batch, sharded_packed_lm

__all__ = [
    "LR",
    "PG_TIMEOUT",
    "Fault",
    "FaultyReader",
    "FaultyWriter",
    "WarningRecords",
    "arm_commit_fault",
    "attempt",
    "checkpoint_dict",
    "die",
    "file_size_limit",
    "init_group",
    "live_state",
    "reader_factory",
    "resume_optimizer",
    "step",
    "target_state",
    "trained",
    "writer_factory",
]

LR = 0.05
# Peers of a dead rank see gloo's "connection closed" at once; this bounds real hangs.
PG_TIMEOUT = timedelta(seconds=30)

Action = Literal["raise", "kill", "stop"]


def init_group(rank: int, world_size: int) -> None:
    """Join the gloo group the harness's environment describes, with :data:`PG_TIMEOUT`."""
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=PG_TIMEOUT)


def die() -> NoReturn:
    """SIGKILL this process: no ``finally``, no ``atexit``, no flush (a preempted node)."""
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL did not kill the process")


@dataclasses.dataclass(frozen=True)
class Fault:
    """Fail (``"raise"``), die (``"kill"``) or hang (``"stop"``: SIGSTOP, as a process
    that stops answering without dying) on ``rank`` when ``phase`` is reached."""

    phase: str
    rank: int
    action: Action = "raise"

    def __post_init__(self) -> None:
        if self.action not in ("raise", "kill", "stop"):
            raise ValueError(
                f"Fault: action must be 'raise', 'kill' or 'stop', got {self.action!r}."
            )

    def reached(self, phase: str) -> None:
        """Inject this fault if ``phase`` is its phase and this process is its rank.

        Raises:
            OSError: ``ENOSPC``, naming the phase and rank, for ``action="raise"``.
        """
        if phase != self.phase or dist.get_rank() != self.rank:
            return
        if self.action == "kill":
            die()
        if self.action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)  # until SIGCONT or SIGKILL
            return
        raise OSError(errno.ENOSPC, f"injected failure at {phase} on rank {self.rank}")


class FaultyWriter(ChecksummingFileSystemWriter):
    """The default writer, with :class:`Fault` injected at the save phases."""

    def __init__(self, path: Path, *, fault: Fault) -> None:
        super().__init__(path)
        self.fault = fault

    def prepare_local_plan(self, plan: Any) -> Any:
        self.fault.reached("plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        self.fault.reached("global-plan")
        return super().prepare_global_plan(plans)

    def write_data(self, plan: Any, planner: Any) -> Any:
        self.fault.reached("write:before")
        written = super().write_data(plan, planner)
        written.wait()
        self.fault.reached("write:after")
        return written

    def finish(self, metadata: Any, results: Any) -> None:
        self.fault.reached("metadata")
        super().finish(metadata, results)


class FaultyReader(VerifyingFileSystemReader):
    """The default reader, with :class:`Fault` injected at the load phases."""

    def __init__(self, path: Path, *, fault: Fault) -> None:
        super().__init__(path)
        self.fault = fault

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self.fault.reached("read:metadata")
        return super().read_metadata(*args, **kwargs)

    def prepare_local_plan(self, plan: Any) -> Any:
        self.fault.reached("read:plan")
        return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        self.fault.reached("read:global-plan")
        return super().prepare_global_plan(plans)

    def read_data(self, plan: Any, planner: Any) -> Any:
        self.fault.reached("read:before")
        done = super().read_data(plan, planner)
        done.wait()
        self.fault.reached("read:after")
        return done


def writer_factory(fault: Fault) -> Any:
    """A ``storage_writer_factory`` building :class:`FaultyWriter`\\ s."""
    return functools.partial(FaultyWriter, fault=fault)


def reader_factory(fault: Fault) -> Any:
    """A ``storage_reader_factory`` building :class:`FaultyReader`\\ s."""
    return functools.partial(FaultyReader, fault=fault)


@contextlib.contextmanager
def arm_commit_fault(fault: Fault | None, *, rename_exchange: bool = True) -> Iterator[None]:
    """Install ``fault`` at the commit steps (``commit._FAULT_HOOK``) for a block.

    Args:
        fault: The fault, or ``None`` for none.
        rename_exchange: ``False`` forces the two-rename commit that systems without
            ``renameat2(RENAME_EXCHANGE)`` use.
    """
    commit._FAULT_HOOK = None if fault is None else fault.reached
    commit._USE_RENAME_EXCHANGE = rename_exchange
    try:
        yield
    finally:
        commit._FAULT_HOOK = None
        commit._USE_RENAME_EXCHANGE = True


@contextlib.contextmanager
def file_size_limit(limit: int | None) -> Iterator[None]:
    """Let this process write no file larger than ``limit`` bytes: a full disk, by the
    kernel (writes fail with ``EFBIG`` instead of raising ``SIGXFSZ``). ``None``: no-op."""
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


# ---------------------------------------------------------------------------- outcomes


def attempt(action: Callable[[], object]) -> str:
    """``"no error"``, or ``"<class>: <message>"`` of the ``CheckpointError`` ``action``
    raised (any other exception propagates)."""
    try:
        action()
    except CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


class WarningRecords(logging.Handler):
    """The messages of the warnings logged while attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ---------------------------------------------------------------------------- training


def trained(
    world_size: int, steps: int = 2, *, num_blocks: int = 2
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded :class:`~tests.models.PackedLM` and its Adam after ``steps`` steps."""
    enable_cpu_execution()
    model, optimizer = sharded_packed_lm(world_size, 0, lr=LR, num_blocks=num_blocks)
    for seed in range(steps):
        step(model, optimizer, seed)
    return model, optimizer


def step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One training step on batch ``seed`` (deterministic on every rank)."""
    lm_loss(model, make_batch(seed)).backward()
    optimizer.step()
    optimizer.zero_grad()


def live_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's and optimizer's state dicts, hooks attached: what the strategy saves,
    and, as load targets, the live tensors themselves (a load writes into the model)."""
    model_state = get_model_state_dict(model)
    optimizer_state: dict[str, Any] = {}
    if optimizer is not None:
        ensure_optimizer_state(optimizer)
        optimizer_state = get_optimizer_state_dict(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    state: dict[str, Any] = {"state_dict": model_state}
    if optimizer is not None:
        state["optimizer_states"] = [optimizer_state]
    return state


def checkpoint_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, global_step: int
) -> dict[str, Any]:
    """Lightning's checkpoint dict as ``MegatronFSDPStrategy.save_checkpoint`` hands it on."""
    return {
        **live_state(model, optimizer),
        "global_step": global_step,
        "epoch": 0,
        "loops": {"fit_loop": {"global_step": global_step}},
    }


def saved_on_store(
    rank: int,
    world_size: int,
    env: Mapping[str, str],
    url: str,
    global_step: int,
    *,
    timeout: timedelta = PG_TIMEOUT,
) -> tuple[nn.Module, torch.optim.Optimizer, MegatronFSDPCheckpointIO, str]:
    """Join the gloo group (the store's variables ``env`` set), train, and save
    ``global_step`` as ``<url>/last.ckpt``: the model, its Adam, the plugin and that URL."""
    os.environ.update(env)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    path = f"{url}/last.ckpt"
    plugin.save_checkpoint(checkpoint_dict(model, adam, global_step), path)
    return model, adam, plugin, path


def target_state(world_size: int, *, num_blocks: int = 2) -> tuple[nn.Module, Any, dict]:
    """A fresh all-zero model and Adam (state zeroed, lr 0) and their state as targets."""
    enable_cpu_execution()
    model, optimizer = sharded_packed_lm(world_size, None, lr=LR, num_blocks=num_blocks)
    return model, optimizer, zeroed_targets(model, optimizer)


def zeroed_targets(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """:func:`live_state` of ``model`` and ``optimizer`` as load targets, the optimizer's
    state zeroed and its lr 0, so a load must write every value a test compares."""
    state = live_state(model, optimizer)
    with torch.no_grad():
        for entries in state["optimizer_states"][0]["state"].values():
            for tensor in entries.values():
                tensor.zero_()
    for group in state["optimizer_states"][0]["param_groups"]:
        group["lr"] = 0.0
    return state


def resume_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, loaded: Mapping[str, Any]
) -> None:
    """Apply loaded optimizer hyper-parameters, as the strategy does after a load."""
    set_optimizer_state_dict(model, optimizer, loaded["optimizer_states"][0])
