"""Replicas that hold one model: every tensor replicated across ranks takes one source rank's
values, as DDP's broadcast at construction does. megatron-fsdp builds each rank's main
weights from the values that rank built, so in a replicated mode (``NO_SHARD``, the row axis
of HSDP) ranks seeded differently would otherwise train different models with averaged
gradients, and a checkpoint would keep one of them. :func:`sync_replicas` broadcasts, within
each replica group, the replicated main-weight buffers and the model's buffers from the
group's first rank; :class:`BufferSync` keeps buffers in step during training;
:func:`check_replicas` compares a checksum of every replicated tensor across its group and
raises one :class:`ReplicaMismatchError` on every rank.

A replica group is the set of ranks that hold the same rows of a tensor::

    HSDP device_mesh=(2, 2)            main weights: replicated down the columns
                 shard 0   shard 1     buffers: replicated over the whole world
    replica 0    rank 0    rank 1      sources: rank 0 for column 0, rank 1 for column 1
    replica 1    rank 2    rank 3      (rank 2 takes rank 0's shard, rank 3 rank 1's)

Fully sharded parameters (``FULL_SHARD``, ZeRO-1/2's main weights) have no replica: each
row lives on one rank, so they cost nothing here. Compute weights are not synchronised
themselves: they are refreshed from the main weights, as after a load.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_megatron_fsdp.agreement import Ranks, collective
from lightning_megatron_fsdp.megatron import _megatron

__all__ = ["BufferSync", "ReplicaMismatchError", "check_replicas", "sync_buffers", "sync_replicas"]

#: Bytes one coalesced broadcast carries at most (DDP buckets its broadcast at 250 MB).
_BUCKET_BYTES = 256 * 1024 * 1024


class ReplicaMismatchError(RuntimeError):
    """Ranks that should hold the same tensor hold different values."""


@dataclasses.dataclass
class _ReplicaSet:
    """Tensors replicated across one group of ranks (its first rank is the source)."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    main_weights: list[Tensor] = dataclasses.field(default_factory=list)
    buffers: list[Tensor] = dataclasses.field(default_factory=list)
    named: list[tuple[str, Tensor]] = dataclasses.field(default_factory=list)
    written_groups: list[_megatron.FsdpParameterGroup] = dataclasses.field(default_factory=list)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _replica_sets(model: nn.Module, *, parameters: bool) -> list[_ReplicaSet]:
    """This rank's replica sets, in an order every rank shares (mesh dim, then the world).

    Sets with the same ranks are merged (``NO_SHARD``'s main weights and the buffers form
    one), so each group gets one coalesced round. Rank-local, no collective.
    """
    world = _world()
    if world == 1:
        return []
    sets: dict[tuple[int, ...], _ReplicaSet] = {}
    if parameters:
        names = {id(p): n for n, p in model.named_parameters()}
        for group in _megatron.parameter_groups(model):
            mesh = _megatron.group_mesh(group)
            for dim in _megatron.replicated_mesh_dims(group):
                process_group = mesh.get_group(dim)
                ranks = tuple(dist.get_process_group_ranks(process_group))
                if len(ranks) == 1:
                    continue
                replicas = sets.setdefault(ranks, _ReplicaSet(process_group, ranks))
                replicas.main_weights.append(_megatron.main_weight_storage(group))
                replicas.written_groups.append(group)
                for entry in _megatron.entries(group):
                    name = names.get(id(entry.sharded), entry.fqns[0])
                    local = _megatron.main_weight_local(group, entry.index)
                    replicas.named.append((name, local))
    buffers = [(name, b) for name, b in model.named_buffers() if b is not None]
    if buffers:
        ranks = tuple(range(world))
        replicas = sets.setdefault(ranks, _ReplicaSet(dist.group.WORLD, ranks))
        replicas.buffers.extend(b for _, b in buffers)
        replicas.named.extend((f"{name} (buffer)", b) for name, b in buffers)
    return list(sets.values())


def _bytes(tensor: Tensor) -> Tensor:
    """A flat ``uint8`` view of a contiguous tensor (so one broadcast carries every dtype)."""
    return tensor.view(-1).view(torch.uint8)


