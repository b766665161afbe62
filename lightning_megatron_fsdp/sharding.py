"""``fully_shard`` that keeps tied parameters tied.

Problem: megatron-fsdp 0.6's ``fully_shard`` collects owned parameters by walking each
submodule's ``named_parameters(recurse=False)``, so a parameter tied under two FQNs (an
embedding shared with an output head) is packed twice. The two copies get independent
main weights (the tie silently breaks), and the module's gradient-ready count expects two
parameters while autograd reports one, so ``post_backward`` never fires: gradients are
never reduced and the module stays unsharded after backward.

Fix: before ``fully_shard``, detach every alias FQN of a parameter (keeping the first FQN
in ``named_parameters`` order as canonical), shard, then re-install the alias pointing at
the canonical FQN's parameter object, and have the group install the same object under
the alias whenever it switches between sharded and unsharded parameters. Both FQNs then
name one packed buffer entry, one gradient, one optimizer state.

Alternatives rejected:
    * Untying before sharding and re-tying gradients by hand: two main weights that must
      be kept equal, and twice the optimizer state.
    * Forbidding tied weights: GPT-style models tie the embedding and the head.

A tie must live inside one FSDP unit: if the alias's module sits in a different unit than
the canonical parameter (for example the embedding wrapped separately from a tied head),
each unit would unshard it at a different time. :func:`shard_module` raises for that.
"""

from __future__ import annotations

from collections.abc import Iterator

from megatron_fsdp import MixedPrecisionPolicy
from megatron_fsdp.experimental import Placements, fully_shard
from megatron_fsdp.experimental.module import FsdpModule
from megatron_fsdp.experimental.parameter_group import (
    FsdpParameterGroup,
    get_containing_parameter_group,
)
from torch import nn
from torch.distributed import DeviceMesh

__all__ = ["shard_module"]

# Per-group {alias FQN relative to the owning module: canonical parameter name}.
_ALIASES_ATTR = "_lmf_tied_aliases"
_original_set_module_parameters = FsdpParameterGroup._set_module_parameters


def _set_module_parameters_with_aliases(
    self: FsdpParameterGroup, parameters: tuple[nn.Parameter, ...]
) -> None:
    """Install ``parameters`` under their names, then under every tied alias."""
    _original_set_module_parameters(self, parameters)
    aliases: dict[str, str] = getattr(self, _ALIASES_ATTR, {})
    if not aliases:
        return
    by_name = dict(zip(self.parameter_names, parameters, strict=True))
    for alias, canonical in aliases.items():
        owner, leaf = _owner(self.owning_module, alias)
        owner._parameters[leaf] = by_name[canonical]


def _install_alias_support() -> None:
    """Route ``FsdpParameterGroup``'s parameter switching through the alias-aware version.

    Idempotent. Groups without aliases behave exactly as before (the original runs first
    and the alias loop is empty), so the patch is safe for groups sharded elsewhere.
    """
    if FsdpParameterGroup._set_module_parameters is not _set_module_parameters_with_aliases:
        FsdpParameterGroup._set_module_parameters = _set_module_parameters_with_aliases


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    module_name, _, leaf = fqn.rpartition(".")
    return (root.get_submodule(module_name) if module_name else root), leaf


def _unit_parameters(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Parameter]]:
    """Yield the parameters ``fully_shard(root)`` would own: not inside a child FSDP unit.

    Every name is yielded, duplicates included: a Parameter registered twice on one module
    (``self.b = self.a``) is a tie too, and ``named_parameters``'s default de-duplication
    would hide the second name, leaving it pointing at the unsharded Parameter whose storage
    megatron-fsdp releases after each forward.
    """
    for name, parameter in root.named_parameters(recurse=False, remove_duplicate=False):
        yield f"{prefix}{name}", parameter
    for child_name, child in root.named_children():
        if not isinstance(child, FsdpModule):
            yield from _unit_parameters(child, f"{prefix}{child_name}.")


def shard_module(
    module: nn.Module,
    mesh: DeviceMesh,
    placements: Placements,
    *,
    mixed_precision_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Apply megatron-fsdp's ``fully_shard`` to ``module`` in place, keeping ties.

    Args:
        module: Module whose parameters not yet owned by a child unit get sharded.
        mesh: Data-parallel device mesh.
        placements: Megatron-FSDP parameter, gradient and optimizer placements.
        mixed_precision_policy: Main weight / gradient dtypes; megatron-fsdp's default
            (fp32 main weights) when ``None``.

    Raises:
        ValueError: If ``module`` is already sharded, or a parameter of this unit is tied
            to one owned by another FSDP unit.
    """
    if isinstance(module, FsdpModule):
        raise ValueError(
            f"shard_module: {type(module).__name__} is already sharded by Megatron-FSDP; "
            "shard each module once."
        )
    canonical_by_param: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for fqn, parameter in _unit_parameters(module):
        if get_containing_parameter_group(parameter) is not None:
            raise ValueError(
                f"shard_module: parameter {fqn!r} of {type(module).__name__} is tied to a "
                "parameter already sharded in another FSDP unit. A tie must live in one "
                "unit: shard the modules that share it together (for a tied embedding and "
                "head, leave both to the root)."
            )
        canonical = canonical_by_param.setdefault(id(parameter), fqn)
        if canonical != fqn:
            aliases[fqn] = canonical
    if aliases:
        _install_alias_support()
    for alias in aliases:
        owner, leaf = _owner(module, alias)
        del owner._parameters[leaf]
    try:
        fully_shard(module, mesh, placements, mixed_precision_policy=mixed_precision_policy)
    except BaseException:
        by_name = dict(_unit_parameters(module))
        for alias, canonical in aliases.items():
            owner, leaf = _owner(module, alias)
            owner._parameters[leaf] = by_name[canonical]
        raise
    if not aliases:
        return
    assert isinstance(module, FsdpModule)
    for group in module.parameter_groups:
        group_aliases = {a: c for a, c in aliases.items() if c in group.parameter_names}
        if group_aliases:
            setattr(group, _ALIASES_ATTR, group_aliases)
            group._switch_to_sharded_parameters()
