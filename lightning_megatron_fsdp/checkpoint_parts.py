"""What a save writes: Lightning's dict split into tensors and the rest, and their digests.

Problem: Lightning hands the checkpoint IO one nested dict mixing sharded DTensors, plain
tensors and Python objects; DCP must get only the tensors, ``meta.pt`` the rest, an async
save a private copy of every tensor (training goes on mutating the live ones), and the ranks
one digest of every key, shape and dtype to agree on before anything is written.

How: pure functions over the dict, rank-local, no collective: :func:`_split_checkpoint`,
:func:`_stage` (copies that keep the chunk hooks), :func:`_layout_summary` and
:func:`_layout_disagreement`, :func:`_fill` (copy loaded values into the live targets), and
the package versions a manifest records.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import errno
import functools
import importlib.metadata
import io
import os
import posixpath
import sys
import threading
from collections.abc import Mapping, MutableMapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp.checksums import crc32c, crc32c_hex
from lightning_megatron_fsdp.manifest import (
    FileRecord,
    TensorSpec,
)
from lightning_megatron_fsdp.uneven_dtensor import CHUNK_ATTR

# Attributes uneven_dtensor attaches to a local shard; the staging copy keeps them.
_HOOK_ATTRS = ("__create_chunk_list__", "__create_write_items__", CHUNK_ATTR)


_BufferKey = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def _copy_tensor(
    tensor: torch.Tensor, spare: dict[_BufferKey, list[torch.Tensor]] | None = None
) -> torch.Tensor:
    """A CPU copy of ``tensor`` (``tensor.to("cpu", copy=True)``), written into a spare
    buffer of the same shape, strides and dtype when ``spare`` has one."""
    source = tensor.detach()
    buffers = spare.get((tuple(source.shape), source.stride(), source.dtype)) if spare else None
    if buffers:
        staged = buffers.pop().requires_grad_(False)
        staged.copy_(source)
    else:
        staged = source.to("cpu", copy=True)
    if staged.is_floating_point() or staged.is_complex():
        staged.requires_grad_(tensor.requires_grad)  # DCP records it in TensorProperties
    return staged


class _StagingBuffers:
    """The CPU copies an async save writes from, kept for the next async save.

    Copying a rank's state into freshly allocated memory costs a page fault per 4 KiB page
    on top of the copy: measured here, 400 MB took 0.15-0.24 s into new tensors and
    0.08 s into existing ones, and that copy is nearly all the time an async save blocks
    training. So the copies of one save are the buffers of the next (tensors of the same
    shape, strides and dtype; any other gets a new one, and buffers no longer needed are
    dropped). The next save starts only after the previous one finished (at most one is
    in flight), so no buffer is overwritten while it is being written.

    Cost: after the first async save the plugin holds one CPU copy of the rank's state
    until :meth:`release` (the plugin's ``teardown``), where it would otherwise hold it
    only while a save is in flight; the peak is the same. (torch's ``BlockingAsyncStager``
    offers the same trade as ``cache_staged_state_dict``.)
    """

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []

    def stage(self, obj: Any) -> Any:
        """:func:`_stage` ``obj``, reusing the previous save's copies."""
        spare: dict[_BufferKey, list[torch.Tensor]] = {}
        for buffer in self._held:
            key = (tuple(buffer.shape), buffer.stride(), buffer.dtype)
            spare.setdefault(key, []).append(buffer)
        staged = _stage(obj, spare=spare)
        held: dict[int, torch.Tensor] = {}
        _collect_tensors(staged, held)
        self._held = list(held.values())
        return staged

    def release(self) -> None:
        """Drop the buffers."""
        self._held = []


def _collect_tensors(obj: Any, found: dict[int, torch.Tensor]) -> None:
    """Every tensor of a staged tree (of a DTensor: its local shard) by ``id``,
    so a copy reachable twice (tied weights) is one buffer, never handed out twice."""
    if isinstance(obj, DTensor):
        found[id(obj._local_tensor)] = obj._local_tensor
    elif isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _collect_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_tensors(value, found)


def _stage(
    obj: Any,
    memo: dict[int, Any] | None = None,
    spare: dict[_BufferKey, list[torch.Tensor]] | None = None,
) -> Any:
    """Copy a nested state dict so training can go on while a background thread writes it.

    Tensors are copied to CPU memory (into ``spare`` buffers where one fits, see
    :class:`_StagingBuffers`). A DTensor is rebuilt around a copy of its local shard with
    the same spec, and the chunk hooks of ``uneven_dtensor`` are carried over
    unchanged, so DCP plans exactly the writes a synchronous save plans (the tests compare
    the files byte for byte). Tensors seen twice (tied weights) are copied once.

    Alternative rejected: torch's ``DefaultStager``. It copies whole storages and re-views
    them, which raises "invalid python storage" for shards that are views at an offset into
    a packed Megatron-FSDP buffer (torch 2.13), and it keeps the hooks only as a side
    effect of copying ``__dict__``.
    """
    memo = {} if memo is None else memo
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, DTensor):
        local = obj._local_tensor
        staged_local = _copy_tensor(local, spare)
        for attr in _HOOK_ATTRS:
            if attr in vars(local):
                setattr(staged_local, attr, vars(local)[attr])
        # DTensor.from_local would move the copy back to the mesh's device.
        staged: Any = DTensor(staged_local, obj._spec, requires_grad=False)
    elif isinstance(obj, torch.Tensor):
        staged = _copy_tensor(obj, spare)
    elif isinstance(obj, Mapping):
        staged = {key: _stage(value, memo, spare) for key, value in obj.items()}
    elif isinstance(obj, list):
        staged = [_stage(value, memo, spare) for value in obj]
    elif isinstance(obj, tuple):
        staged = tuple(_stage(value, memo, spare) for value in obj)
    else:
        staged = copy.deepcopy(obj)
    memo[id(obj)] = staged
    return staged