def _broadcast_from_first(replicas: _ReplicaSet) -> None:
    """Give every rank of ``replicas`` its first rank's values, in buckets of bytes.

    Main weights too large for a bucket are broadcast in place; everything else travels
    through a scratch bucket and is written only where it differs, so a buffer that autograd
    saved for a backward still pending (a mask) keeps its version when its value is the same.
    """
    source = dist.get_rank() == replicas.ranks[0]
    pending: list[Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal pending, size
        if not pending:
            return
        bucket = torch.cat([_bytes(t) for t in pending])
        dist.broadcast(bucket, group=replicas.group, group_src=0)
        if not source:
            offset = 0
            for tensor in pending:
                received = bucket[offset : offset + tensor.numel() * tensor.element_size()]
                offset += received.numel()
                if not torch.equal(_bytes(tensor), received):
                    _bytes(tensor).copy_(received)
        pending, size = [], 0

    for tensor, in_place in _tensors(replicas):
        nbytes = tensor.numel() * tensor.element_size()
        if in_place and nbytes > _BUCKET_BYTES:
            dist.broadcast(_bytes(tensor), group=replicas.group, group_src=0)
            continue
        if size + nbytes > _BUCKET_BYTES:
            flush()
        pending.append(tensor)
        size += nbytes
    flush()


def _tensors(replicas: _ReplicaSet) -> Iterable[tuple[Tensor, bool]]:
    for tensor in replicas.main_weights:
        yield tensor, True
    for tensor in replicas.buffers:
        if not tensor.is_contiguous():
            raise AssertionError("module buffers are expected to be contiguous")
        yield tensor, False


def sync_replicas(model: nn.Module) -> None:
    """Give every replicated tensor of ``model`` its replica group's first rank's values.

    Replicated main weights (the compute weights are refreshed from them) and every buffer.
    One coalesced broadcast round per replica group this rank belongs to; nothing for a
    model without replicated tensors. Collective over every rank of the model's mesh.
    """
    sets = _replica_sets(model, parameters=True)
    if sets:
        _megatron.release_prefetched(model)
    for replicas in sets:
        _broadcast_from_first(replicas)
        for group in replicas.written_groups:
            _megatron.sync_group_compute_weights(group)


def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (one coalesced broadcast; none without buffers)."""
    for replicas in _replica_sets(model, parameters=False):
        _broadcast_from_first(replicas)


class BufferSync:
    """Buffers that forwards change (``BatchNorm`` running stats) kept in step, as DDP does.

    DDP (``broadcast_buffers=True``) broadcasts rank 0's buffers before every training
    forward. This broadcasts them right after the backward instead (when autograd no longer
    holds the buffers), which gives every forward the same buffers as DDP's and rank 0 the
    same trajectory, and leaves the replicas equal at rest: after a step, for an
    evaluation, in a checkpoint. A training forward not followed by a backward is
    synchronised before the next forward or save. Every rank must make the same calls
    (they are collectives).
    """

    def __init__(self) -> None:
        self._diverged = False

    def before_forward(self, model: nn.Module, *, training: bool) -> None:
        """Call right before a forward (``training``: a backward will follow it)."""
        self.settle(model)
        self._diverged = training

    def settle(self, model: nn.Module) -> None:
        """Broadcast rank 0's buffers if a training forward ran since the last broadcast;
        call after each backward and before a save."""
        if self._diverged:
            sync_buffers(model)
            self._diverged = False


def _checksums(names: list[str], tensors: list[Tensor]) -> Tensor:
    """The names' CRC-32, then per tensor the XOR of its elements' bit patterns
    (``torch.hash_tensor``), as one ``int64`` tensor on the tensors' device. Any difference
    shows except one that cancels in the XOR (two swapped elements)."""
    device = tensors[0].device
    values = [torch.tensor(zlib.crc32("\0".join(names).encode()), device=device)]
    for tensor in tensors:
        if tensor.numel():
            values.append(torch.hash_tensor(tensor.reshape(-1)).to(device).view(torch.int64))
        else:
            values.append(torch.zeros((), dtype=torch.int64, device=device))
    return torch.stack(values)


def check_replicas(model: nn.Module, where: str) -> None:
    """Raise on every rank if some replicated tensor of ``model`` differs within its group.

    One all-gather of per-tensor checksums per replica group this rank belongs to; when a
    group does not span the world, one all-reduce of a flag tells every rank whether any
    group differs (and only then a round for the details). Nothing for a model without
    replicated tensors.

    Args:
        model: A sharded model.
        where: What just happened, e.g. ``"MegatronFSDPStrategy: after setup"``.

    Raises:
        ReplicaMismatchError: Naming the first tensor whose replicas differ in each
            replica group, which ranks hold other values than the group's source rank,
            and what to do.
        PeerLostError: If a collective failed (within the group's timeout).
    """
    sets = _replica_sets(model, parameters=True)
    if not sets:
        return
    problems: list[str] = []
    for replicas in sets:
        names = [name for name, _ in replicas.named]
        mine = _checksums(names, [t for _, t in replicas.named])
        gathered = mine.new_empty(len(replicas.ranks) * mine.numel())
        collective(where, dist.all_gather_into_tensor, gathered, mine, group=replicas.group)
        rows = gathered.view(len(replicas.ranks), -1).cpu().tolist()
        problem = _first_difference(names, replicas.ranks, rows)
        if problem is not None:
            problems.append(problem)
    if any(len(replicas.ranks) != _world() for replicas in sets):
        # Not every rank saw every group: agree on whether any group differs.
        flag = torch.tensor([len(problems)], device=sets[0].named[0][1].device)
        collective(where, dist.all_reduce, flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        every = Ranks.of().all_gather(problems)
        problems = list(dict.fromkeys(p for rank_problems in every for p in rank_problems))
    if problems:
        raise ReplicaMismatchError(
            "\n".join(
                [
                    f"{where}: replicated tensors differ: {problems[0]}",
                    *(f"  - {p}" for p in problems[1:]),
                    "Replicas must hold one model: set up the model on every rank the same "
                    "way (the strategy gives each replica its group's first rank's values at "
                    "setup) and change replicated tensors only through training steps or "
                    "loads, which every rank runs alike; or pass check_replicas=False to skip "
                    "this check.",
                ]
            )
        )


def _first_difference(
    names: list[str], ranks: tuple[int, ...], gathered: list[list[int]]
) -> str | None:
    """The first tensor whose checksum differs from the source rank's, as one line."""
    if any(row[0] != gathered[0][0] for row in gathered):
        return f"replica group {list(ranks)}: the ranks hold different sets of tensors"
    for index, name in enumerate(names, 1):
        others = [
            r for r, row in zip(ranks, gathered, strict=True) if row[index] != gathered[0][index]
        ]
        if others:
            return (
                f"{name!r}: rank(s) {others} hold other values than rank {ranks[0]}, the "
                f"source of replica group {list(ranks)}"
            )
    return None
