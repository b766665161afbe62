"""Replicated records read from storage once per load, then sent to the replicas.

DCP reads every rank's chunks independently: a tensor replicated across ranks (HSDP's
replica dimension, ``NO_SHARD``, a plain tensor such as Adam's ``step``, which every rank
holds whole) is fetched once per replica, so 64 replicas pull 64 times the checkpoint from
the bucket. Here each replicated target is read by one rank of its replica group, and after
the read each reader broadcasts what it read to its group. The reader of a record is the
rank that wrote it, where the load runs on as many ranks as the save: the record lies
among that rank's own, so it costs no request of its own (DCP's save spreads replicated
records over the ranks by size). Otherwise a group's targets, in state-dict order, are cut
into one run of about equal bytes per rank, so each rank reads adjacent records::

    HSDP (2, 1), tensors a b c d                 after dcp.load: broadcasts
               reads        receives             rank 0 -> rank 1: a b
    rank 0     a b          c d                  rank 1 -> rank 0: c d
    rank 1     c d          a b

A replica group is the process group of a DTensor's largest ``Replicate`` mesh dimension
(its other replicate dimensions, if any, keep reading), and the load's group for plain
tensors. Every rank of a group must hold the same targets for it, of the same chunks and
dtypes: each rank's digest per group, carried by the load's agreement round, checks that
before reading, and a group whose ranks disagree (a rank without some optimizer state, say)
reads as before, on every rank.
Every record read is still checked against its CRC32C by its reader; the broadcasts
carry what a check passed. The byte records every rank loads alike (a learning rate, Adam's
betas) travel the same way in the group of the load's ranks, from the rank that wrote them
(else the first): ``torch.save``-d by the reader and loaded by the others weights-only, as
the checkpoint's own byte records are, so on a store no rank asks for another's few bytes.

Alternatives rejected: a load planner that drops duplicate read items in its global plan
sees only the items, not the process groups that can carry them, and would need a group
per set of ranks (creating one is a collective of the whole world); reading every record
on one rank and scattering serialises the reads of a group.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import logging
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Set
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.agreement import Ranks, collective, describe
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.megatron import CHUNK_ATTR
from lightning_megatron_fsdp.storage import load_weights_only

__all__ = ["ReplicaPlan", "ReplicatedReads", "SavedLayout", "plan_replicated_reads"]

log = logging.getLogger(__name__)

#: Bytes one broadcast carries at most.
_BUCKET_BYTES = 256 * 1024 * 1024

#: The most bytes the padded all-gather of :func:`_exchange` may take (ranks times the
#: largest share); above it, each share goes in a broadcast of its own.
_EXCHANGE_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass
class _Target:
    """One replicated target and the rank of its group that reads it."""

    key: str
    """DCP's flat key (``state_dict.w``, ``optimizer_states.0.state.w.exp_avg``)."""
    tensor: Tensor
    """Where the values go: the local shard of a DTensor, a plain tensor itself."""
    source: int = 0
    """The index, in its group, of the rank that reads it."""
    whole: bool = False
    """A plain tensor every rank holds whole (Adam's ``step``, a buffer): small, so where
    readers are chosen by bytes the group's first rank reads them all."""
    writer: int | None = None
    """The (global) rank that wrote its record, where known and the world's size is the
    save's."""


@dataclasses.dataclass
class _Value:
    """A value the checkpoint stores as a byte record (a learning rate, say), which every
    rank loads alike, and the rank that reads it."""

    key: str
    """DCP's flat key (``optimizer_states.0.param_groups.0.lr``)."""
    container: MutableMapping[str, Any]
    """The mapping that holds it, in the load's state."""
    name: str
    """Its key in :attr:`container`."""
    source: int = 0
    """The index, in its group, of the rank that reads it."""


