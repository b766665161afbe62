"""Distributed-checkpoint chunk metadata for Megatron-FSDP's packed parameter buffers: a packed
shard does not tile the way torch's canonical ``Shard(0)`` does, so DCP's default planner
would misplace it. :func:`chunk_metadata_by_fqn` derives each shard's true chunk from the
layout that backs the buffer, rank-locally, and :func:`attach_uneven_dtensor_metadata`
attaches it through DCP's chunk hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron._megatron import DBuffer

__all__ = ["attach_uneven_dtensor_metadata", "chunk_metadata_by_fqn", "parameter_chunk"]

_OPTIMIZER_STATE_KEY = "state"

# Attribute set on a local tensor once hooks are attached, holding the chunk. It lets a
# later re-attach (same state dict saved twice) verify instead of silently overwrite, and
# lets tests and the async-save staging path read the chunk back.
CHUNK_ATTR = "_lmf_chunk"


def _dbuffer_chunk_metadata(buffer: DBuffer, index: int) -> ChunkStorageMetadata:
    """Return the chunk of logical tensor ``index`` this rank holds in ``buffer``.

    Flat placements shard the flat buffer, and every logical tensor is row-aligned within
    it (``GlobalLayout`` aligns each tensor to its row size and every shard boundary to the
    lcm of all row sizes), so a rank always owns whole dim-0 rows and the chunk is a dim-0
    range of the global tensor. Ranks own ascending buffer ranges, so the rows of one
    tensor are laid out rank after rank: the chunk's offset equals the number of rows all
    lower ranks own, which is exactly what a gather of every shard's size would compute.

    An empty shard (this rank owns none of the tensor) is reported as zero rows at the
    offset where the tensor's rows owned by lower ranks end: 0 if the tensor starts after
    this rank's range, all rows if it ends before.

    Args:
        buffer: Buffer holding the logical tensor.
        index: Index of the logical tensor within ``buffer``.

    Returns:
        This rank's chunk offset and size, in global tensor coordinates.

    Raises:
        AssertionError: If the owned range does not preserve dim-0 row boundaries, which
            would mean the layout invariants of megatron-fsdp changed.
    """
    owned = _megatron.owned_range(buffer, index)
    shape, first_element, numel = owned.shape, owned.first_element, owned.numel
    row_size = shape[1:].numel()  # DBuffer refuses 0-D tensors, so dim 0 exists
    if first_element % row_size or numel % row_size:
        raise AssertionError(
            f"Tensor {index} of shape {tuple(shape)}: this rank owns elements "
            f"[{first_element}, {first_element + numel}), which is not a whole number of "
            f"{row_size}-element rows. megatron-fsdp's GlobalLayout row-alignment invariant "
            "no longer holds; this version of megatron-fsdp is not supported."
        )
    return _build_chunk_metadata(first_element // row_size, numel // row_size, shape)


def _build_chunk_metadata(row_offset: int, rows: int, shape: torch.Size) -> ChunkStorageMetadata:
    """Build chunk metadata for a dim-0 row range of a tensor of shape ``shape``.

    Raises:
        ValueError: If the row range does not fit in ``shape``.
    """
    if not shape:
        raise ValueError(f"A dim-0 row range needs a tensor of at least 1 dim, got shape {shape}.")
    if row_offset < 0 or rows < 0 or row_offset + rows > shape[0]:
        raise ValueError(
            f"Row range [{row_offset}, {row_offset + rows}) does not fit in dim 0 of shape "
            f"{tuple(shape)}."
        )
    return ChunkStorageMetadata(
        offsets=torch.Size((row_offset, *(0 for _ in shape[1:]))),
        sizes=torch.Size((rows, *shape[1:])),
    )


def parameter_chunk(parameter: torch.Tensor) -> ChunkStorageMetadata | None:
    """This rank's chunk of one resting sharded parameter; ``None`` for any other tensor.

    Rank-local, like :func:`chunk_metadata_by_fqn`, for a single parameter.
    """
    group = _megatron.group_of(parameter)
    if group is None:
        return None
    for entry in _megatron.entries(group):
        if entry.sharded is parameter:
            return _dbuffer_chunk_metadata(_megatron.main_weight(group), entry.index)
    return None


def chunk_metadata_by_fqn(model: nn.Module) -> dict[str, ChunkStorageMetadata]:
    """Return this rank's chunk of every Megatron-FSDP parameter in ``model``, keyed by FQN.

    The keys are the parameter FQNs that torch's DCP state-dict helpers use for both the
    model state dict and the per-parameter entries of the optimizer state dict (wrapper
    prefixes such as ``_orig_mod.`` or ``_checkpoint_wrapped_module.`` removed).

    Rank-local: reads the layout and the owned range of each parameter's main-weight
    buffer; issues no collective.

    Args:
        model: A module tree that has been sharded with megatron-fsdp's ``fully_shard``
            and is at rest (not inside forward or backward).

    Returns:
        Chunk metadata for each sharded parameter, and nothing for parameters FSDP does
        not own. Tied parameters appear once per FQN, all sharing the one chunk of the
        buffer entry that backs them.

    Raises:
        ValueError: If ``model`` holds no Megatron-FSDP parameter (never sharded), or an
            FSDP parameter is currently unsharded (called during forward/backward).
    """
    fqns_of = _FqnResolver(model)
    chunks: dict[str, ChunkStorageMetadata] = {}
    # Per group, sharded parameter identity -> buffer index; built once per group so the
    # whole walk stays linear in the number of parameters.
    indices: dict[int, dict[int, int]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        group = _megatron.group_of(parameter)
        if group is None:
            continue
        group_indices = indices.get(id(group))
        if group_indices is None:
            group_indices = {id(e.sharded): e.index for e in _megatron.entries(group)}
            indices[id(group)] = group_indices
        index = group_indices.get(id(parameter))
        if index is None:
            raise ValueError(
                f"Parameter {name!r} belongs to a Megatron-FSDP parameter group but is not one "
                "of its sharded parameters: the model is unsharded (inside forward or "
                "backward). Take state dicts only between training steps."
            )
        chunk = _dbuffer_chunk_metadata(_megatron.main_weight(group), index)
        for fqn in fqns_of(name):
            chunks[fqn] = chunk
    if not chunks:
        raise ValueError(
            f"chunk_metadata_by_fqn: {type(model).__name__} holds no Megatron-FSDP parameter. "
            "Expected a model sharded with megatron_fsdp.experimental.fully_shard (or "
            "MegatronFSDPStrategy); shard it before taking checkpoint metadata."
        )
    return chunks


class _FqnResolver:
    """Map ``named_parameters`` names to DCP state-dict FQNs, resolving each module once.

    torch's ``_get_fqns`` walks the module path to drop wrapper prefixes (``_orig_mod.``,
    ``_checkpoint_wrapped_module.``, ...); the prefix mapping is the same for every
    parameter of one module, so it is computed per module path, not per parameter.
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._prefixes: dict[str, set[str]] = {}

    def __call__(self, name: str) -> set[str]:
        module_path, _, leaf = name.rpartition(".")
        prefixes = self._prefixes.get(module_path)
        if prefixes is None:
            prefixes = {
                fqn[: -len(leaf)]
                for fqn in _torch.fqns_of(self._model, name)
                if fqn == leaf or fqn.endswith(f".{leaf}")
            }
            if not prefixes:  # A wrapper renamed the leaf itself: no shortcut.
                return _torch.fqns_of(self._model, name)
            self._prefixes[module_path] = prefixes
        return {prefix + leaf for prefix in prefixes}


