"""CPU copies of a state dict: the async save's private copy and the atomic load's buffer.

An async save must write a copy of every tensor while training goes on mutating the live
ones, and an atomic load reads into copies before touching the live ones; both keep the
chunk hooks of ``uneven_dtensor`` so DCP plans the same reads and writes as for the
originals. Reusing the previous save's copies avoids a page fault per 4 KiB page on the copy
that blocks training (docs/DESIGN.md, "Async save"; benchmarks/RESULTS.md).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.megatron import CHUNK_ATTR

__all__ = ["StagingBuffers", "fill", "stage"]

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


class StagingBuffers:
    """The CPU copies an async save writes from, kept as the buffers of the next one.

    Tensors of the same shape, strides and dtype are reused; others are allocated anew and
    buffers no longer needed dropped. At most one save is in flight, so no buffer is
    overwritten while it is written. Held until :meth:`release` (the plugin's ``teardown``).
    """

    def __init__(self) -> None:
        self._held: list[torch.Tensor] = []

    def stage(self, obj: Any) -> Any:
        """:func:`stage` ``obj``, reusing the previous save's copies."""
        spare: dict[_BufferKey, list[torch.Tensor]] = {}
        for buffer in self._held:
            key = (tuple(buffer.shape), buffer.stride(), buffer.dtype)
            spare.setdefault(key, []).append(buffer)
        staged = stage(obj, spare=spare)
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
        found[id(_torch.local_tensor(obj))] = _torch.local_tensor(obj)
    elif isinstance(obj, torch.Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            _collect_tensors(value, found)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_tensors(value, found)


def stage(
    obj: Any,
    memo: dict[int, Any] | None = None,
    spare: dict[_BufferKey, list[torch.Tensor]] | None = None,
) -> Any:
    """Copy a nested state dict so training can go on while a background thread writes it.

    Tensors are copied to CPU memory (into ``spare`` buffers where one fits, see
    :class:`StagingBuffers`). A DTensor is rebuilt around a copy of its local shard with
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
        local = _torch.local_tensor(obj)
        staged_local = _copy_tensor(local, spare)
        for attr in _HOOK_ATTRS:
            if attr in vars(local):
                setattr(staged_local, attr, vars(local)[attr])
        # DTensor.from_local would move the copy back to the mesh's device.
        staged: Any = _torch.dtensor_with_local(obj, staged_local)
    elif isinstance(obj, torch.Tensor):
        staged = _copy_tensor(obj, spare)
    elif isinstance(obj, Mapping):
        staged = {key: stage(value, memo, spare) for key, value in obj.items()}
    elif isinstance(obj, list):
        staged = [stage(value, memo, spare) for value in obj]
    elif isinstance(obj, tuple):
        staged = tuple(stage(value, memo, spare) for value in obj)
    else:
        staged = copy.deepcopy(obj)
    memo[id(obj)] = staged
    return staged


def fill(target: Any, source: Any) -> None:
    """Write what DCP read into ``source`` (a :func:`stage` copy of ``target``) into
    ``target``, in place: tensors by ``copy_`` (a DTensor's local shard, no collective),
    other leaves by assignment, as an in-place ``dcp.load`` would have left them."""
    items = source.items() if isinstance(source, Mapping) else enumerate(source)
    for key, value in items:
        current = target[key]
        if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
            if isinstance(current, DTensor):
                local = _torch.local_tensor(value) if isinstance(value, DTensor) else value
                _torch.local_tensor(current).copy_(local)
            else:
                current.copy_(value)
        elif (isinstance(current, MutableMapping) and isinstance(value, Mapping)) or (
            isinstance(current, list) and isinstance(value, list) and len(current) == len(value)
        ):
            fill(current, value)
        else:
            target[key] = value
