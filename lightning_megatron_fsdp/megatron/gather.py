"""Full copies of sharded parameters, gradients and optimizer state, and gradient norms, for
Megatron-FSDP's packed shards: DTensor's own ``full_tensor`` and Lightning's ``grad_norm``
assume torch's canonical split and give wrong rows, hang or fail on them.
:func:`full_tensor`, :func:`bind_full_tensor`, :func:`grad_norm` (per parameter) and
:func:`sharded_grad_norm` (the total clipping uses) are the shard-aware replacements; both
norms come from one per-shard partial and one all-reduce per mesh group.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import grads as _lightning_grads
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron.uneven_dtensor import parameter_chunk

__all__ = [
    "bind_full_tensor",
    "full_tensor",
    "grad_norm",
    "grad_reduce_groups",
    "lightning_grad_norm_explained",
    "local_grad",
    "sharded_grad_norm",
]

_LIGHTNING_GRAD_NORM = _lightning_grads.grad_norm.__code__


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor behind a Megatron-FSDP parameter, gradient or optimizer state.

    Collective over the mesh dimension ``tensor`` is sharded on: every rank of it must
    call this for the same tensor (for example, all parameters in ``named_parameters()``
    order). A plain tensor is whole on every rank already and is returned detached.

    Args:
        tensor: A sharded parameter, its ``.grad``, an optimizer state tensor, or any
            ``Shard(0)`` DTensor whose shards are consecutive row ranges in rank order.

    Returns:
        A detached plain tensor of ``tensor``'s global shape, dtype and device,
        identical on every rank. It is not part of autograd.

    Raises:
        ValueError: If ``tensor`` is ``Partial`` (a deferred gradient between micro-batches)
            or sharded other than on dim 0 of one mesh dimension.
        AssertionError: If the shards do not tile the tensor's rows exactly once.
    """
    if not isinstance(tensor, DTensor):
        return tensor.detach()
    placements = tensor.placements
    if any(placement.is_partial() for placement in placements):
        raise ValueError(
            f"full_tensor: got a Partial DTensor ({placements}), a gradient still unreduced "
            "(HSDP, SHARD_OPTIMIZER and NO_SHARD reduce at the last micro-batch). Read it "
            "after the last micro-batch's backward (in on_before_optimizer_step), when "
            "Megatron-FSDP has reduced it."
        )
    sharded = [dim for dim, placement in enumerate(placements) if placement.is_shard()]
    local = _torch.local_tensor(tensor).detach()
    if not sharded:
        return local
    if len(sharded) > 1 or placements[sharded[0]].dim != 0:  # type: ignore[attr-defined]
        raise ValueError(
            f"full_tensor: expected Megatron-FSDP's Shard(0) on one mesh dimension, got "
            f"placements {placements}; use DTensor.full_tensor() for other layouts."
        )
    group = tensor.device_mesh.get_group(sharded[0])
    chunk = parameter_chunk(tensor)
    offset = int(chunk.offsets[0]) if chunk is not None else -1
    return _gather_rows(local, offset, tuple(tensor.shape), group)


def _gather_rows(
    local: Tensor, offset: int, shape: tuple[int, ...], group: dist.ProcessGroup
) -> Tensor:
    """All-gather each rank's rows (any count) and place them at their offsets."""
    world_size = dist.get_world_size(group)
    spans = torch.tensor([offset, local.shape[0]], dtype=torch.int64, device=local.device)
    gathered_spans = torch.empty(2 * world_size, dtype=torch.int64, device=local.device)
    dist.all_gather_single(gathered_spans, spans, group=group)
    offsets, rows = gathered_spans.view(world_size, 2).t().tolist()
    if all(o == -1 for o in offsets):  # no chunk metadata: rows are packed rank after rank
        offsets = [sum(rows[:rank]) for rank in range(world_size)]
    spans_by_rank = list(zip(offsets, rows, strict=True))
    covered = sorted(spans_by_rank)
    ends = [o + r for o, r in covered]
    if (
        covered[0][0] != 0
        or ends[-1] != shape[0]
        or any(o != end for (o, _), end in zip(covered[1:], ends[:-1], strict=True))
    ):
        raise AssertionError(
            f"full_tensor: the shards (row offset, rows) by rank {spans_by_rank} do "
            f"not tile the {shape[0]} rows of a tensor of shape {shape} exactly once; this "
            "is not a Megatron-FSDP layout this version understands."
        )
    most = max(rows)
    padded = local.new_zeros((most, *shape[1:]))
    padded[: local.shape[0]] = local
    slabs = local.new_empty((world_size * most, *shape[1:]))
    dist.all_gather_single(slabs, padded, group=group)
    full = local.new_empty(shape)
    for rank, (row_offset, count) in enumerate(zip(offsets, rows, strict=True)):
        full[row_offset : row_offset + count] = slabs[rank * most : rank * most + count]
    return full