def _split_checkpoint(checkpoint: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split Lightning's checkpoint dict into DCP's tensor part and ``meta.pt``'s rest.

    Raises:
        TypeError: If the dict does not have the shape the strategy promises.
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}.")
    model = checkpoint.get("state_dict")
    if not isinstance(model, Mapping):
        raise TypeError(
            "checkpoint['state_dict'] must be an FQN-keyed model state dict (from "
            f"get_model_state_dict), got {type(model).__name__}."
        )
    tensors: dict[str, Any] = {"state_dict": model}
    if "optimizer_states" in checkpoint:
        optimizers = checkpoint["optimizer_states"]
        if not isinstance(optimizers, (list, tuple)) or not all(
            isinstance(o, Mapping) for o in optimizers
        ):
            raise TypeError(
                "checkpoint['optimizer_states'] must be a list of FQN-keyed optimizer state "
                f"dicts (from get_optimizer_state_dict), got {optimizers!r:.200}."
            )
        tensors["optimizer_states"] = list(optimizers)
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    return tensors, meta


def _layout_summary(tensors: Mapping[str, Any]) -> dict[str, str]:
    """Every leaf of the state to save, DCP-flattened (``state_dict.<fqn>``,
    ``optimizer_states.<i>.state.<fqn>.<name>``, ...), with its global shape and dtype.

    Rank-local; identical on every rank that saves the same model and optimizer state.
    Non-tensor values count by key only (``lr`` may be a float or a tensor).
    """
    summary: dict[str, str] = {}

    def visit(value: Any, path: tuple[str, ...]) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, (*path, str(key)))
        elif isinstance(value, list) and any(isinstance(v, (Mapping, list)) for v in value):
            for index, item in enumerate(value):
                visit(item, (*path, str(index)))
        else:
            summary[".".join(path)] = TensorSpec.of(value).describe()

    visit(tensors, ())
    return summary