def attach_uneven_dtensor_metadata(
    model: nn.Module,
    model_state_dict: dict[str, Any],
    optimizer_state_dict: dict[str, Any],
) -> None:
    """Attach Megatron-FSDP chunk metadata to the sharded DTensors DCP will save or load.

    Call it on the state dicts right before ``dcp.save`` or ``dcp.load``; both then
    place every shard at its true global offset. Optimizer state is allocated as
    ``zeros_like`` of a sharded parameter, so it shares that parameter's chunk.

    Rank-local: no collective, so it cannot hang and costs no communication.

    Args:
        model: The sharded module tree the state dicts were taken from.
        model_state_dict: Model state dict from
            ``torch.distributed.checkpoint.state_dict.get_model_state_dict``.
        optimizer_state_dict: Optimizer state dict from
            ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
            (FQN-keyed); may be empty.

    Errors are rank-local too: each rank raises from its own inputs. Structural errors
    (an unknown FQN, a flattened optimizer state dict, an unsharded model) raise on every
    rank alike, since every rank holds the same keys; a shape error can hit one rank
    alone, so a caller about to enter a collective (``dcp.save``/``dcp.load``) must agree
    on failure first, for example by all-reducing an error flag.

    Raises:
        KeyError: If a state dict holds a DTensor under an FQN Megatron-FSDP does not own,
            or anywhere this function does not look (outside ``model_state_dict[fqn]``
            and ``optimizer_state_dict["state"][fqn][name]``, as in an optimizer state
            dict taken with ``flatten_optimizer_state_dict=True``): left alone, DCP would
            save it at canonical ``Shard(0)`` offsets, which are wrong for packed shards.
        ValueError: If a DTensor's local shape disagrees with its chunk, a chunk does not
            fit the DTensor's global shape, the DTensor already carries a different
            chunk, or ``model`` was never sharded.
        TypeError: If ``optimizer_state_dict["state"]`` is not a mapping.
    """
    chunks = chunk_metadata_by_fqn(model)
    optimizer_state = optimizer_state_dict.get(_OPTIMIZER_STATE_KEY, {})
    if not isinstance(optimizer_state, Mapping):
        raise TypeError(
            f"optimizer_state_dict[{_OPTIMIZER_STATE_KEY!r}] must map parameter FQNs to "
            f"state dicts, got {type(optimizer_state).__name__}."
        )
    attached: set[int] = set()
    _attach_by_fqn(model_state_dict, chunks, attached, where="model_state_dict")
    _attach_by_fqn(
        optimizer_state, chunks, attached, where=f"optimizer_state_dict[{_OPTIMIZER_STATE_KEY!r}]"
    )
    for root, state_dict in (
        ("model_state_dict", model_state_dict),
        ("optimizer_state_dict", optimizer_state_dict),
    ):
        for path, dtensor in _iter_dtensors(state_dict, root):
            if id(dtensor) not in attached:
                raise KeyError(
                    f"DTensor at {path} is outside the FQN-keyed entries "
                    "attach_uneven_dtensor_metadata handles (model_state_dict[fqn], "
                    f"optimizer_state_dict[{_OPTIMIZER_STATE_KEY!r}][fqn][name]), so DCP would "
                    "place it at canonical Shard(0) offsets, which are wrong for packed "
                    "Megatron-FSDP shards. Pass state dicts from get_model_state_dict and "
                    "get_optimizer_state_dict with default options (not "
                    "flatten_optimizer_state_dict=True), or move the DTensor out."
                )


