"""The ``sharding_strategy`` option: which of parameters, gradients and optimizer state
Megatron-FSDP shards, under the names Lightning and Megatron-LM users know. A name, torch's
``ShardingStrategy`` or raw placements becomes one validated :class:`ShardingMode`, and what
the installed megatron-fsdp cannot run is refused at construction with the reason.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron._megatron import Placements

__all__ = ["MODES", "ShardingMode", "resolve_sharding_mode"]


@dataclasses.dataclass(frozen=True)
class _Shards:
    """What one named mode shards across ``dp_shard`` (and whether it is the 2-D form)."""

    parameters: bool
    gradients: bool
    optimizer: bool
    hybrid: bool


#: Canonical names -> what they shard. ``SHARD_OPTIMIZER`` is ZeRO-1 (Megatron-LM's
#: ``optim``); ``HYBRID_SHARD_GRAD_OP`` is torch FSDP's ``_HYBRID_SHARD_ZERO2``.
MODES: dict[str, _Shards] = {
    "FULL_SHARD": _Shards(True, True, True, hybrid=False),
    "SHARD_GRAD_OP": _Shards(False, True, True, hybrid=False),
    "SHARD_OPTIMIZER": _Shards(False, False, True, hybrid=False),
    "NO_SHARD": _Shards(False, False, False, hybrid=False),
    "HYBRID_SHARD": _Shards(True, True, True, hybrid=True),
    "HYBRID_SHARD_GRAD_OP": _Shards(False, True, True, hybrid=True),
    "HYBRID_SHARD_OPTIMIZER": _Shards(False, False, True, hybrid=True),
}

# Other spellings users bring: torch FSDP's private ZeRO-2 hybrid, Megatron-LM's
# ``--data-parallel-sharding-strategy`` choices.
_ALIASES = {
    "_HYBRID_SHARD_ZERO2": "HYBRID_SHARD_GRAD_OP",
    "optim_grads_params": "FULL_SHARD",
    "optim_grads": "SHARD_GRAD_OP",
    "optim": "SHARD_OPTIMIZER",
    "no_shard": "NO_SHARD",
}

_CUSTOM = "custom"


@dataclasses.dataclass(frozen=True)
class ShardingMode:
    """A sharding mode, validated against the installed megatron-fsdp.

    Attributes:
        name: The canonical name (``"FULL_SHARD"``, ...), or ``"custom"`` for raw placements.
        placements: What ``fully_shard`` gets for every unit.

    Raises:
        ValueError: If ``name`` is unknown, or megatron-fsdp cannot train with
            ``placements`` (the message says why, and which version can).
    """

    name: str
    placements: Placements

    def __post_init__(self) -> None:
        if self.name not in MODES and self.name != _CUSTOM:
            raise ValueError(f"ShardingMode: unknown name {self.name!r}.")
        problem = _megatron.placements_problem(self.placements)
        if problem is not None:
            shown = self.name if self.name != _CUSTOM else f"Placements({self.placements})"
            raise ValueError(
                f"sharding_strategy={shown}: megatron-fsdp {_megatron.VERSION} "
                f"cannot train it: {problem}. Supported here: {', '.join(supported_modes())}."
            )

    @property
    def mesh_ndim(self) -> int:
        """The rank of the data-parallel mesh these placements are for."""
        return len(self.placements.dp_axes)

    @property
    def defers_gradient_reduction(self) -> bool:
        """Whether gradients stay ``Partial`` until the last micro-batch (see ``_megatron``)."""
        return _megatron.defers_gradient_reduction(self.placements)


def _placements(shards: _Shards) -> Placements:
    return _megatron.sharding_placements(
        parameters=shards.parameters,
        gradients=shards.gradients,
        optimizer=shards.optimizer,
        hybrid=shards.hybrid,
    )


def supported_modes() -> list[str]:
    """The named modes the installed megatron-fsdp trains (pure; no process group)."""
    return [n for n, s in MODES.items() if _megatron.placements_problem(_placements(s)) is None]


def resolve_sharding_mode(option: Any, mesh_ndim: int, where: str) -> ShardingMode:
    """The :class:`ShardingMode` for a ``sharding_strategy`` option on a mesh of ``mesh_ndim``.

    Args:
        option: ``None`` (``FULL_SHARD`` on a 1-D mesh, ``HYBRID_SHARD`` on a 2-D one), a
            name of :data:`MODES` or an alias (torch FSDP's, Megatron-LM's), torch's
            ``ShardingStrategy`` enum, a ``megatron_fsdp.experimental.Placements``, or a
            :class:`ShardingMode`.
        mesh_ndim: 1 for ``device_mesh=None``, 2 for a ``(replicate, shard)`` mesh.
        where: Names the option's owner in errors.

    Raises:
        TypeError: For another type.
        ValueError: For an unknown name, a mode for the other mesh rank, or one the
            installed megatron-fsdp cannot run.
    """
    if isinstance(option, ShardingMode):
        mode = option
    elif isinstance(option, Placements):
        mode = ShardingMode(_CUSTOM, option)
    else:
        if option is None:
            name = "HYBRID_SHARD" if mesh_ndim == 2 else "FULL_SHARD"
        elif isinstance(option, enum.Enum):  # torch.distributed.fsdp.ShardingStrategy
            name = option.name
        elif isinstance(option, str):
            name = option
        else:
            raise TypeError(
                f"{where}: sharding_strategy must be None, a name ({', '.join(MODES)}), "
                "torch's ShardingStrategy or megatron_fsdp.experimental.Placements; got "
                f"{option!r} ({type(option).__name__})."
            )
        canonical = _ALIASES.get(name, name.upper())
        if canonical not in MODES:
            raise ValueError(
                f"{where}: sharding_strategy={option!r} is not a sharding mode; expected one "
                f"of {', '.join(MODES)} (or {', '.join(_ALIASES)}), or Placements."
            )
        try:
            mode = ShardingMode(canonical, _placements(MODES[canonical]))
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
    if mode.mesh_ndim != mesh_ndim:
        raise ValueError(_mesh_mismatch(mode, mesh_ndim, where))
    return mode


def _mesh_mismatch(mode: ShardingMode, mesh_ndim: int, where: str) -> str:
    if mode.name == _CUSTOM:
        return (
            f"{where}: sharding_strategy=Placements with {mode.mesh_ndim} dp_axes needs a "
            f"{mode.mesh_ndim}-D device_mesh, but device_mesh gives a {mesh_ndim}-D one."
        )
    if mode.mesh_ndim == 2:
        return (
            f"{where}: sharding_strategy={mode.name!r} replicates across the rows of a 2-D "
            "mesh: pass device_mesh=(replicate, shard) with replicate * shard == world size."
        )
    if mode.name == "NO_SHARD":
        return (
            f"{where}: sharding_strategy='NO_SHARD' replicates across every rank, so it "
            "needs no (replicate, shard) mesh: leave device_mesh=None."
        )
    hybrid = "HYBRID_" + mode.name.replace("FULL_", "")
    return (
        f"{where}: sharding_strategy={mode.name!r} is for a 1-D mesh, but device_mesh is "
        f"2-D (replicate, shard); use {hybrid!r} for its hybrid form, or device_mesh=None."
    )