def grad_norm(
    module: nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict[str, Tensor]:
    """Lightning's ``grad_norm`` for sharded gradients: each gradient's norm, and the total.

    Same keys as ``lightning.pytorch.utilities.grad_norm``
    (``grad_{p}_norm{sep}{name}`` per parameter with a gradient, ``grad_{p}_norm_total``),
    and the values DDP gives, so ``self.log_dict(grad_norm(self, 2))`` in
    ``on_before_optimizer_step`` logs the same numbers as under DDP. Each rank reduces its
    local shard; one all-reduce per mesh group adds them up (HSDP replicas counted once).

    Collective: call it on every rank, with the same parameters.

    Args:
        module: The module whose ``named_parameters()`` to inspect.
        norm_type: ``p`` of the p-norm; ``"inf"`` for the max norm.
        group_separator: Separator between the prefix and the parameter name.

    Returns:
        0-dim tensors, identical on every rank; empty if no parameter has a gradient.

    Raises:
        ValueError: If ``norm_type`` is not positive.
        RuntimeError: If a gradient is still ``Partial`` (between HSDP micro-batches).
    """
    norm_type, is_inf = _checked_norm_type(norm_type, "grad_norm")
    named = [(name, p) for name, p in module.named_parameters() if p.grad is not None]
    parameters = [p for _, p in named]
    reduced = [_local_partial_norm(p, norm_type, is_inf) for p in parameters]
    groups, _ = _shard_groups(parameters)
    for mesh, dims, indices in groups:  # one all-reduce per group: the partials stacked
        stacked = torch.stack([reduced[i] for i in indices])
        _all_reduce_over(stacked, mesh, dims, is_inf)
        for position, index in enumerate(indices):
            reduced[index] = stacked[position]
    prefix = f"grad_{norm_type}_norm"
    norms = {
        f"{prefix}{group_separator}{name}": (value if is_inf else value ** (1.0 / norm_type)).to(
            local_grad(parameter).dtype  # type: ignore[union-attr]
        )
        for (name, parameter), value in zip(named, reduced, strict=True)
    }
    if norms:
        stacked = torch.stack([value.float() for value in norms.values()])
        norms[f"{prefix}_total"] = stacked.norm(norm_type)
    return norms


def sharded_grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """Total gradient norm over parameters whose gradients are uneven Megatron-FSDP shards.

    Each rank sums ``|g|**p`` over its local shard, then one all-reduce per (mesh, sharded
    dims) adds the partial sums over the shard groups only, so HSDP replicas are not double
    counted. Plain-tensor gradients count once, locally. Parameters come in the same order
    on every rank (they are the optimizer's), so every rank issues the same collectives,
    even for a parameter whose local shard is empty.

    Args:
        parameters: Parameters (typically an optimizer's); those without ``.grad`` count 0.
        norm_type: ``p`` of the p-norm; ``math.inf`` for the max norm.

    Returns:
        The total norm as a float32 scalar tensor, identical on every rank.

    Raises:
        ValueError: If ``norm_type`` is not positive.
        RuntimeError: If a gradient is still ``Partial``.
    """
    norm_type, is_inf = _checked_norm_type(norm_type, "sharded_grad_norm")
    parameters = list(parameters)
    partials = [_local_partial_norm(p, norm_type, is_inf) for p in parameters]
    groups, plain = _shard_groups(parameters)
    device = partials[0].device if partials else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for mesh, dims, indices in groups:  # one all-reduce per group: the partials combined
        value = _combined([partials[i] for i in indices], is_inf)
        _all_reduce_over(value, mesh, dims, is_inf)
        total = _combine(total, value, is_inf)
    if plain:
        total = _combine(total, _combined([partials[i] for i in plain], is_inf), is_inf)
    return total if is_inf else total ** (1.0 / norm_type)


def _checked_norm_type(norm_type: float | int | str, caller: str) -> tuple[float, bool]:
    """``norm_type`` as a float, and whether it is the max norm."""
    value = float(norm_type)
    if not value > 0:
        raise ValueError(
            f"{caller}: norm_type must be a positive number or inf, got {norm_type!r}."
        )
    return value, math.isinf(value)


def _local_partial_norm(parameter: Tensor, norm_type: float, is_inf: bool) -> Tensor:
    """This rank's share of one gradient's norm: ``sum |g|^p`` (or ``max |g|``), fp32;
    zero without a gradient or with an empty shard."""
    local = local_grad(parameter)
    if local is None or local.numel() == 0:
        device = local.device if local is not None else parameter.device
        return torch.zeros((), dtype=torch.float32, device=device)
    if is_inf:
        return local.detach().abs().max().float()
    return torch.linalg.vector_norm(local.detach(), norm_type, dtype=torch.float32) ** norm_type


def _shard_groups(
    parameters: list[Tensor],
) -> tuple[list[tuple[DeviceMesh, tuple[int, ...], list[int]]], list[int]]:
    """The sharded parameters' indices by (mesh, sharded dims), in order of first
    appearance, and the plain parameters' indices. Rank-local: every rank lists the same
    groups in the same order when it passes the same parameters."""
    groups: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, tuple[int, ...], list[int]]] = {}
    plain: list[int] = []
    for index, parameter in enumerate(parameters):
        found = grad_reduce_groups(parameter)
        if found is None:  # a plain tensor: every rank holds all of it
            plain.append(index)
            continue
        mesh, dims = found
        groups.setdefault((id(mesh), dims), (mesh, dims, []))[2].append(index)
    return list(groups.values()), plain