def _listed(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return f"[{shown}{f', ... and {len(keys) - limit} more' if len(keys) > limit else ''}]"


def _layout_disagreement(layouts: list[dict[str, str]]) -> list[str]:
    """Say how each rank's layout differs from rank 0's (see :func:`_layout_summary`)."""
    reference, lines = layouts[0], []
    for rank, layout in enumerate(layouts[1:], start=1):
        extra = sorted(set(layout) - set(reference))
        lacking = sorted(set(reference) - set(layout))
        differ = sorted(k for k in set(layout) & set(reference) if layout[k] != reference[k])
        if extra:
            lines.append(f"rank {rank} has {len(extra)} key(s) rank 0 has not: {_listed(extra)}")
        if lacking:
            lines.append(f"rank {rank} lacks {len(lacking)} key(s) of rank 0: {_listed(lacking)}")
        lines += [
            f"rank {rank} {key!r}: {layout[key]}, rank 0: {reference[key]}" for key in differ[:10]
        ]
    lines.append(
        "The ranks disagree on the state to save. Every rank must pass the same keys with "
        "the same global shapes and dtypes: build the same model on every rank, and give "
        "every optimizer state for every parameter (ensure_optimizer_state) before saving."
    )
    return lines


def _fill(target: Any, source: Any) -> None:
    """Write what DCP read into ``source`` (a :func:`_stage` copy of ``target``) into
    ``target``, in place: tensors by ``copy_`` (a DTensor's local shard, no collective),
    other leaves by assignment, as an in-place ``dcp.load`` would have left them."""
    items = source.items() if isinstance(source, Mapping) else enumerate(source)
    for key, value in items:
        current = target[key]
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            if isinstance(current, DTensor):
                local = value._local_tensor if isinstance(value, DTensor) else value
                current._local_tensor.copy_(local)
            else:
                current.copy_(value)
        elif (isinstance(current, MutableMapping) and isinstance(value, Mapping)) or (
            isinstance(current, list) and isinstance(value, list) and len(current) == len(value)
        ):
            _fill(current, value)
        else:
            target[key] = value


@functools.cache
def _versions() -> dict[str, str]:
    """Package versions, looked up once per process (``importlib.metadata`` scans
    ``sys.path`` on every call); callers copy the dict."""
    versions = {"torch": torch.__version__}
    for key, distribution in (
        ("lightning", "lightning"),
        ("megatron_fsdp", "megatron-fsdp"),
        ("lightning_megatron_fsdp", "lightning-megatron-fsdp"),
    ):
        try:
            versions[key] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = "unknown"
    return versions


def _timeout_of(group: dist.ProcessGroup) -> timedelta:
    """The collective timeout of ``group``'s backend, or torch's default."""
    for device in getattr(group, "_device_types", []):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.default_pg_timeout


_RENAME_EXCHANGE_FLAG = 2  # linux/fs.h


_AT_FDCWD = -100


_EXCHANGE_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


@functools.cache
def _renameat2() -> Any:
    """libc's ``renameat2``, or ``None`` where there is none (not Linux, old glibc, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    function.restype = ctypes.c_int
    return function


def _exchange(a: Path, b: Path, *, use_exchange: bool = True) -> bool:
    """Atomically swap two existing directory entries; ``False`` where unsupported.

    Raises:
        OSError: If the exchange is supported but failed (say, permissions).
    """
    function = _renameat2() if use_exchange else None
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE_FLAG) == 0:
        return True
    code = ctypes.get_errno()
    if code in _EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(code, f"renameat2(RENAME_EXCHANGE): {os.strerror(code)}", str(a), None, str(b))


@dataclasses.dataclass(frozen=True)
class _SaveJob:
    """Everything the commit of one save needs, computed on the calling thread."""

    final: Any
    """The checkpoint: a local ``Path``, or a ``StoreCheckpoint`` on an object store."""
    staging: Any
    """Where this save writes: a hidden local directory, or the new version's prefix."""
    token: str
    write_checksums: bool
    manifest_fields: dict[str, Any]
    written: dict[str, FileRecord] = dataclasses.field(default_factory=dict)
    """Files this rank wrote itself outside DCP (rank 0's ``meta.pt``), as written."""
    store: Any = None
    """The ``ObjectStore`` of ``final``, or ``None`` on a local filesystem."""

    def file(self, name: str) -> Any:
        """``name`` inside the staging location."""
        return posixpath.join(self.staging, name) if self.store else Path(self.staging, name)


_BACKGROUND_NICE = 10
"""Nice increment of the async-save thread (Linux: per thread). Training keeps the core
when both want it; the save still progresses (weight 110 against 1024 under CFS)."""


def _lower_thread_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`_BACKGROUND_NICE`, where the OS
    allows it per thread (Linux); elsewhere a no-op.

    The async save's thread writes and hashes hundreds of MB while training runs: where
    the two share a core, the scheduler should favour training. Raising one's own nice
    value needs no privilege; the thread lives in the plugin's own one-thread executor,
    so no other work inherits the priority.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            tid = threading.get_native_id()
            os.setpriority(
                os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _BACKGROUND_NICE
            )


def _write_meta(path: Any, meta: dict[str, Any], job: _SaveJob) -> FileRecord:
    """``torch.save`` the non-tensor rest to ``path``, fsync'd; its size and CRC32C are
    taken from the bytes written (pickled in memory first: it is small)."""
    buffer = io.BytesIO()
    torch.save(meta, buffer)
    data = buffer.getbuffer()
    if job.store is not None:
        job.store.write_bytes(path, data)
    else:
        with open(path, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    digest = crc32c_hex(crc32c(data)) if job.write_checksums else None
    return FileRecord(size=data.nbytes, crc32c=digest)
