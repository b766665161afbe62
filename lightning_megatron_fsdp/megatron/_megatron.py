"""Every access to megatron-fsdp's experimental internals, for 0.6.1 and 0.7, each path chosen
by feature detection. The rest of the package calls these functions and never a private
megatron-fsdp name, so an upstream change breaks one module, which
``tests/test_megatron_compat.py`` checks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import megatron_fsdp
import torch
import torch.distributed as dist
from megatron_fsdp import MixedPrecisionPolicy
from megatron_fsdp import experimental as _experimental
from megatron_fsdp.experimental import Placements
from megatron_fsdp.experimental import fully_shard as _upstream_fully_shard
from megatron_fsdp.experimental import fully_shard_optimizer as _upstream_fully_shard_optimizer
from megatron_fsdp.experimental.dbuffer import DBuffer
from megatron_fsdp.experimental.layout import GlobalLayout
from megatron_fsdp.experimental.module import FsdpContext, FsdpModule
from megatron_fsdp.experimental.parameter_group import (
    FsdpParameterGroup,
    get_containing_parameter_group,
)
from megatron_fsdp.experimental.placement import Flat as _DBufferFlat
from torch import nn

__all__ = [
    "HAS_SHARDING_CONTEXT",
    "REPLICATED_PARAMETERS",
    "UPSTREAM_TIES",
    "VERSION",
    "DBuffer",
    "FsdpModule",
    "FsdpParameterGroup",
    "GlobalLayout",
    "MixedPrecisionPolicy",
    "OwnedRange",
    "Placements",
    "ShardedEntry",
    "ShardingContext",
    "dbuffer_flat",
    "dbuffer_from_local",
    "defers_gradient_reduction",
    "entries",
    "fsdp_modules",
    "fsdp_placements",
    "fully_shard",
    "fully_shard_optimizer",
    "group_mesh",
    "group_of",
    "group_placements",
    "hsdp_placements",
    "is_sharded_parameter",
    "join_gradient_reduction",
    "main_weight",
    "main_weight_local",
    "main_weight_storage",
    "microbatch",
    "nested_calls_unhooked",
    "owned_range",
    "owning_module",
    "parameter_groups",
    "placements_problem",
    "release_prefetched",
    "replicated_mesh_dims",
    "root_modules",
    "sharding_placements",
    "sync_compute_weights",
    "sync_group_compute_weights",
    "unit_parameter_groups",
    "user_class",
]

#: megatron-fsdp >= 0.7: ``fully_shard`` must run inside ``fully_shard_context``, whose
#: ``FsdpContext`` is shared by every module sharded in it and finalised on exit.
HAS_SHARDING_CONTEXT = hasattr(_experimental, "fully_shard_context")

#: megatron-fsdp >= 0.7 packs a parameter registered under several FQNs once
#: (``FsdpParameter.fqns``, parameter_group.py) and installs it under every FQN
#: (``FsdpParameterGroup._set_module_parameter``). 0.6.1 packs it twice, so
#: :func:`fully_shard` applies our tie support there.
UPSTREAM_TIES = hasattr(FsdpParameterGroup, "_set_module_parameter")

# 0.6.1 exports its own DBuffer placements; 0.7 uses torch's DTensor placements.
_HAS_OWN_PLACEMENTS = hasattr(_experimental, "Flat")

#: megatron-fsdp >= 0.7 tracks each unit's lifecycle (module.py ``FsdpModule.Phase``:
#: RESTING, FORWARD, BACKWARD), so a unit at rest can be told from one inside its own
#: forward or backward. ``None`` on 0.6.1.
_PHASE: Any = getattr(FsdpModule, "Phase", None)


# ---------------------------------------------------------------------- placements


#: The installed megatron-fsdp's version, for messages only (paths are chosen by feature).
VERSION: str = megatron_fsdp.__version__

#: megatron-fsdp >= 0.7 (upstream #6137, "no-shard, ZeRO-1 and ZeRO-2") builds each
#: parameter group's compute weight, gradient and main weight from placements of their own
#: (parameter_group.py ``FsdpParameterGroup.__init__``: ``model_weight_placements``,
#: ``main_grad_placements``, ``main_weight_placements``), computes with a replicated
#: compute weight as it is, and copies a gradient that stays ``Partial``. 0.6.1 takes one
#: ``Placements`` and refuses both at the first forward or backward ("FSDP parameter
#: unshard requires a changed placement axis").
REPLICATED_PARAMETERS = (
    "model_weight_placements" in inspect.signature(FsdpParameterGroup.__init__).parameters
)

if _HAS_OWN_PLACEMENTS:
    _PARTIAL_TYPES: tuple[type, ...] = (_experimental.Partial,)
    _REPLICATE_TYPES: tuple[type, ...] = (_experimental.Replicate,)
else:
    from torch.distributed.tensor import Partial as _TorchPartial
    from torch.distributed.tensor import Replicate as _TorchReplicate

    _PARTIAL_TYPES, _REPLICATE_TYPES = (_TorchPartial,), (_TorchReplicate,)


def _placement_kinds() -> tuple[Any, Any, Any]:
    """(shard, replicate, partial-average) in the installed version's placement types."""
    if _HAS_OWN_PLACEMENTS:
        experimental: Any = _experimental
        return (
            experimental.Flat(),
            experimental.Replicate(),
            experimental.Partial(dist.ReduceOp.AVG),
        )
    from torch.distributed.tensor import Partial, Replicate, Shard

    # Partial("avg"), the string: 0.7's DBuffer maps reduce_op names to torch ops and
    # does not accept a ReduceOp object (dbuffer.py, ``_get_reduce_op``).
    return Shard(0), Replicate(), Partial("avg")