def _all_reduce_over(value: Tensor, mesh: DeviceMesh, dims: tuple[int, ...], is_inf: bool) -> None:
    """Add up (or take the max of) ``value`` in place over the mesh dims it is sharded on."""
    op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
    for dim in dims:
        dist.all_reduce(value, op=op, group=mesh.get_group(dim))


def _combined(values: list[Tensor], is_inf: bool) -> Tensor:
    """``values`` summed (or their max) in order, as a new tensor."""
    total = values[0].clone()
    for value in values[1:]:
        total = _combine(total, value, is_inf)
    return total


def _combine(a: Tensor, b: Tensor, is_inf: bool) -> Tensor:
    return torch.maximum(a, b) if is_inf else a + b


def grad_reduce_groups(parameter: Tensor) -> tuple[DeviceMesh, tuple[int, ...]] | None:
    """Return the mesh and the mesh dims a parameter's gradient is sharded over.

    Dims with ``Replicate`` placement hold copies of the same shard (HSDP replicas), so a
    sum over the sharded dims alone counts every element once. ``None`` for a plain
    tensor, which every rank holds whole.

    Raises:
        RuntimeError: If the gradient is ``Partial`` (accumulation not finalised).
    """
    grad = parameter.grad
    spec_source = grad if isinstance(grad, DTensor) else parameter
    if not isinstance(spec_source, DTensor):
        return None
    if any(placement.is_partial() for placement in spec_source.placements):
        raise RuntimeError(
            "Sharded gradient norm or clipping: a gradient is still Partial (unreduced: HSDP, "
            "SHARD_OPTIMIZER and NO_SHARD reduce at the last micro-batch); read norms or clip "
            "only after the last micro-batch's backward, when Megatron-FSDP has finalised the "
            "gradients. Run accumulation through the strategy (it wraps the earlier "
            "micro-batches in megatron_fsdp.experimental.microbatch)."
        )
    dims = tuple(i for i, p in enumerate(spec_source.placements) if p.is_shard())
    return spec_source.device_mesh, dims


