"""The coordinator's part of a save's planning, in time linear in the records.

On the first save of a run, rank 0 turns every rank's local plan into the global plan and
``.metadata`` while every other rank waits in the gather. DCP's default planner does it in
three passes over the records: dedup, the global plan (each item rebuilt through
``dataclasses.replace`` to carry its index hint) and a validation that sweeps each tensor's
chunks along its largest dimension; a matrix wider than tall, split in row ranges across
thousands of ranks, keeps every chunk open in that sweep, so it compares every pair
(quadratic in the chunks per tensor). :func:`global_save_plan` gives the same global plan and
the same ``.metadata``, byte for byte, in time linear in the records: dedup resolves only the
records more than one rank holds, each item is copied shallowly with its hint, and the
validation sweeps along the dimension in which the chunks are spread most, where row ranges
that tile a tensor keep one chunk open at a time (and, where no two extents along it meet,
none is compared at all). The garbage collector stays out of it (see
:func:`_collector_paused`): its passes over the growing plan made the time grow faster than
the records. It still refuses chunks that overlap, leave
a hole or fall outside their tensor, with one error naming the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import math
import operator
from bisect import bisect_right, insort
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

__all__ = ["global_save_plan"]


def global_save_plan(
    all_plans: list[SavePlan], *, merge_planner_data: bool = True, to_lowest_rank: bool = False
) -> tuple[list[SavePlan], Metadata]:
    """DCP's global save plan and metadata for ``all_plans`` (what ``DefaultSavePlanner``'s
    dedup, ``create_default_global_save_plan`` and validation give), in linear time.

    Args:
        all_plans: Every rank's local plan, in rank order.
        merge_planner_data: Merge the plans' ``planner_data`` into the metadata's (DCP's
            ``flatten_state_dict``).
        to_lowest_rank: A record several ranks hold is written by the lowest of them, else by
            the one with the least planned so far (DCP's ``dedup_save_to_lowest_rank``).

    Returns:
        Each rank's plan (its items carrying their chunk's index hint) and the metadata.

    Raises:
        ValueError: If a tensor's chunks overlap, leave a hole or fall outside it, naming
            the tensor.
    """
    with _collector_paused():
        return _global_save_plan(all_plans, merge_planner_data, to_lowest_rank)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off (as it was, after): planning allocates a few
    acyclic objects per record, and each of the collector's passes, triggered by those
    allocations, would walk every object of the growing plan again and again. On the way
    out the plan joins the oldest generation unscanned (a freeze and a thaw, where nothing
    was frozen before): it outlives the save (DCP caches it), and the first allocation
    after re-enabling would otherwise scan every object allocated meanwhile as young."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def _global_save_plan(
    all_plans: list[SavePlan], merge_planner_data: bool, to_lowest_rank: bool
) -> tuple[list[SavePlan], Metadata]:
    plans = _dedup(all_plans, to_lowest_rank)
    entries: dict[str, Any] = {}
    global_plan = []
    byte_io, shard = WriteItemType.BYTE_IO, WriteItemType.SHARD
    for plan in plans:
        items = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type is byte_io:
                if fqn in entries:
                    raise AssertionError(f"`{fqn}`: two ranks write it as bytes, undeduplicated")
                entries[fqn] = BytesStorageMetadata()
                items.append(item)
                continue
            data = item.tensor_data
            chunk = None if data is None else data.chunk
            if chunk is None:
                raise AssertionError(f"`{fqn}`: a tensor write without its chunk")
            entry = entries.get(fqn)
            if entry is None:
                entry = entries[fqn] = TensorStorageMetadata(
                    properties=data.properties, size=data.size, chunks=[]
                )
            elif item.type is not shard:
                raise AssertionError(f"`{fqn}`: two ranks write it whole, undeduplicated")
            chunks = entry.chunks
            items.append(_with_hint(item, len(chunks)))
            chunks.append(chunk)
        global_plan.append(dataclasses.replace(plan, items=items))
    metadata = Metadata(entries)
    if merge_planner_data:
        merged: dict[str, Any] = {}  # dict(ChainMap(...))'s keys and values, in linear time
        for plan in reversed(global_plan):
            merged.update(plan.planner_data)
        metadata = dataclasses.replace(metadata, planner_data=merged)
    for fqn, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata):
            problem = _tiling_problem(entry, whole=len(global_plan) > 1)
            if problem:
                raise ValueError(
                    f"Planning the save: the chunks of `{fqn}` (size {tuple(entry.size)}) "
                    f"{problem}; each tensor's chunks must tile it exactly once. The sharded "
                    "state does not describe its tensors consistently: check that every rank "
                    "built the same model and sharding (a bug otherwise; please report it)."
                )
    return global_plan, metadata


def _dedup(all_plans: list[SavePlan], to_lowest_rank: bool) -> list[SavePlan]:
    """DCP's ``dedup_save_plans``, with its choices (and ties) exactly: a record several
    ranks hold stays in one plan, chosen in the order the records first appear. Only those
    records are resolved; a record one rank holds just counts towards its plan's size."""
    # Keyed by (fqn, offset), what ``MetadataIndex`` compares, hashed without a call.
    first: dict[tuple[str, Any], int] = {}
    shared: dict[tuple[str, Any], tuple[set[int], WriteItem]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            index = item.index
            key = (index.fqn, index.offset)
            known = len(first)
            holder = first.setdefault(key, rank)
            if len(first) == known:  # seen before, here or on another rank
                holders = shared[key][0] if key in shared else {holder}
                holders.add(rank)
                shared[key] = (holders, item)  # DCP sizes the last one seen
    if not shared:
        return all_plans
    sizes = [0] * len(all_plans)
    dropped: list[set[tuple[str, Any]]] = [set() for _ in all_plans]
    resolved: set[tuple[str, Any]] = set()
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            key = (item.index.fqn, item.index.offset)
            entry = shared.get(key)
            if entry is None:
                sizes[rank] += _storage_size(item)
            elif key not in resolved:
                resolved.add(key)
                holders, last = entry
                chosen = min(holders) if to_lowest_rank else min(holders, key=sizes.__getitem__)
                sizes[chosen] += _storage_size(last)
                for other in holders - {chosen}:
                    dropped[other].add(key)
    return [
        dataclasses.replace(
            plan, items=[i for i in plan.items if (i.index.fqn, i.index.offset) not in gone]
        )
        if gone
        else plan
        for plan, gone in zip(all_plans, dropped, strict=True)
    ]


def _storage_size(item: WriteItem) -> int:
    """``item.tensor_storage_size() or 1``, DCP's weight of a record in dedup."""
    data = item.tensor_data
    if data is None:
        return 1
    return math.prod(data.size) * data.properties.dtype.itemsize or 1


def _with_hint(item: WriteItem, hint: int) -> WriteItem:
    """``item`` with its index hint set to ``hint``: the same fields, in the same order, as
    ``dataclasses.replace`` gives (both objects are frozen dataclasses; shallow copies share
    the chunk and properties as DCP's do)."""
    index = object.__new__(MetadataIndex)
    fields = item.index.__dict__.copy()
    fields["index"] = hint
    object.__setattr__(index, "__dict__", fields)
    copied = object.__new__(WriteItem)
    fields = item.__dict__.copy()
    fields["index"] = index
    object.__setattr__(copied, "__dict__", fields)
    return copied


def _tiling_problem(entry: TensorStorageMetadata, *, whole: bool) -> str | None:
    """What is wrong with ``entry``'s chunks (out of bounds, overlapping, or, if
    ``whole``, not covering the tensor), or ``None``: DCP's checks, per dimension over
    columns of offsets and sizes, then a sweep along the dimension with the most distinct
    chunk offsets. Chunks whose extents along it do not meet (row ranges) need no pair
    compared; only where they meet are the chunks compared pairwise."""
    size = tuple(entry.size)
    if not size:
        return None
    chunks = entry.chunks
    offsets = [chunk.offsets for chunk in chunks]
    sizes = [chunk.sizes for chunk in chunks]
    if {*map(len, offsets), *map(len, sizes)} - {len(size)}:
        bad = next(c for c in chunks if not len(c.offsets) == len(c.sizes) == len(size))
        return f"include {_box(bad)}, outside the tensor"
    starts = [[o[d] for o in offsets] for d in range(len(size))]
    lengths = [[n[d] for n in sizes] for d in range(len(size))]
    ends = [list(map(operator.add, starts[d], lengths[d])) for d in range(len(size))]
    for d, extent in enumerate(size):
        if min(starts[d]) < 0 or min(lengths[d]) < 0 or max(ends[d]) > extent:
            bad = next(
                c
                for c in chunks
                if min(c.offsets) < 0
                or min(c.sizes) < 0
                or not all(map(operator.le, map(operator.add, c.offsets, c.sizes), size))
            )
            return f"include {_box(bad)}, outside the tensor"
    volume = sum(map(math.prod, sizes))
    if len(chunks) > 1:
        dims = range(len(size))
        sweep = max(dims, key=lambda d: (len(set(starts[d])), size[d]))
        keys = list(zip(starts[sweep], *starts, strict=True))
        order = sorted(range(len(chunks)), key=keys.__getitem__)
        first = [starts[sweep][i] for i in order]
        reach = list(itertools.accumulate((ends[sweep][i] for i in order), max))
        if not all(map(operator.ge, first[1:], reach)):  # some extents meet: compare them
            problem = _overlap_problem(chunks, order, sweep, dims)
            if problem:
                return problem
    if whole and volume != math.prod(size):
        return f"hold {volume} of its {math.prod(size)} elements: a hole"
    return None


def _overlap_problem(
    chunks: list[ChunkStorageMetadata], order: list[int], sweep: int, dims: range
) -> str | None:
    """The first two of ``chunks`` that overlap, in a sweep along ``sweep`` in ``order``."""
    active: list[tuple[int, int]] = []  # (end along the sweep, chunk), sorted
    for i in order:
        current = chunks[i]
        start = current.offsets[sweep]
        del active[: bisect_right(active, (start, len(chunks)))]
        for _, j in active:
            if _overlap(current, chunks[j], dims):
                return f"overlap: {_box(chunks[j])} and {_box(current)}"
        insort(active, (start + current.sizes[sweep], i))
    return None


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata, dims: range) -> bool:
    return all(
        a.offsets[d] < b.offsets[d] + b.sizes[d] and b.offsets[d] < a.offsets[d] + a.sizes[d]
        for d in dims
    )


def _box(chunk: ChunkStorageMetadata) -> str:
    return f"offsets {tuple(chunk.offsets)} sizes {tuple(chunk.sizes)}"