def sharding_placements(
    *, parameters: bool, gradients: bool, optimizer: bool, hybrid: bool
) -> Placements:
    """Placements that shard the chosen buffers across the ``dp_shard`` mesh axis.

    A buffer that is not sharded is replicated (parameters, optimizer state) or left
    ``Partial`` until the optimizer step (gradients: reduced once per step, straight into
    the optimizer state's placement). With ``hybrid``, the mesh is 2-D
    ``(dp_replicate, dp_shard)`` and every buffer is also replicated across rows, its
    gradient ``Partial`` across them until the last micro-batch.

    Args:
        parameters: Shard the compute weights (ZeRO-3); else each rank holds them whole.
        gradients: Reduce-scatter gradients in every backward (ZeRO-2 and 3).
        optimizer: Shard the main weights and optimizer state (ZeRO-1, 2 and 3).
        hybrid: Add the replicate axis in front (HSDP).
    """
    shard, replicate, partial = _placement_kinds()
    placements = Placements(
        dp_axes=[0, 1] if hybrid else [0],
        parameter=[*([replicate] if hybrid else []), shard if parameters else replicate],
        gradient=[*([partial] if hybrid else []), shard if gradients else partial],
        optimizer=[*([replicate] if hybrid else []), shard if optimizer else replicate],
    )
    return placements


def fsdp_placements() -> Placements:
    """Placements for plain FSDP on a 1-D mesh: parameters, gradients and state sharded."""
    return sharding_placements(parameters=True, gradients=True, optimizer=True, hybrid=False)


def hsdp_placements() -> Placements:
    """Placements for HSDP on a 2-D ``(dp_replicate, dp_shard)`` mesh.

    Parameters and optimizer state are replicated across rows and sharded within a row.
    Gradients rest ``Partial`` (average) across rows between micro-batches: each backward
    reduce-scatters within the row, and only the last micro-batch of an accumulation
    window all-reduces across rows (megatron-fsdp's ``reduce_partial_gradients``).
    """
    return sharding_placements(parameters=True, gradients=True, optimizer=True, hybrid=True)


def defers_gradient_reduction(placements: Placements) -> bool:
    """Whether gradients rest ``Partial`` on some mesh axis between micro-batches.

    Then only the last micro-batch of an accumulation window may finalise them, which
    megatron-fsdp learns from :func:`microbatch`; finalising each micro-batch would
    drop the earlier ones' gradients under ZeRO-1 (0.7 parameter_group.py
    ``reduce_partial_gradients`` allocates a fresh buffer for a finalised sharded one).
    """
    return any(isinstance(p, _PARTIAL_TYPES) for p in placements.gradient)


def placements_problem(placements: Placements) -> str | None:
    """Why the installed megatron-fsdp cannot train with ``placements``; ``None`` if it can.

    Pure: checks the redistributions a step needs with upstream's own rule
    (placement.py ``changed_mesh_axis``: a ``DBuffer`` changes one mesh axis at a time,
    both versions) and, on 0.6.1, the replicated parameter or unreduced gradient that only
    0.7 handles (:data:`REPLICATED_PARAMETERS`).
    """
    from megatron_fsdp.experimental.placement import changed_mesh_axis

    _shard, replicate, _partial = _placement_kinds()
    n = len(placements.dp_axes)
    steps = (
        ("the compute weights are gathered", placements.parameter, [replicate] * n),
        ("gradients are finalised", placements.gradient, placements.optimizer),
        ("compute weights are refreshed", placements.optimizer, placements.parameter),
    )
    for what, source, target in steps:
        try:
            changed_mesh_axis(source, target)
        except NotImplementedError:
            return (
                f"when {what}, {list(source)} must become {list(target)}, a change on more "
                "than one mesh axis; megatron-fsdp redistributes a buffer along one mesh "
                "axis at a time"
            )
    if not REPLICATED_PARAMETERS:
        if all(isinstance(p, _REPLICATE_TYPES) for p in placements.parameter):
            return "it replicates the parameters on every mesh axis, which needs megatron-fsdp 0.7"
        if all(isinstance(p, _PARTIAL_TYPES) for p in placements.gradient):
            return (
                "it leaves gradients unreduced until the optimizer step on every mesh axis, "
                "which needs megatron-fsdp 0.7"
            )
    return None


# ---------------------------------------------------------------------- DBuffer


#: megatron-fsdp >= 0.7: ``DBuffer.from_local`` takes a keyword-only ``allocation_stream``
#: (dbuffer.py), the stream whose uses must be joined before the buffer is freed.
_FROM_LOCAL_TAKES_STREAM = "allocation_stream" in inspect.signature(DBuffer.from_local).parameters