@dataclasses.dataclass
class _Group:
    """The replicated targets this rank shares with the ranks of one process group, and
    what its ranks compare (key, chunk, dtype, elements per target)."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    targets: list[_Target] = dataclasses.field(default_factory=list)
    values: list[_Value] = dataclasses.field(default_factory=list)
    descriptor: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ReplicatedReads:
    """Which replicated targets this rank reads, and the broadcasts that complete a load.

    Attributes:
        state: The load targets without the replicated ones other ranks read (containers
            copied where something was dropped; tensors shared): what to hand DCP.
        groups: The replica groups whose reads are shared, in an order every rank shares.
    """

    state: dict[str, Any]
    groups: list[_Group]

    def share(self, where: str, *, trust: bool = False) -> None:
        """After a successful read on every rank: each reader's replicated DTensor shards
        broadcast to its replica group, in buckets; then the plain tensors held whole and
        the values, every rank's share at once (:func:`_exchange`). Collective over every
        group of :attr:`groups`.

        Raises:
            PeerLostError: A collective failed (within the group's timeout).
            CheckpointError: A rank's values would not load weights-only (on every rank).
        """
        me = dist.get_rank() if self.groups else 0
        for replicas in self.groups:
            device = _bucket_device(replicas.group)
            for index, source in enumerate(replicas.ranks):
                mine = [
                    t
                    for t in replicas.targets
                    if t.source == index and not t.whole and t.tensor.numel()
                ]
                for bucket in _buckets(mine):
                    _broadcast(where, replicas, index, bucket, device, sending=source == me)
            if replicas.values or any(t.whole for t in replicas.targets):
                _exchange(where, replicas, device, trust)


@dataclasses.dataclass(frozen=True)
class SavedLayout:
    """What a load knows of a checkpoint before it reads: its keys, which of them it stores
    as byte records, and which rank of the saving group wrote a record (``None``: unknown,
    or the load runs on another number of ranks than the save, whose ranks are then not
    the load's)."""

    keys: Set[str]
    byte_keys: Set[str] = frozenset()
    writer: Callable[[str, tuple[int, ...]], int | None] | None = None


def plan_replicated_reads(
    state: dict[str, Any], saved: SavedLayout | None, ranks: Ranks
) -> ReplicaPlan:
    """This rank's replica groups of ``state``'s replicated targets, and the values every
    rank loads alike (byte records, in the group of the load's ranks), before the ranks
    compare them (rank-local).

    Args:
        state: The load targets (``{"state_dict": ..., "optimizer_states": [...]}``).
        saved: The checkpoint's layout; a target missing from its keys (a partial load)
            stays unread on every rank. ``None``: unknown, every rank reads everything.
        ranks: The load's ranks; plain tensors and values are replicated across them.

    Returns:
        The groups and their digests: the digests travel in the load's agreement round
        (:meth:`ReplicaPlan.settle` takes every rank's).
    """
    if saved is None or ranks.group is None or ranks.world_size == 1:
        return ReplicaPlan(state, {}, ())
    load_ranks = tuple(dist.get_process_group_ranks(ranks.group))
    writer = saved.writer or (lambda key, offsets: None)
    groups: dict[tuple[int, ...], _Group] = {}
    try:
        for key, value in _tensors(state, ""):
            if key not in saved.keys:
                continue
            found = _replica_group(value, ranks.group, load_ranks)
            if found is None:
                continue
            group, members, tensor, chunk = found
            replicas = groups.setdefault(members, _Group(group, members))
            whole = not isinstance(value, DTensor)
            offsets = (0,) * tensor.dim() if whole else tuple(chunk[0])
            wrote = _global(writer(key, offsets), load_ranks)
            replicas.targets.append(_Target(key, tensor, whole=whole, writer=wrote))
            replicas.descriptor.append((key, chunk, str(tensor.dtype), tensor.numel()))
        for key, container, name in _values(state, "", saved.byte_keys):
            everyone = groups.setdefault(load_ranks, _Group(ranks.group, load_ranks))
            wrote = _global(writer(key, ()), load_ranks)
            source = load_ranks.index(wrote) if wrote in load_ranks else 0
            everyone.values.append(_Value(key, container, name, source))
            everyone.descriptor.append(("bytes", key))
    except Exception as err:  # this rank reads all its targets; its groups' peers too
        log.warning("Every rank reads the replicated tensors it loads: %s", describe(err))
        groups = {}
    return ReplicaPlan(state, groups, load_ranks)


@dataclasses.dataclass
class ReplicaPlan:
    """This rank's replica groups and their digests, before the ranks compare them.

    Attributes:
        state: The load targets.
        groups: This rank's groups, by their ranks.
        load_ranks: The load's ranks, in group order (empty: nothing shared).
    """

    state: dict[str, Any]
    groups: dict[tuple[int, ...], _Group]
    load_ranks: tuple[int, ...]

    @functools.cached_property
    def digests(self) -> dict[tuple[int, ...], str]:
        """What the ranks of each group must agree on: its targets' keys, chunks, dtypes
        and sizes, digested (once: :meth:`settle` compares the value this rank sent)."""
        return {members: _digest(g.descriptor) for members, g in self.groups.items()}

    def settle(self, every: list[Any]) -> ReplicatedReads:
        """The reads shared in the groups whose ranks all sent this rank's digest.

        Args:
            every: Every load rank's :attr:`digests`, by its index in the load's group
                (``None`` for a rank that sent none).
        """
        if not self.load_ranks:
            return ReplicatedReads(self.state, [])
        digests = self.digests
        position = {rank: i for i, rank in enumerate(self.load_ranks)}
        agreed = [
            replicas
            for members, replicas in sorted(self.groups.items())
            if all((every[position[r]] or {}).get(members) == digests[members] for r in members)
        ]
        me = dist.get_rank()
        dropped: set[str] = set()
        for replicas in agreed:
            _spread(replicas)
            index = replicas.ranks.index(me)
            dropped.update(t.key for t in replicas.targets if t.source != index)
            dropped.update(v.key for v in replicas.values if v.source != index)
        return ReplicatedReads(_without(self.state, "", dropped), agreed)


def _tensors(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """The tensors (DTensors too) held in mappings of ``value``, by DCP's flat key."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            flat = f"{path}.{key}" if path else str(key)
            if isinstance(item, Tensor):
                yield flat, item
            else:
                yield from _tensors(item, flat)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            if not isinstance(item, Tensor):  # a tensor in a list stays read by every rank
                yield from _tensors(item, f"{path}.{index}" if path else str(index))


def _global(rank: int | None, load_ranks: tuple[int, ...]) -> int | None:
    """The global rank of the load's group rank ``rank`` (DCP names a file by the rank in
    the group that saved it, which is the load's where the world sizes match)."""
    return load_ranks[rank] if rank is not None and 0 <= rank < len(load_ranks) else None


def _values(
    value: Any, path: str, byte_keys: Set[str]
) -> Iterator[tuple[str, MutableMapping[str, Any], str]]:
    """The entries of mappings in ``value`` (not tensors) at ``byte_keys``: each flat key,
    its mapping and its name there."""
    if isinstance(value, MutableMapping):
        for key, item in value.items():
            flat = f"{path}.{key}" if path else str(key)
            if flat in byte_keys and not isinstance(item, Tensor):
                yield flat, value, key
            elif isinstance(item, (Mapping, list)):
                yield from _values(item, flat, byte_keys)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _values(item, f"{path}.{index}" if path else str(index), byte_keys)


def _replica_group(
    value: Tensor, load_group: dist.ProcessGroup, load_ranks: tuple[int, ...]
) -> tuple[dist.ProcessGroup, tuple[int, ...], Tensor, Any] | None:
    """The group whose ranks hold ``value``'s rows too, its ranks, the tensor to fill and
    its chunk; ``None`` for a tensor this rank alone holds."""
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        dims = [d for d, p in enumerate(value.placements) if p.is_replicate() and mesh.size(d) > 1]
        local = _torch.local_tensor(value)
        chunk = getattr(local, CHUNK_ATTR, None)
        if not dims or chunk is None or local.is_meta:
            return None
        dim = max(dims, key=mesh.size)
        group = mesh.get_group(dim)
        members = tuple(dist.get_process_group_ranks(group))
        if not set(members) <= set(load_ranks):
            return None
        return group, members, local, (tuple(chunk.offsets), tuple(chunk.sizes))
    if value.is_meta:
        return None
    return load_group, load_ranks, value, tuple(value.shape)


def _digest(descriptor: list[tuple[Any, ...]]) -> str:
    return hashlib.sha256(repr(descriptor).encode()).hexdigest()


def _spread(replicas: _Group) -> None:
    """Each target's reader, the same on every rank of the group: the rank that wrote it,
    where every non-empty target's writer is in the group. Otherwise the targets, in
    state-dict order (the order a save writes them), are cut into one run per rank of about
    equal bytes, so each rank reads adjacent records (one ranged request each where the
    store batches them), and plain tensors held whole go to the first rank: spread, each
    would cost a broadcast of the whole group for a few bytes."""
    index = {rank: i for i, rank in enumerate(replicas.ranks)}
    held = [t for t in replicas.targets if t.tensor.numel()]  # an empty one reads nothing
    if all(t.writer in index for t in held):
        for target in held:
            target.source = index[target.writer]
        return
    spread = [t for t in replicas.targets if not t.whole]
    total = sum(_nbytes(t.tensor) for t in spread)
    count = len(replicas.ranks)
    before = 0
    for target in spread:
        nbytes = _nbytes(target.tensor)
        middle = before + nbytes // 2
        target.source = min(count - 1, middle * count // total) if total else 0
        before += nbytes


def _nbytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _without(value: Any, path: str, dropped: set[str]) -> Any:
    """``value``'s containers copied, without the tensors at ``dropped`` keys."""
    if isinstance(value, Mapping):
        kept = {}
        for key, item in value.items():
            flat = f"{path}.{key}" if path else str(key)
            if flat in dropped:
                continue
            kept[key] = item if isinstance(item, Tensor) else _without(item, flat, dropped)
        return kept
    if isinstance(value, list):
        return [
            _without(item, f"{path}.{index}" if path else str(index), dropped)
            for index, item in enumerate(value)
        ]
    return value


def _bucket_device(group: dist.ProcessGroup) -> torch.device:
    """CUDA where the group has an NCCL backend (GPU targets travel by NCCL); CPU
    otherwise (gloo)."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _buckets(targets: list[_Target]) -> Iterator[list[_Target]]:
    """``targets`` in runs of at most :data:`_BUCKET_BYTES` (a larger target alone)."""
    bucket: list[_Target] = []
    size = 0
    for target in targets:
        nbytes = _nbytes(target.tensor)
        if bucket and size + nbytes > _BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(target)
        size += nbytes
    if bucket:
        yield bucket


def _as_bytes(tensor: Tensor) -> Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _exchange(where: str, replicas: _Group, device: torch.device, trust: bool) -> None:
    """The group's plain tensors held whole and its values, each from the rank that read it
    to the others, every rank's share at once: its tensors' bytes in target order, then its
    values ``torch.save``-d (loaded by the others weights-only unless ``trust``, as the
    checkpoint's own byte records are; the sender loads them so first, and a share that
    would not load fails every rank alike). Two collectives however many ranks read some:
    an all-gather of the shares' sizes, then one of the shares padded to the largest, or,
    where that would take more than :data:`_EXCHANGE_BYTES`, a broadcast per share.

    Raises:
        PeerLostError: A collective failed (within the group's timeout).
        CheckpointError: A rank's values would not load weights-only.
    """
    count = len(replicas.ranks)
    me = replicas.ranks.index(dist.get_rank())
    whole = [[t for t in replicas.targets if t.whole and t.source == i] for i in range(count)]
    values = [[v for v in replicas.values if v.source == i] for i in range(count)]
    share, problem = _pack(where, whole[me], values[me], trust)
    share = share.to(device)
    size = torch.tensor([-1 if problem else share.numel()], dtype=torch.int64, device=device)
    every = [torch.empty_like(size) for _ in range(count)]
    collective(where, dist.all_gather, every, size, group=replicas.group)
    sizes = [int(s.item()) for s in every]
    if min(sizes) < 0:
        failed = [replicas.ranks[i] for i, n in enumerate(sizes) if n < 0]
        raise CheckpointError(
            f"{where}: the byte records that rank(s) {failed} read would not load "
            f"weights-only ({problem or 'that rank raised the details'}); nothing was "
            "sent. Load with trust_checkpoint=True if you trust this checkpoint."
        )
    largest = max(sizes)
    if largest == 0:
        return
    if count * largest <= _EXCHANGE_BYTES:
        padded = torch.zeros(largest, dtype=torch.uint8, device=device)
        padded[: share.numel()] = share
        shares = [torch.empty_like(padded) for _ in range(count)]
        collective(where, dist.all_gather, shares, padded, group=replicas.group)
    else:
        shares = []
        for index, n in enumerate(sizes):
            data = share if index == me else torch.empty(n, dtype=torch.uint8, device=device)
            if n:
                collective(where, dist.broadcast, data, group=replicas.group, group_src=index)
            shares.append(data)
    for index, data in enumerate(shares):
        if index != me and sizes[index]:
            source = f"{where}: byte records from rank {replicas.ranks[index]}"
            _unpack(data[: sizes[index]], whole[index], values[index], source, trust)


def _pack(
    where: str, whole: list[_Target], values: list[_Value], trust: bool
) -> tuple[Tensor, str | None]:
    """This rank's share (see :func:`_exchange`), or why its values would not load."""
    parts = [_as_bytes(t.tensor).cpu() for t in whole]
    if values:
        buffer = io.BytesIO()
        try:
            torch.save({v.key: v.container[v.name] for v in values}, buffer)
            load_weights_only(buffer.getvalue(), source=where, trust=trust)
        except Exception as err:  # what every other rank would meet: refused on all
            return torch.empty(0, dtype=torch.uint8), describe(err)
        parts.append(torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8))
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)), None


def _unpack(
    data: Tensor, whole: list[_Target], values: list[_Value], source: str, trust: bool
) -> None:
    """Another rank's share (see :func:`_exchange`) into this rank's targets and values."""
    offset = _fill(whole, data)
    if values:
        loaded = load_weights_only(
            data[offset:].cpu().numpy().tobytes(), source=source, trust=trust
        )
        for value in values:
            value.container[value.name] = loaded[value.key]


def _broadcast(
    where: str,
    replicas: _Group,
    source: int,
    bucket: list[_Target],
    device: torch.device,
    *,
    sending: bool,
) -> None:
    """One bucket from the group's rank ``source`` into the others' targets."""
    total = sum(_nbytes(t.tensor) for t in bucket)
    if sending:
        data = torch.cat([_as_bytes(t.tensor).to(device) for t in bucket])
    else:
        data = torch.empty(total, dtype=torch.uint8, device=device)
    collective(where, dist.broadcast, data, group=replicas.group, group_src=source)
    if not sending:
        _fill(bucket, data)


def _fill(targets: list[_Target], data: Tensor) -> int:
    """``targets``' tensors from the bytes at the front of ``data``, in order; the bytes
    they took."""
    offset = 0
    with torch.no_grad():
        for target in targets:
            tensor = target.tensor
            received = data[offset : offset + _nbytes(tensor)]
            if offset % tensor.element_size():  # a dtype view needs aligned bytes
                received = received.clone()
            tensor.copy_(received.view(tensor.dtype).view(tensor.shape))
            offset += _nbytes(tensor)
    return offset