def local_grad(parameter: Tensor) -> Tensor | None:
    """This rank's shard of ``parameter.grad`` (the whole gradient for a plain tensor)."""
    grad = parameter.grad
    if grad is None:
        return None
    return _torch.local_tensor(grad) if isinstance(grad, DTensor) else grad


class _FullTensorMethod:
    """``tensor.full_tensor()`` of one sharded parameter or gradient: :func:`full_tensor`.

    Holds its tensor weakly (no reference cycle through the tensor's ``__dict__``), and
    pickles or deep-copies to an unbound method that explains itself, since a copy is no
    longer one of the model's sharded tensors.
    """

    def __init__(self, tensor: Tensor | None) -> None:
        self._tensor = weakref.ref(tensor) if tensor is not None else None

    def __call__(self, *, grad_placements: Any = None) -> Tensor:
        tensor = self._tensor() if self._tensor is not None else None
        if tensor is None:
            raise RuntimeError(
                "full_tensor(): this tensor is a copy of a Megatron-FSDP sharded tensor (or it "
                "outlived its model); call lightning_megatron_fsdp.full_tensor(tensor) instead."
            )
        if grad_placements is not None:
            raise ValueError(
                "full_tensor(grad_placements=...): the full tensor of a Megatron-FSDP "
                "parameter or gradient is a detached copy, outside autograd; call it "
                "without grad_placements."
            )
        return full_tensor(tensor)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_FullTensorMethod, (None,))


def bind_full_tensor(model: nn.Module, *, gradients: bool) -> None:
    """Make ``.full_tensor()`` of ``model``'s sharded parameters (or their gradients) safe.

    Rank-local. Sharded parameters live as long as the model, so binding them once
    after sharding lasts; Megatron-FSDP installs fresh gradient objects in backward, so
    gradients are bound after every backward, before user hooks read them.

    Args:
        model: A sharded model.
        gradients: Bind each sharded parameter's current ``.grad`` instead of the
            parameter.
    """
    for entry in _megatron.iter_sharded(model):
        target = entry.sharded.grad if gradients else entry.sharded
        if isinstance(target, DTensor) and not isinstance(
            target.__dict__.get("full_tensor"), _FullTensorMethod
        ):
            target.full_tensor = _FullTensorMethod(target)  # type: ignore[method-assign]


@contextlib.contextmanager
def lightning_grad_norm_explained() -> Iterator[None]:
    """Re-raise the error from Lightning's ``grad_norm`` on sharded gradients, explained.

    Lightning's function fails the same way on every rank, before any collective, so the
    clearer error is raised on every rank too.

    Raises:
        RuntimeError: Naming :func:`grad_norm`, chained from Lightning's error.
    """
    try:
        yield
    except Exception as err:
        if not _raised_in(err, _LIGHTNING_GRAD_NORM):
            raise
        raise RuntimeError(
            "lightning.pytorch.utilities.grad_norm cannot read Megatron-FSDP's sharded "
            "gradients (it builds one tensor from per-parameter DTensor norms). Use "
            "lightning_megatron_fsdp.grad_norm(self, norm_type) instead: the same keys and "
            "the values DDP gives; or lightning_megatron_fsdp.sharded_grad_norm("
            "self.parameters()) for the total alone."
        ) from err


def _raised_in(err: BaseException, code: Any) -> bool:
    traceback = err.__traceback__
    while traceback is not None:
        if traceback.tb_frame.f_code is code:
            return True
        traceback = traceback.tb_next
    return False