def dbuffer_flat() -> Any:
    """The dim-0 flat placement a ``DBuffer`` itself stores (placement.py ``Flat``).

    Not what ``fully_shard`` takes (that is :func:`fsdp_placements`): on 0.7 ``fully_shard``
    takes torch's ``Shard(0)`` and maps it to this class per parameter group
    (module.py ``_specialize_placements``); on 0.6.1 the two are the same class.
    """
    return _DBufferFlat()


def dbuffer_from_local(
    local_buffer: torch.Tensor, mesh: Any, placements: Iterable[Any], tensor_shapes: Any
) -> DBuffer:
    """``DBuffer.from_local`` on both versions: wrap an existing local buffer, no copy.

    On 0.7 the buffer records its allocation stream: the current CUDA stream for a CUDA
    buffer, ``None`` otherwise, exactly as ``DBuffer.__init__`` records it.
    """
    if not _FROM_LOCAL_TAKES_STREAM:
        return DBuffer.from_local(local_buffer, mesh, list(placements), tensor_shapes)
    stream = torch.cuda.current_stream(local_buffer.device) if local_buffer.is_cuda else None
    return DBuffer.from_local(
        local_buffer, mesh, list(placements), tensor_shapes, allocation_stream=stream
    )


@dataclasses.dataclass(frozen=True)
class OwnedRange:
    """The elements of one logical tensor of a ``DBuffer`` that this rank holds.

    Attributes:
        shape: The tensor's global shape.
        first_element: Offset of this rank's first element within the (flattened) tensor;
            for an empty range, where the elements lower ranks hold end.
        numel: How many elements this rank holds (0: none).
    """

    shape: torch.Size
    first_element: int
    numel: int


def owned_range(buffer: DBuffer, index: int) -> OwnedRange:
    """This rank's elements of logical tensor ``index`` in ``buffer`` (no collective).

    Reads dbuffer.py ``DBuffer.layout``/``offset``/``local_buffer`` and layout.py
    ``GlobalLayout.tensor_shapes``/``tensor_to_offset``, the same on 0.6.1 and 0.7: the
    buffer's local range ``[offset, offset + local numel)`` intersected with the tensor's
    global range. An empty intersection is clamped to the tensor's bounds.
    """
    layout = buffer.layout
    shape = torch.Size(layout.tensor_shapes[index])
    tensor_start = layout.tensor_to_offset[index]
    tensor_end = tensor_start + shape.numel()
    owned_start = min(max(buffer.offset, tensor_start), tensor_end)
    owned_end = max(min(buffer.offset + buffer.local_buffer.numel(), tensor_end), owned_start)
    return OwnedRange(shape, owned_start - tensor_start, owned_end - owned_start)


# ---------------------------------------------------------------------- parameter groups


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedEntry:
    """One physical parameter of a parameter group, as both versions can describe it.

    Attributes:
        index: Its logical tensor index in the group's buffers (``main_weight`` etc.).
        fqns: Every name it is registered under, relative to the group's owning module;
            the canonical (first) name first. Tied parameters have several.
        sharded: The resting ``Shard(0)`` DTensor parameter (the optimizer's).
        unsharded: The compute parameter installed during forward and backward.
    """

    index: int
    fqns: tuple[str, ...]
    sharded: nn.Parameter
    unsharded: nn.Parameter

    def __post_init__(self) -> None:
        if self.index < 0 or not self.fqns:
            raise AssertionError(f"ShardedEntry: bad index {self.index} or no FQN {self.fqns}.")


# Our 0.6.1 tie support: per group, {alias FQN: canonical FQN}, relative to the owning module.
_ALIASES_ATTR = "_lmf_tied_aliases"


def group_of(parameter: torch.Tensor) -> FsdpParameterGroup | None:
    """The parameter group that owns ``parameter`` (sharded or unsharded), if any."""
    return get_containing_parameter_group(parameter)  # type: ignore[arg-type]


def entries(group: FsdpParameterGroup) -> tuple[ShardedEntry, ...]:
    """Every physical parameter of ``group``, in buffer order."""
    if hasattr(group, "fsdp_parameters"):  # 0.7, parameter_group.py ``FsdpParameter``
        return tuple(
            ShardedEntry(index, tuple(p.fqns), p.sharded, p.unsharded)
            for index, p in enumerate(group.fsdp_parameters)
        )
    aliases: dict[str, str] = getattr(group, _ALIASES_ATTR, {})
    return tuple(
        ShardedEntry(
            index,
            (name, *(alias for alias, canonical in aliases.items() if canonical == name)),
            sharded,
            unsharded,
        )
        for index, (name, sharded, unsharded) in enumerate(
            zip(
                group.parameter_names,
                group.sharded_parameters,
                group.unsharded_parameters,
                strict=True,
            )
        )
    )


def owning_module(group: FsdpParameterGroup) -> nn.Module:
    """The FSDP unit that owns ``group`` (0.7 keeps only a weak reference to it).

    Raises:
        RuntimeError: If the module was garbage-collected while the group lives on.
    """
    module = group.owning_module if hasattr(group, "owning_module") else group._owning_module()
    if module is None:
        raise RuntimeError("Megatron-FSDP parameter group outlived its owning module.")
    return module


