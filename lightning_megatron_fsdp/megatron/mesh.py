"""The data-parallel device mesh: the request checked against the world size on every rank
before any collective, and the 1-D or 2-D (HSDP) mesh built on process groups that carry the
user's timeout, so a crashed peer or a mesh that does not span the world fails instead of
hanging.
"""

from __future__ import annotations

import math
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_megatron_fsdp.megatron import _megatron

__all__ = [
    "MeshRequest",
    "build_device_mesh",
    "check_mesh_fits_world",
    "mesh_ndim",
    "validate_device_mesh",
]

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"

#: ``None`` (1-D FSDP over the world), ``(replicate, shard)`` (2-D HSDP), or a user mesh.
MeshRequest = tuple[int, int] | DeviceMesh | None


def describe_mesh(request: MeshRequest) -> str:
    """A short text for errors: ``DeviceMesh(shape=(2, 2))`` or the tuple."""
    if isinstance(request, DeviceMesh):
        return f"DeviceMesh(shape={tuple(request.shape)})"
    return repr(request)


def validate_device_mesh(device_mesh: object, where: str) -> MeshRequest:
    """Return the request in canonical form.

    Raises:
        TypeError: Neither ``None``, a ``(replicate, shard)`` pair of ints nor a mesh.
        ValueError: A size below 1.
    """
    if device_mesh is None or isinstance(device_mesh, DeviceMesh):
        return device_mesh
    if (
        not isinstance(device_mesh, tuple | list)
        or len(device_mesh) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in device_mesh)
    ):
        raise TypeError(
            f"{where}: device_mesh must be None, a (replicate, shard) tuple of two ints, "
            f"or a DeviceMesh; got {device_mesh!r}."
        )
    if min(device_mesh) < 1:
        raise ValueError(f"{where}: device_mesh sizes must be >= 1, got {tuple(device_mesh)!r}.")
    return (device_mesh[0], device_mesh[1])


def mesh_ndim(request: MeshRequest) -> int:
    """The rank of the mesh a validated request builds: 1 for ``None``, 2 for a pair."""
    if isinstance(request, DeviceMesh):
        return request.ndim
    return 1 if request is None else 2


def check_mesh_fits_world(request: MeshRequest, world_size: int, detail: str, where: str) -> None:
    """Raise (on every rank, before any collective) unless the mesh spans the world.

    Args:
        request: The validated request.
        world_size: Number of processes.
        detail: How the world size came about, for the message.
        where: Names the caller in errors.

    Raises:
        ValueError: Naming both sizes and a mesh that would fit.
    """
    if isinstance(request, DeviceMesh):
        size = request.size()
    else:
        size = math.prod(request or (world_size,))
    if size != world_size:
        raise ValueError(
            f"{where}: device_mesh={describe_mesh(request)} spans {size} processes, but the "
            f"world has {world_size} ({detail}). Every process is a data-parallel rank: "
            f"choose (replicate, shard) with replicate * shard == {world_size}, e.g. "
            f"(1, {world_size}), or leave device_mesh=None for plain FSDP."
        )


def _mesh_of(model: nn.Module) -> DeviceMesh | None:
    for group in _megatron.parameter_groups(model):
        return _megatron.group_mesh(group)
    return None


def build_device_mesh(
    request: MeshRequest,
    *,
    model: nn.Module,
    world_size: int,
    device_type: str,
    timeout: timedelta | None,
    where: str,
) -> DeviceMesh:
    """The mesh ``model`` is sharded on, else a new one for ``request``.

    Args:
        request: The validated request.
        model: The model to train (a second ``fit`` finds it sharded already).
        world_size: Number of processes (the default group's size).
        device_type: ``"cuda"``, ``"cpu"``, ...
        timeout: Timeout of the 2-D groups created here.
        where: Names the caller in errors.

    Raises:
        ValueError: If the model is sharded on another mesh shape, or a user mesh is of
            another device type or not 1-D/2-D.
    """
    existing = _mesh_of(model)
    if existing is not None:
        wanted = (
            tuple(request.shape) if isinstance(request, DeviceMesh) else (request or (world_size,))
        )
        if tuple(existing.shape) != tuple(wanted):
            raise ValueError(
                f"{where}: the model is already sharded on a mesh of shape "
                f"{tuple(existing.shape)}, but this strategy asks for {tuple(wanted)}. A "
                "sharded model keeps its mesh; use the same device_mesh (and world size) as "
                "the run that sharded it."
            )
        return existing
    if isinstance(request, DeviceMesh):
        if request.device_type != device_type or request.ndim not in (1, 2):
            raise ValueError(
                f"{where}: device_mesh must be a 1-D or 2-D {device_type!r} mesh, got a "
                f"{request.ndim}-D {request.device_type!r} mesh."
            )
        return request
    if request is None:
        return DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=(SHARD_DIM,))
    ranks = torch.arange(world_size).view(request)
    # new_subgroups_by_enumeration is a collective every rank enters in the same order:
    # shard groups are the rows of the rank grid, replicate groups its columns.
    shard_group, _ = dist.new_subgroups_by_enumeration(ranks.tolist(), timeout=timeout)
    replicate_group, _ = dist.new_subgroups_by_enumeration(ranks.T.tolist(), timeout=timeout)
    return DeviceMesh.from_group(
        [replicate_group, shard_group],
        device_type,
        mesh=ranks,
        mesh_dim_names=(REPLICATE_DIM, SHARD_DIM),
    )
