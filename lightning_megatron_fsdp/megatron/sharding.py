"""Which modules become Megatron-FSDP units, and sharding them without losing anything:
:func:`shard_module` (``fully_shard`` that keeps ties on both versions),
:func:`sharding_scope`, :func:`plan_units` (the policy's units bottom-up, then the outermost
modules that own parameters) and :func:`shard_unit` (materialise, cast, shard, check). It
depends on torch and megatron-fsdp, never on Lightning. Its public names are the ones
``megatron/__init__.py`` lists for it (no ``__all__`` here to repeat them).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron._megatron import (
    FsdpModule,
    MixedPrecisionPolicy,
    Placements,
    ShardingContext,
    fsdp_placements,
    hsdp_placements,
)
from lightning_megatron_fsdp.megatron.cpu_execution import enable_cpu_execution

#: A set of module classes, or a callable ``policy(module) -> bool`` or torch-FSDP style
#: ``policy(module, recurse, nonwrapped_numel) -> bool`` (``ModuleWrapPolicy``,
#: ``functools.partial(size_based_auto_wrap_policy, ...)``).
AutoWrapPolicy = set[type[nn.Module]] | Callable[..., bool]


# ---------------------------------------------------------------------- scope


class _Scope(threading.local):
    """The open :func:`sharding_scope` of this thread, if any."""

    context: ShardingContext | None = None
    open: bool = False


_SCOPE = _Scope()


@contextlib.contextmanager
def sharding_scope() -> Iterator[None]:
    """Shard several units together: every :func:`shard_module` inside shares one context.

    megatron-fsdp >= 0.7 requires a parent and its child units to be sharded in one
    ``fully_shard_context``, finalised before any forward; on 0.6.1 this builds each
    root's context when the scope closes, so calling a child unit before its root cannot
    split the tree. Shard bottom-up inside it::

        with sharding_scope():
            for block in model.blocks:
                shard_module(block, mesh)
            shard_module(model, mesh)

    A single :func:`shard_module` call outside a scope gets a scope of its own.

    Raises:
        RuntimeError: If a scope is already open in this thread (scopes do not nest).
    """
    if _SCOPE.open:
        raise RuntimeError(
            "sharding_scope: a scope is already open in this thread; shard every unit of "
            "one model inside a single scope (scopes do not nest)."
        )
    _SCOPE.open, _SCOPE.context = True, None
    try:
        yield
    except BaseException:
        if _SCOPE.context is not None:
            _SCOPE.context.abandon()
        raise
    else:
        if _SCOPE.context is not None:
            _SCOPE.context.close()
    finally:
        _SCOPE.open, _SCOPE.context = False, None


def _shard_device(mesh: DeviceMesh) -> torch.device:
    """Where megatron-fsdp puts a unit's shards: on the mesh's device type (its ``DBuffer``
    allocates there), wherever the module was built. A LightningModule is built on CPU and
    sharded onto a CUDA mesh; its parameters' device would wrongly mean CPU execution."""
    return torch.device(mesh.device_type)


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements | None = None,
    *,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Apply megatron-fsdp's ``fully_shard`` to ``module`` in place, keeping ties.

    Owns every parameter of ``module`` that no child unit owns. A parameter registered
    under several names (a tied embedding and head) stays one parameter with one main
    weight and one optimizer state, on megatron-fsdp 0.6.1 as on 0.7. The shards go to
    the mesh's device, wherever ``module`` was built; on a non-CUDA mesh the CPU adapter is
    enabled first.

    Args:
        module: Module whose parameters not yet owned by a child unit get sharded.
        mesh: Data-parallel device mesh (1-D FSDP or 2-D ``(replicate, shard)`` HSDP).
        placements: Megatron-FSDP placements; by default :func:`fsdp_placements` on a
            1-D mesh and :func:`hsdp_placements` on a 2-D one.
        mixed_precision_policy: Main weight / gradient dtypes; megatron-fsdp's default
            (fp32 main weights) when ``None``.

    Raises:
        ValueError: If ``module`` is already sharded, a parameter of this unit is tied
            to one owned by another unit, or (megatron-fsdp >= 0.7) ``module`` contains
            a unit sharded outside the current :func:`sharding_scope`.
    """
    if isinstance(module, FsdpModule):
        raise ValueError(
            f"shard_module: {type(module).__name__} is already sharded by Megatron-FSDP; "
            "shard each module once."
        )
    for fqn, parameter in _unit_parameters(module):
        if _megatron.group_of(parameter) is not None:
            raise ValueError(
                f"shard_module: parameter {fqn!r} of {type(module).__name__} is tied to a "
                "parameter already sharded in another FSDP unit. A tie must live in one "
                "unit: shard the modules that share it together (for a tied embedding and "
                "head, leave both to their common parent)."
            )
    device = _shard_device(mesh)
    if device.type != "cuda":
        enable_cpu_execution()
    if placements is None:
        placements = hsdp_placements() if mesh.ndim == 2 else fsdp_placements()
    if _SCOPE.open:
        if _SCOPE.context is None:
            _SCOPE.context = ShardingContext(device, eager_roots=True)
        _check_same_context(module, _SCOPE.context)
        _SCOPE.context.shard(module, mesh, placements, mixed_precision_policy)
        return
    context = ShardingContext(device, eager_roots=False)
    try:
        _check_same_context(module, context)
        context.shard(module, mesh, placements, mixed_precision_policy)
    except BaseException:
        context.abandon()
        raise
    context.close()


def _check_same_context(module: nn.Module, context: ShardingContext) -> None:
    """Raise (0.7) if ``module`` contains a unit sharded in another context."""
    for name, child in module.named_modules():
        if child is not module and isinstance(child, FsdpModule) and not context.owns(child):
            raise ValueError(
                f"shard_module: {type(module).__name__} contains the unit {name!r}, sharded "
                "in another sharding scope. megatron-fsdp >= 0.7 needs a parent and its "
                "child units sharded in one context: shard bottom-up inside one "
                "`with sharding_scope(): ...` block."
            )


def _unit_parameters(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
    """Every (name, parameter) ``fully_shard(root)`` would own: not inside a child unit.

    Duplicates included: a Parameter registered twice (``self.b = self.a``) is a tie too.
    """
    for name, parameter in root.named_parameters(recurse=False, remove_duplicate=False):
        yield f"{prefix}{name}", parameter
    for child_name, child in root.named_children():
        if not isinstance(child, FsdpModule):
            yield from _unit_parameters(child, f"{prefix}{child_name}.")


# ---------------------------------------------------------------------- choosing units


def validate_auto_wrap_policy(policy: Any, where: str) -> AutoWrapPolicy | None:
    """Return ``policy`` in canonical form (a set of classes, or a callable).

    Raises:
        TypeError: If it is neither, naming ``where`` (the option's owner).
    """
    if policy is None or (callable(policy) and not isinstance(policy, type)):
        return policy
    if isinstance(policy, set | frozenset | list | tuple) and policy:
        bad = [p for p in policy if not (isinstance(p, type) and issubclass(p, nn.Module))]
        if not bad:
            return set(policy)
        raise TypeError(
            f"{where}: auto_wrap_policy must contain nn.Module subclasses only; got "
            f"{', '.join(repr(b) for b in bad)}. Pass the classes themselves, e.g. "
            "{TransformerBlock}."
        )
    raise TypeError(
        f"{where}: auto_wrap_policy must be a non-empty set of nn.Module subclasses or a "
        f"callable policy(module) -> bool, got {policy!r} ({type(policy).__name__}). For "
        "example auto_wrap_policy={TransformerBlock}."
    )


def _policy_accepts_module_only(policy: Callable[..., bool]) -> bool:
    """Whether ``policy`` can be called as ``policy(module)`` (else torch FSDP's signature)."""
    try:
        inspect.signature(policy).bind(None)
    except (TypeError, ValueError):  # ValueError: builtins without a signature
        return False
    return True


def _policy_units(root: nn.Module, policy: AutoWrapPolicy | None) -> list[nn.Module]:
    """Modules the policy makes units, in post-order; never ``root``, never sharded ones."""
    if policy is None:
        return []
    if isinstance(policy, set):
        classes = tuple(policy)

        def wants(module: nn.Module, numel: int) -> bool:
            return isinstance(module, classes)

    elif _policy_accepts_module_only(policy):

        def wants(module: nn.Module, numel: int) -> bool:
            return bool(policy(module))

    else:

        def wants(module: nn.Module, numel: int) -> bool:
            return bool(policy(module=module, recurse=False, nonwrapped_numel=numel))

    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        if isinstance(module, FsdpModule):
            return 0
        numel = sum(p.numel() for p in module.parameters(recurse=False))
        numel += sum(visit(child) for child in module.children())
        if module is not root and numel > 0 and wants(module, numel):
            units.append(module)
            return 0
        return numel

    visit(root)
    return units


def _unowned(module: nn.Module) -> set[int]:
    """Ids of the parameters ``fully_shard(module)`` would own, once its policy units are."""
    return {id(p) for _, p in _unit_parameters(module)}


def plan_units(root: nn.Module, policy: AutoWrapPolicy | None) -> Iterator[nn.Module]:
    """Yield the modules to shard, bottom-up: policy units, top-level units, then ``root``.

    Lazily: each later choice depends on what the earlier units own, so shard each
    yielded module before asking for the next. Top-level units are the direct children
    of ``root`` that still own parameters, unless they share a tied parameter with
    ``root`` itself or another child (a tie must live in one unit); ``root`` comes last,
    and only if it still owns parameters (its own, or such tied children's).
    """
    yield from _policy_units(root, policy)
    children = [(n, c) for n, c in root.named_children() if not isinstance(c, FsdpModule)]
    owned = {name: _unowned(child) for name, child in children}
    own = {id(p) for p in root.parameters(recurse=False)}
    for name, child in children:
        others = set(own)
        for other, ids in owned.items():
            if other != name:
                others |= ids
        if owned[name] and not owned[name] & others:
            yield child
    if _unowned(root):
        yield root


# ---------------------------------------------------------------------- one unit


def _unit_modules(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Yield ``(prefix, module)`` for ``module`` and descendants outside child units."""
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, FsdpModule):
            yield from _unit_modules(child, f"{prefix}{name}.")


def _materialize(modules: list[tuple[str, nn.Module]], device: torch.device, where: str) -> None:
    """Replace meta tensors of ``modules`` by real ones and re-initialise them.

    One new tensor per meta parameter object, installed under every name that shared it,
    so ties survive (``to_empty`` per module would split them).

    Raises:
        TypeError: If a module with meta tensors has no ``reset_parameters`` (checked
            before anything is materialised).
    """
    pending: list[tuple[str, nn.Module]] = []
    for prefix, module in modules:
        tensors = [*_torch.own_parameters(module).values(), *_torch.own_buffers(module).values()]
        if any(t is not None and t.is_meta for t in tensors):
            if not callable(getattr(module, "reset_parameters", None)):
                raise TypeError(
                    f"{where}: module {prefix.rstrip('.') or '<root>'!r} "
                    f"({type(module).__name__}) has parameters or buffers on the meta device "
                    "but no reset_parameters() to initialise them. Implement "
                    "reset_parameters(), or build this module outside "
                    "trainer.init_module(empty_init=True)."
                )
            pending.append((prefix, module))
    replacements: dict[int, nn.Parameter] = {}
    for _, module in pending:
        for name, parameter in _torch.own_parameters(module).items():
            if parameter is None or not parameter.is_meta:
                continue
            new = replacements.get(id(parameter))
            if new is None:
                new = nn.Parameter(
                    torch.empty_like(parameter, device=device),
                    requires_grad=parameter.requires_grad,
                )
                replacements[id(parameter)] = new
            _torch.own_parameters(module)[name] = new
        for name, buffer in _torch.own_buffers(module).items():
            if buffer is not None and buffer.is_meta:
                _torch.own_buffers(module)[name] = torch.empty_like(buffer, device=device)
    with torch.no_grad():
        for _, module in pending:
            module.reset_parameters()


def shard_unit(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    *,
    device: torch.device,
    compute_dtype: torch.dtype | None = None,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
    where: str = "shard_unit",
) -> None:
    """Materialise, move, cast and shard one unit (inside the caller's scope).

    Meta tensors are materialised (``reset_parameters``, ties preserved), buffers moved to
    ``device``; with ``compute_dtype`` floating parameters and buffers are cast to it, and
    the main weights are then overwritten with the exact pre-cast values, so fp32 main
    weights start from the fp32 initialisation rather than its bf16 rounding.

    Args:
        module: A module not yet sharded.
        mesh: Data-parallel mesh.
        placements: Megatron-FSDP placements for ``mesh``.
        device: Where the unit's tensors go.
        compute_dtype: Cast to this dtype before sharding (the ``-true`` precisions).
        mixed_precision_policy: Main weight / gradient dtypes.
        where: Names the caller in errors.

    Raises:
        ValueError: If ``module`` is already sharded or a tie crosses unit boundaries.
        TypeError: If a meta-device module has no ``reset_parameters``.
    """
    modules = list(_unit_modules(module))
    _materialize(modules, device, where)
    originals: dict[int, Tensor] = {}
    for _, owner in modules:
        for name, buffer in _torch.own_buffers(owner).items():
            if buffer is not None:
                moved = buffer.to(device)
                if compute_dtype is not None and moved.is_floating_point():
                    moved = moved.to(compute_dtype)
                _torch.own_buffers(owner)[name] = moved
        if compute_dtype is None:
            continue
        for parameter in _torch.own_parameters(owner).values():
            if parameter is None or not parameter.is_floating_point():
                continue
            if parameter.dtype != compute_dtype:
                originals[id(parameter)] = parameter.detach()
                parameter.data = parameter.data.to(compute_dtype)
    shard_module(module, mesh, placements, mixed_precision_policy=mixed_precision_policy)
    if originals:
        _restore_main_weights(module, originals)


def materialize_outside_units(model: nn.Module, device: torch.device, where: str) -> None:
    """Materialise meta buffers that no unit owns, after the units were sharded.

    A module that is not a unit (a root that owns no parameters, such as litgpt's ``GPT``
    with its rotary cache) keeps buffers on the meta device after a meta-device init;
    they are re-created on ``device`` by the module's ``reset_parameters``, as the units'
    were. Rank-local.

    Raises:
        TypeError: If such a module has no ``reset_parameters``.
    """
    _materialize(list(_unit_modules(model)), device, where)


def _restore_main_weights(module: nn.Module, originals: Mapping[int, Tensor]) -> None:
    """Overwrite main weights (cast up from the compute dtype) with the exact originals.

    ``originals`` maps ``id`` of the unsharded parameter objects (their storage was
    swapped, their identity kept) to their values before the cast. Copies only this rank's
    rows: a rank owns whole dim-0 rows (``_megatron.owned_range``),
    so no collective is needed.
    """
    for group in _megatron.unit_parameter_groups(module):
        restored = False
        for entry in _megatron.entries(group):
            original = originals.get(id(entry.unsharded))
            local = _megatron.main_weight_local(group, entry.index)
            if original is None or local.shape[0] == 0:
                continue
            owned = _megatron.owned_range(_megatron.main_weight(group), entry.index)
            first_row = owned.first_element // math.prod(owned.shape[1:])
            rows = original.reshape(owned.shape)[first_row : first_row + local.shape[0]]
            local.copy_(rows.to(device=local.device, dtype=local.dtype))
            restored = True
        if restored:
            _megatron.sync_group_compute_weights(group)


# ---------------------------------------------------------------------- checks


def check_no_foreign_sharding(model: nn.Module, where: str) -> None:
    """Raise if another data-parallel wrapper owns part of ``model``.

    Raises:
        TypeError: For torch FSDP, FSDP2 (``fully_shard``) or DDP modules, naming the first.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    wrappers = (
        (FullyShardedDataParallel, "torch FSDP (FullyShardedDataParallel)"),
        (FSDPModule, "torch FSDP2 (torch.distributed.fsdp.fully_shard)"),
        (DistributedDataParallel, "DistributedDataParallel"),
    )
    for name, module in model.named_modules():
        for cls, what in wrappers:
            if isinstance(module, cls):
                raise TypeError(
                    f"{where}: module {name or '<root>'!r} ({type(module).__name__}) is "
                    f"already wrapped by {what}. Megatron-FSDP must own every parameter "
                    "itself: remove that wrapping (e.g. from configure_model) and let the "
                    "strategy shard the module (auto_wrap_policy), or shard it with "
                    "lightning_megatron_fsdp.shard_module / strategy.shard()."
                )


def check_fully_sharded(model: nn.Module, where: str) -> None:
    """Every parameter must be a resting Megatron-FSDP sharded parameter.

    Raises:
        RuntimeError: Naming the first parameter that is not (it would never be reduced).
    """
    for name, parameter in model.named_parameters():
        if not _megatron.is_sharded_parameter(parameter):
            raise RuntimeError(
                f"{where}: parameter {name!r} is not a Megatron-FSDP sharded parameter "
                "after setup (it would be trained without gradient reduction). Expected a "
                "unit to own it; was it added after sharding?"
            )


def check_placements(model: nn.Module, placements: Placements, where: str) -> None:
    """Every unit of ``model`` must be sharded with ``placements`` (the strategy's mode).

    A unit sharded by hand with other placements (or a model sharded by an earlier run
    in another mode) would train with the wrong gradient accumulation (the strategy marks
    micro-batches by its mode) and contradict the mode the user chose.

    Raises:
        ValueError: Naming the first unit that differs, both placements and the fix.
    """
    expected = (
        tuple(placements.parameter),
        tuple(placements.gradient),
        tuple(placements.optimizer),
    )
    for name, module in model.named_modules():
        if not isinstance(module, FsdpModule):
            continue
        for group in _megatron.unit_parameter_groups(module):
            parameter, gradient, optimizer = _megatron.group_placements(group)
            if (parameter, optimizer) == (expected[0], expected[2]) and gradient in (
                None,
                expected[1],
            ):
                continue
            raise ValueError(
                f"{where}: unit {name or '<root>'!r} is sharded with parameter/gradient/"
                f"optimizer placements {list(parameter)}/{list(gradient or [])}/"
                f"{list(optimizer)}, but sharding_strategy asks for {list(expected[0])}/"
                f"{list(expected[1])}/{list(expected[2])}. Shard units in configure_model with "
                "self.trainer.strategy.shard(module), or pass the sharding_strategy the model "
                "was sharded with."
            )


def check_optimizer_parameters(
    optimizer: torch.optim.Optimizer, model: nn.Module, index: int, where: str
) -> None:
    """Raise unless every parameter ``optimizer`` holds is a live sharded one of ``model``.

    Raises:
        ValueError: Naming the optimizer and parameter.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if _megatron.is_sharded_parameter(parameter):
                continue
            what = names.get(id(parameter), f"<unnamed {tuple(parameter.shape)} tensor>")
            raise ValueError(
                f"{where}: optimizer {index} holds parameter {what!r}, which is not one of the "
                "model's Megatron-FSDP sharded parameters (it was probably captured before "
                "sharding). Create optimizers in configure_optimizers() from self.parameters()."
            )