def main_weight(group: FsdpParameterGroup) -> DBuffer:
    """The group's main-weight buffer (parameter_group.py ``main_weight``, both versions)."""
    return group.main_weight


def main_weight_local(group: FsdpParameterGroup, index: int) -> torch.Tensor:
    """This rank's rows of logical tensor ``index`` in the main weights, a writable view."""
    return group.main_weight.get_local_tensor(index)


def main_weight_storage(group: FsdpParameterGroup) -> torch.Tensor:
    """This rank's whole main-weight buffer, one flat tensor (dbuffer.py ``local_buffer``).

    Writing it changes every logical tensor's rows this rank holds; refresh the compute
    weights afterwards (:func:`sync_group_compute_weights`).
    """
    return group.main_weight.local_buffer


def replicated_mesh_dims(group: FsdpParameterGroup) -> tuple[int, ...]:
    """The mesh dims across which ``group``'s main weights are replicated, in mesh order.

    A ``Replicate`` placement at index ``i`` of the main weight's placements (one per
    mesh dim, both versions) means the ranks along mesh dim ``i`` hold the same rows.
    """
    placements = tuple(group.main_weight.placements)
    if len(placements) != group.mesh.ndim:
        raise AssertionError(
            f"main weight placements {placements} do not match a {group.mesh.ndim}-D mesh."
        )
    return tuple(i for i, p in enumerate(placements) if isinstance(p, _REPLICATE_TYPES))


def group_mesh(group: FsdpParameterGroup) -> Any:
    """The data-parallel mesh the group is sharded over (parameter_group.py ``mesh``)."""
    return group.mesh


def group_placements(group: FsdpParameterGroup) -> tuple[Any, Any, Any]:
    """The (compute weight, gradient, main weight) placements ``group`` was built with.

    The gradient's is ``None`` for a group without gradients. Read from what each version
    keeps: 0.7 parameter_group.py ``_model_weight_placements``/``_main_grad_placements``
    (``model_weight`` changes placement within a step there), 0.6.1 ``model_weight``'s
    placements and ``_accumulation_placements``; ``main_weight``'s on both.
    """
    parameter = getattr(group, "_model_weight_placements", None)
    if parameter is None:
        parameter = group.model_weight.placements
    gradient = getattr(group, "_main_grad_placements", None)
    if gradient is None:
        gradient = getattr(group, "_accumulation_placements", None)
    if group.main_grad is None:
        gradient = None
    return (
        tuple(parameter),
        None if gradient is None else tuple(gradient),
        tuple(group.main_weight.placements),
    )


def sync_group_compute_weights(group: FsdpParameterGroup) -> None:
    """Refresh one group's compute weights from its main weights (after writing them)."""
    group.sync_model_weight_from_main_weight()