def _iter_dtensors(value: Any, path: str) -> Iterator[tuple[str, DTensor]]:
    """Yield every DTensor nested in mappings, lists and tuples of ``value``, with its path."""
    if isinstance(value, DTensor):
        yield path, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _iter_dtensors(item, f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _iter_dtensors(item, f"{path}[{index}]")


def _attach_by_fqn(
    state_dict: Mapping[str, Any],
    metadata_by_fqn: Mapping[str, ChunkStorageMetadata],
    attached: set[int],
    *,
    where: str,
) -> None:
    """Attach chunk metadata to the DTensors of a parameter-FQN-keyed state dict.

    Each value is either a parameter's tensor, as in a model state dict, or a mapping of
    that parameter's state tensors, as in the per-parameter entries of an optimizer state
    dict. Plain tensors (buffers, optimizer step counters) are left to DCP's default.

    Args:
        state_dict: The FQN-keyed mapping.
        metadata_by_fqn: Chunks from :func:`chunk_metadata_by_fqn`.
        attached: Receives ``id()`` of every DTensor handled, so the caller can find the
            ones it did not reach.
        where: Name of ``state_dict`` for error messages.

    Raises:
        KeyError: If a DTensor sits under an FQN missing from ``metadata_by_fqn``.
    """
    for fqn, value in state_dict.items():
        tensors = value.items() if isinstance(value, Mapping) else ((None, value),)
        for state_name, tensor in tensors:
            if not isinstance(tensor, DTensor):
                continue
            chunk = metadata_by_fqn.get(fqn)
            key = f"{where}[{fqn!r}]" if state_name is None else f"{where}[{fqn!r}][{state_name!r}]"
            if chunk is None:
                raise KeyError(
                    f"DTensor {key} (FQN {fqn!r}) is not a Megatron-FSDP parameter of this "
                    "model: no chunk metadata for that FQN. Expected every DTensor in the "
                    "state dict to be a parameter (or its optimizer state) sharded by "
                    "fully_shard; remove it, or shard its module with Megatron-FSDP."
                )
            _attach_dcp_hooks(tensor, chunk, where=key)
            attached.add(id(tensor))


def _attach_dcp_hooks(dtensor: DTensor, chunk: ChunkStorageMetadata, *, where: str = "") -> None:
    """Override a DTensor's DCP placement with ``chunk``.

    DTensor forwards ``__create_chunk_list__`` (used to plan reads) and
    ``__create_write_items__`` (used to plan writes) to its local tensor when the local
    tensor defines them. An empty shard plans no write; its chunk still reports the
    offset a gather of all shard sizes would give, so any reader sees one consistent
    picture.

    Raises:
        ValueError: If the local shard's shape is not ``chunk.sizes``, the chunk does not
            fit the DTensor's global shape, or the local tensor already carries a
            different chunk (a state dict attached for another model's layout).
    """
    local = _torch.local_tensor(dtensor)
    global_size = dtensor.size()
    if (
        tuple(local.shape) != tuple(chunk.sizes)
        or tuple(global_size)[1:] != tuple(chunk.sizes)[1:]
        or chunk.offsets[0] + chunk.sizes[0] > global_size[0]
    ):
        raise ValueError(
            f"DTensor {where}: local shard shape {tuple(local.shape)} disagrees with its "
            f"Megatron-FSDP chunk sizes {tuple(chunk.sizes)} (offsets "
            f"{tuple(chunk.offsets)}, global shape {tuple(global_size)}). The state dict "
            "was not taken from this model's current sharding; take it again from the "
            "sharded model."
        )
    previous = getattr(local, CHUNK_ATTR, None)
    if previous is not None and previous != chunk:
        raise ValueError(
            f"DTensor {where}: its local tensor already carries chunk (offsets "
            f"{tuple(previous.offsets)}, sizes {tuple(previous.sizes)}), attached for a "
            f"different layout than this model's (offsets {tuple(chunk.offsets)}, sizes "
            f"{tuple(chunk.sizes)}). Take the state dict again from this model."
        )

    local.__create_chunk_list__ = _ChunkList(chunk)
    local.__create_write_items__ = _WriteItems(chunk, global_size)
    setattr(local, CHUNK_ATTR, chunk)


# The hooks are instances of module-level classes, not closures: they live on the local
# tensors of the optimizer's own state (``optimizer.state_dict()`` returns those objects),
# and torch pickles a tensor's attributes with it, so closures would make every later
# ``torch.save(optimizer.state_dict())`` fail with "Can't pickle local object".


@dataclasses.dataclass(frozen=True)
class _ChunkList:
    """``__create_chunk_list__`` of one local shard: the one chunk it holds."""

    chunk: ChunkStorageMetadata

    def __call__(self) -> list[ChunkStorageMetadata]:
        return [_fresh(self.chunk)]


@dataclasses.dataclass(frozen=True)
class _WriteItems:
    """``__create_write_items__`` of one local shard: write it at its chunk, if non-empty."""

    chunk: ChunkStorageMetadata
    global_size: torch.Size

    def __call__(self, fqn: str, obj: Any) -> list[WriteItem]:
        local = _torch.local_tensor(obj) if isinstance(obj, DTensor) else obj
        if local.numel() == 0:
            return []
        chunk = _fresh(self.chunk)
        return [
            WriteItem(
                type=WriteItemType.SHARD,
                index=MetadataIndex(fqn, chunk.offsets),
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(local),
                    size=torch.Size(self.global_size),
                ),
            )
        ]


def _fresh(chunk: ChunkStorageMetadata) -> ChunkStorageMetadata:
    """A copy of ``chunk`` per planned item, as torch's ``CheckpointableTensor`` route
    builds one: DCP pickles the plan's objects into ``.metadata``, and a chunk shared by a
    parameter and its optimizer state would be pickled as one object referenced twice, so
    the two routes' ``.metadata`` would differ in bytes (not in content)."""
    return ChunkStorageMetadata(offsets=torch.Size(chunk.offsets), sizes=torch.Size(chunk.sizes))