def is_sharded_parameter(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` is a live, resting sharded parameter of some FSDP unit."""
    group = group_of(parameter)
    return group is not None and any(parameter is e.sharded for e in entries(group))


def fsdp_modules(model: nn.Module | None) -> list[FsdpModule]:
    """Every FSDP unit in ``model``, in ``modules()`` order."""
    if model is None:
        return []
    return [m for m in model.modules() if isinstance(m, FsdpModule)]


def unit_parameter_groups(module: nn.Module) -> tuple[FsdpParameterGroup, ...]:
    """The parameter groups one FSDP unit owns itself (not its child units')."""
    assert isinstance(module, FsdpModule)
    return tuple(module.parameter_groups)


def parameter_groups(model: nn.Module | None) -> list[FsdpParameterGroup]:
    """Every parameter group of every FSDP unit in ``model``."""
    return [group for module in fsdp_modules(model) for group in module.parameter_groups]


def root_modules(model: nn.Module) -> list[FsdpModule]:
    """The outermost FSDP units in ``model`` (no FSDP ancestor inside ``model``)."""
    roots: list[FsdpModule] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, FsdpModule):
            roots.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return roots


def sync_compute_weights(model: nn.Module) -> None:
    """Refresh every unit's compute weights from its main weights (after a load).

    Drops unconsumed prefetches first (:func:`release_prefetched`): they hold the weights
    from before the load.
    """
    release_prefetched(model)
    for group in parameter_groups(model):
        sync_group_compute_weights(group)


# ---------------------------------------------------------------------- prefetch


def _release_if_prefetched(module: FsdpModule) -> bool:
    """Reshard ``module`` if it rests with parameters gathered that nothing consumed."""
    if _PHASE is None or module.phase is not _PHASE.RESTING:
        return False
    if module._unshard_event is None:  # module.py: set by the gather, cleared by reshard
        return False
    module._reshard_parameter_groups()  # 0.7 module.py, what post_forward/post_backward call
    return True


def release_prefetched(model: nn.Module | None) -> int:
    """Reshard every unit of ``model`` left gathered by a prefetch that nothing consumed.

    Upstream prefetches the *next* unit in a static order (module.py ``pre_forward``: the
    next in ``forward_order``, ``pre_backward``: the next in ``backward_order``), and a
    gathered unit is only resharded by its own ``post_forward``/``post_backward``. When
    the next unit in that order does not run next, it stays gathered: at rest its
    parameters are the plain unsharded tensors (a state dict then holds no DTensors), and
    its next forward skips the gather (``_unshard_event`` is set) and computes with the
    weights from *before* the optimizer step or load in between -- silently wrong
    training. On 0.7 the forward order spans every root of a sharding context (cross-root
    prefetch), so this happens whenever a step calls top-level units out of their
    registration order, or skips one. On 0.6.1 each root prefetches only inside itself.

    Only units at rest are touched (0.7 ``FsdpModule.phase``); on 0.6.1, which has no
    phase, this does nothing. Called after backward, after each evaluation step, before
    each optimizer step, before a state dict is taken and before compute weights are
    refreshed after a load.

    Returns:
        How many units were resharded.
    """
    return sum(_release_if_prefetched(module) for module in fsdp_modules(model))


def _release_prefetched_before_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Optimizer step pre-hook: :func:`release_prefetched` for the units it steps."""
    seen: set[int] = set()
    for param_group in optimizer.param_groups:
        for parameter in param_group["params"]:
            group = group_of(parameter)
            if group is None or id(group) in seen:
                continue
            seen.add(id(group))
            module = owning_module(group)
            assert isinstance(module, FsdpModule)
            _release_if_prefetched(module)


_FULLY_SHARDED_ATTR = "_lmf_fully_sharded"


def fully_shard_optimizer(
    optimizer: torch.optim.Optimizer, *, precision_aware: bool = False
) -> None:
    """Upstream ``fully_shard_optimizer``, plus dropping stale prefetches before each step.

    After the step the weights change, so a unit still gathered from an unconsumed
    prefetch (:func:`release_prefetched`) would compute its next forward with the old
    ones; the pre-hook reshards it first, so its next forward gathers the new weights.
    Once per optimizer: a later call on the same optimizer (a later stage setting it up
    again) changes nothing.
    """
    if getattr(optimizer, _FULLY_SHARDED_ATTR, False):
        return
    _upstream_fully_shard_optimizer(optimizer, precision_aware=precision_aware)
    if _PHASE is not None:
        optimizer.register_step_pre_hook(_release_prefetched_before_step)
    setattr(optimizer, _FULLY_SHARDED_ATTR, True)


# ---------------------------------------------------------------------- sharding


_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
_FSDP_CLASSES_LOCK = threading.Lock()


def user_class(module: nn.Module) -> type[nn.Module]:
    """The class ``module`` had before sharding (its own class when not sharded)."""
    cls = type(module)
    if isinstance(module, FsdpModule):
        for base in cls.__mro__[1:]:
            if base is not FsdpModule and issubclass(base, nn.Module):
                return base
    return cls


def _shared_fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    """One FSDP class per user class, named like it.

    Upstream's ``_attach_mixin`` (fully_shard.py) builds a new ``ExperimentalFsdp<Name>``
    class for every module instance, so ``torch.compile`` of N identical layers guards on
    N classes and recompiles for each, and model summaries and profiler traces show the
    generated name. The class body is empty in both versions, so one shared class with
    the same bases behaves identically.
    """
    with _FSDP_CLASSES_LOCK:
        shared = _FSDP_CLASSES.get(cls)
        if shared is None:
            # __module__ too: Lightning's profiler names modules "<module>.<class>: <fqn>".
            names = {"__qualname__": cls.__qualname__, "__module__": cls.__module__}
            shared = type(cls.__name__, (FsdpModule, cls), names)
            _FSDP_CLASSES[cls] = shared
        return shared


class ShardingContext:
    """One megatron-fsdp sharding context: every unit sharded through it shares it.

    On megatron-fsdp >= 0.7, ``fully_shard`` must run inside ``fully_shard_context``,
    whose ``FsdpContext`` (streams, cross-root prefetch order) is finalised when the
    context closes; a parent cannot contain a child sharded in another context, and no
    unit may run forward before finalisation. ``fully_shard_context`` refuses non-CUDA
    devices, so on CPU this builds the ``FsdpContext`` itself and sets upstream's
    context variable (fully_shard.py ``_FSDP_CONTEXT``), exactly as
    ``fully_shard_context`` does; the CPU adapter gives it synchronous streams.

    On 0.6.1 there is no such context: each root builds its own lazily on its first
    forward. :meth:`close` builds it eagerly for every root instead
    (module.py ``FsdpModule._lazy_init_context``), so a child unit called directly
    before its root's first forward cannot claim a context of its own.

    Args:
        device: The device the units' shards live on (the mesh's).
        eager_roots: On 0.6.1, build the roots' contexts in :meth:`close` (a scope that
            holds a whole model); leave them lazy for a lone unit that a later parent may
            still contain.
    """

    def __init__(self, device: torch.device, *, eager_roots: bool) -> None:
        self.device = torch.device(device)
        self._eager_roots = eager_roots
        self._modules: list[nn.Module] = []
        self._closed = False
        self._exit: contextlib.ExitStack | None = None
        self._context: FsdpContext | None = None
        self._on_cpu = False
        if not HAS_SHARDING_CONTEXT:
            return
        self._exit = contextlib.ExitStack()
        if self.device.type == "cuda":
            self._context = self._exit.enter_context(_experimental.fully_shard_context(self.device))
            return
        # The package re-exports the function under the module's name: import the module.
        fully_shard_py = importlib.import_module("megatron_fsdp.experimental.fully_shard")
        context_var = fully_shard_py._FSDP_CONTEXT
        if context_var.get() is not None:
            raise RuntimeError(
                "megatron-fsdp: a sharding context is already open in this thread; "
                "close it before opening another (contexts do not nest)."
            )
        self._context = FsdpContext(device=self.device)
        self._on_cpu = True
        self._exit.callback(context_var.reset, context_var.set(self._context))

    def owns(self, module: FsdpModule) -> bool:
        """Whether ``module`` may be a child of a unit sharded here (always on 0.6.1)."""
        return self._context is None or module.context is self._context

    def shard(
        self,
        module: nn.Module,
        mesh: Any,
        placements: Placements,
        mixed_precision_policy: MixedPrecisionPolicy | None,
    ) -> None:
        """Apply ``fully_shard`` to ``module`` in this context (see :func:`fully_shard`)."""
        if self._closed:
            raise RuntimeError("ShardingContext: shard() after close().")
        fully_shard(module, mesh, placements, mixed_precision_policy)
        self._modules.append(module)

    def close(self) -> None:
        """Finalise: from here on the sharded units may run forward. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._exit is not None:
            self._exit.close()  # on CUDA, fully_shard_context finalises on a clean exit
            if self._on_cpu:
                assert self._context is not None
                self._context.finalize()
            return
        if not self._eager_roots:
            return
        inner: set[int] = set()
        for module in self._modules:
            inner.update(id(m) for m in fsdp_modules(module) if m is not module)
        for module in self._modules:
            if id(module) not in inner and module._context is None:
                module._lazy_init_context()  # 0.6.1 module.py

    def abandon(self) -> None:
        """Drop the context without finalising it (sharding failed part-way)."""
        if self._closed or self._exit is None:
            self._closed = True
            return
        self._closed = True
        if self._on_cpu:
            self._exit.close()
            return
        # fully_shard_context finalises on a clean exit only: leave it with an error.
        error = RuntimeError("sharding abandoned")
        self._exit.__exit__(type(error), error, None)


def fully_shard(
    module: nn.Module,
    mesh: Any,
    placements: Placements,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Upstream ``fully_shard``, with ties kept on 0.6.1 and one class per user class.

    Must run inside a :class:`ShardingContext` on megatron-fsdp >= 0.7.

    Raises:
        ValueError: If ``module`` is already sharded (upstream's check).
    """
    original_cls = type(module)
    aliases = {} if UPSTREAM_TIES else _detach_aliases(module)
    hooks_before = {name: set(getattr(module, name)) for name in _HOOK_DICTS}
    try:
        _upstream_fully_shard(
            module, mesh, placements, mixed_precision_policy=mixed_precision_policy
        )
    except BaseException:
        _reattach_aliases(module, aliases)
        raise
    module.__class__ = _shared_fsdp_class(original_cls)
    if aliases:
        _install_aliases(module, aliases)
    module.register_forward_hook(_pre_backward_for_structured_output)
    module.__dict__[_FSDP_HOOKS_ATTR] = {
        name: tuple(key for key in getattr(module, name) if key not in hooks_before[name])
        for name in _HOOK_DICTS
    }
    if _PHASE is not None:
        backward_pre_hooks = module._backward_pre_hooks
        for key in module.__dict__[_FSDP_HOOKS_ATTR]["_backward_pre_hooks"]:
            backward_pre_hooks[key] = _once_per_backward(backward_pre_hooks[key])
    _hide_hooks_from_dynamo(module)


def _in_backward(module: nn.Module) -> bool:
    """Whether ``module``'s backward already began (0.7 ``FsdpModule.phase``; never on 0.6.1)."""
    return _PHASE is not None and module.phase is _PHASE.BACKWARD  # type: ignore[attr-defined]


def _once_per_backward(hook: Any) -> Any:
    """Wrap upstream's full backward pre-hook (module.py ``_register_hooks``) to skip a
    unit whose backward already began.

    Two triggers can reach ``pre_backward`` in one backward: upstream's hook on the
    top-level tensors of an output, and :func:`_pre_backward_for_structured_output` on
    the tensors nested inside it (an ``nn.LSTM``'s ``(output, (h, c))``, a Hugging Face
    ``return_dict=False`` tuple with its cache). 0.6.1's second call is a no-op; 0.7's
    raises ``Invalid FSDP module phase transition: BACKWARD -> BACKWARD``. Whichever fires
    first unshards the unit; the second is skipped.
    """

    def once(module: nn.Module, grad_output: Any) -> Any:
        if _in_backward(module):
            return None
        return hook(module, grad_output)

    return once


def _hide_hooks_from_dynamo(module: nn.Module) -> None:
    """Run the unit's hooks eagerly when the unit is compiled, outside the traced graph.

    ``module.compile()`` traces ``_call_impl``, hooks included. Upstream's hooks
    (module.py ``_register_hooks``) are runtime bookkeeping: collectives, stream events,
    and an NVTX label made of the unit's name, so dynamo guards on that name
    (``self._name == 'layers.0'``) and compiles every layer again, up to its recompile
    limit, after which the remaining layers silently run eagerly. Wrapped in
    ``torch._dynamo.disable``, the hooks run as in eager mode (a graph break on each
    side of the forward) and identical layers share their compiled graphs.
    """
    for hooks in (
        module._forward_pre_hooks,
        module._forward_hooks,
        module._backward_pre_hooks,
        module._backward_hooks,
    ):
        for key, hook in list(hooks.items()):
            hooks[key] = torch._dynamo.disable(hook, recursive=True)


# ---------------------------------------------------------------------- structured outputs


def _tensors_in(output: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in ``output``: nested tuples, lists, mappings and dataclasses."""
    if isinstance(output, torch.Tensor):
        yield output
    elif depth > 8:
        return
    elif isinstance(output, Mapping):  # Hugging Face ModelOutput is a Mapping
        for value in output.values():
            yield from _tensors_in(value, depth + 1)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _tensors_in(value, depth + 1)
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        for field in dataclasses.fields(output):
            yield from _tensors_in(getattr(output, field.name, None), depth + 1)


def _pre_backward_for_structured_output(module: nn.Module, _args: Any, output: Any) -> None:
    """Unshard ``module`` for backward when its output hides tensors from torch's hooks.

    Upstream unshards a unit for backward from a full backward pre-hook (module.py
    ``_register_hooks``, both versions). torch attaches those only to an output that is a
    tensor or to the top-level tensors of a tuple (torch/utils/hooks.py
    ``BackwardHook.setup_output_hook``); a Hugging Face model returns a ``ModelOutput``
    (a dict), so the hook never fires, the unit's parameters stay released, and backward
    fails reading them (``setStorage ... storage of size 0``). For such outputs this
    registers the unit's ``pre_backward`` on every grad-requiring tensor inside, to run
    once, when the first of their gradients is computed, as FSDP2 does for its outputs.
    A tensor or tuple of tensors is left to upstream's hook (a tuple that also nests
    tensors gets both; whichever fires second is skipped, see :func:`_once_per_backward`).
    """
    if isinstance(output, torch.Tensor) or not torch.is_grad_enabled():
        return  # upstream's hook fires (the common case; cheap under torch.compile too)
    tensors = [t for t in _tensors_in(output) if t.requires_grad]
    top_level = output if isinstance(output, tuple) else ()
    # Identity tests, not id(): dynamo traces this hook when a unit is compiled.
    if all(any(t is top for top in top_level) for t in tensors):
        return
    unit = weakref.ref(module)

    def pre_backward(_grads: Any) -> None:
        hooked = unit()
        if hooked is not None and not _in_backward(hooked):
            hooked.pre_backward()  # type: ignore[attr-defined]  # module.py, both versions

    torch.autograd.graph.register_multi_grad_hook(tensors, pre_backward, mode="any")


# torch ``nn.Module`` hook registries that FsdpModule._register_hooks (module.py) adds to.
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# Per unit, {registry: ids of the hooks upstream's fully_shard registered}.
_FSDP_HOOKS_ATTR = "_lmf_fsdp_hooks"


@contextlib.contextmanager
def nested_calls_unhooked(module: nn.Module) -> Iterator[None]:
    """Inside ``module``'s own forward, let nested ``module(...)`` calls skip its FSDP hooks.

    The strategy runs ``training_step`` as the root unit's forward (so the root's
    parameters are unsharded for it); a step that calls ``self(x)`` calls the unit again
    inside that forward. Upstream's hooks are not re-entrant: 0.7 tracks a phase per
    unit and refuses ``FORWARD -> FORWARD`` (module.py ``FsdpModule.phase``), and the nested
    call's backward pre-hook would refuse ``FORWARD -> BACKWARD`` in a manual backward;
    0.6.1 resharded the root's parameters when the nested call returned and unsharded
    them again for each nested output in backward. The parameters are already unsharded
    by the outer call, whose own hooks (collected by torch before its forward ran) still
    fire, so the nested call needs none.

    Only the hooks :func:`fully_shard` recorded are lifted, and each registry is restored
    in its original order (hooks registered meanwhile kept, after them).

    Alternatives rejected:
        * Clearing every hook of the module: drops the user's own hooks too.
        * A re-entrancy counter around ``pre_forward``/``post_forward``: does not cover the
          per-call backward hooks, which torch attaches to every call's outputs.
    """
    recorded: dict[str, tuple[int, ...]] = module.__dict__.get(_FSDP_HOOKS_ATTR, {})
    saved: list[tuple[dict[int, Any], list[tuple[int, Any]]]] = []
    for name, keys in recorded.items():
        hooks = getattr(module, name)
        saved.append((hooks, list(hooks.items())))
        for key in keys:
            hooks.pop(key, None)
    try:
        yield
    finally:
        for hooks, items in saved:
            original = dict(items)
            added = [(key, hook) for key, hook in hooks.items() if key not in original]
            hooks.clear()
            hooks.update(items)
            hooks.update(added)


# ---------------------------------------------------------------------- 0.6.1 ties


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = fqn.rpartition(".")
    return (root.get_submodule(module_name) if module_name else root), leaf


def _unit_parameters(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
    """Every (name, parameter) ``fully_shard(root)`` would own, duplicates included."""
    for name, parameter in root.named_parameters(recurse=False, remove_duplicate=False):
        yield f"{prefix}{name}", parameter
    for child_name, child in root.named_children():
        if not isinstance(child, FsdpModule):
            yield from _unit_parameters(child, f"{prefix}{child_name}.")


def _detach_aliases(module: nn.Module) -> dict[str, str]:
    """Remove every alias FQN of a tied parameter before 0.6.1's ``fully_shard``.

    0.6.1 collects owned parameters with ``named_parameters(recurse=False)`` per submodule
    (fully_shard.py ``_collect_owned_parameters``), so a parameter under two FQNs is
    packed twice: two main weights (the tie silently breaks), and the gradient-ready count
    waits for two parameters while autograd reports one, so ``post_backward`` never fires.
    Detaching the aliases leaves one FQN per parameter (the first in ``named_parameters``
    order); :func:`_install_aliases` puts them back as views of the one buffer entry.
    """
    canonical_by_param: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for fqn, parameter in _unit_parameters(module):
        canonical = canonical_by_param.setdefault(id(parameter), fqn)
        if canonical != fqn:
            aliases[fqn] = canonical
    for alias in aliases:
        owner, leaf = _owner(module, alias)
        del owner._parameters[leaf]
    return aliases


def _reattach_aliases(module: nn.Module, aliases: dict[str, str]) -> None:
    by_name = dict(_unit_parameters(module))
    for alias, canonical in aliases.items():
        owner, leaf = _owner(module, alias)
        owner._parameters[leaf] = by_name[canonical]


_original_set_module_parameters = getattr(FsdpParameterGroup, "_set_module_parameters", None)


def _set_module_parameters_with_aliases(
    self: FsdpParameterGroup, parameters: tuple[nn.Parameter, ...]
) -> None:
    """0.6.1 parameter_group.py ``_set_module_parameters``, then every tied alias."""
    assert _original_set_module_parameters is not None
    _original_set_module_parameters(self, parameters)
    aliases: dict[str, str] = getattr(self, _ALIASES_ATTR, {})
    if not aliases:
        return
    by_name = dict(zip(self.parameter_names, parameters, strict=True))
    for alias, canonical in aliases.items():
        owner, leaf = _owner(self.owning_module, alias)
        owner._parameters[leaf] = by_name[canonical]


def _install_aliases(module: nn.Module, aliases: dict[str, str]) -> None:
    """Record each group's aliases and route 0.6.1's parameter switching through them.

    The class-level patch is idempotent, and a group without aliases behaves exactly as
    before (the original runs, the alias loop is empty).
    """
    if FsdpParameterGroup._set_module_parameters is not _set_module_parameters_with_aliases:
        FsdpParameterGroup._set_module_parameters = _set_module_parameters_with_aliases
    assert isinstance(module, FsdpModule)
    for group in module.parameter_groups:
        group_aliases = {a: c for a, c in aliases.items() if c in group.parameter_names}
        if group_aliases:
            setattr(group, _ALIASES_ATTR, group_aliases)
            group._switch_to_sharded_parameters()


# ---------------------------------------------------------------------- steps


def _contexts(model: nn.Module) -> list[FsdpContext]:
    """The distinct ``FsdpContext`` objects of ``model``'s units (initialised ones)."""
    seen: dict[int, FsdpContext] = {}
    for module in fsdp_modules(model):
        context = module._context
        if context is not None:
            seen.setdefault(id(context), context)
    return list(seen.values())


@contextlib.contextmanager
def microbatch(model: nn.Module, is_last: bool) -> Iterator[None]:
    """Mark the forwards and backwards inside as (not) the last accumulation micro-batch.

    0.6.1's ``microbatch`` takes a module tree; 0.7's takes one context. Every context of
    ``model`` is marked either way.
    """
    if not HAS_SHARDING_CONTEXT:
        with _experimental.microbatch(model, is_last=is_last):
            yield
        return
    with contextlib.ExitStack() as stack:
        for context in _contexts(model):
            stack.enter_context(_experimental.microbatch(context, is_last))
        yield


def join_gradient_reduction(model: nn.Module) -> None:
    """Make the current stream wait for every pending gradient reduce-scatter.

    A root's final backward callback does this, but a backward started inside the root's
    own forward (Lightning's manual optimisation) never registers it.
    """
    for context in _contexts(model):
        context.current_stream().wait_stream(context.reduce_scatter_stream)


def iter_sharded(model: nn.Module) -> Iterable[ShardedEntry]:
    """Every physical sharded parameter of ``model``, group by group."""
    for group in parameter_groups(model):
        yield from entries(group)
