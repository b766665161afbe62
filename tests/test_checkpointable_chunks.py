"""torch's ``CheckpointableTensor`` route against our DCP hooks: the same checkpoint, both ways.

Real ranks on a real gloo group save ``tests.models.PackedLM`` (packed, uneven, an empty
shard at 3 ranks) with its optimizer state through DCP twice: the DTensor state dicts with
the hooks of ``attach_uneven_dtensor_metadata``, and the same state dicts through
``as_checkpointable`` (inside the collective trap). The two ``.metadata`` files must agree
in everything but the save's own identity (``storage_meta``: path and save id), byte for
byte once that field is set aside, and each checkpoint must load through both routes into
a differently initialised twin, bit-exact.
On torch 2.13, which lacks the protocol, the route must refuse with its reason.
"""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.torch_version import TorchVersion

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    ensure_optimizer_state,
)
from lightning_megatron_fsdp.megatron.checkpointable_chunks import (
    PROTOCOL_AVAILABLE,
    as_checkpointable,
    dcp_view,
    keep_loaded_values,
)
from tests.harness import run_distributed
from tests.models import build_packed_lm, dp_mesh, shard_packed_lm, sharded_adam
from tests.test_checkpoint_roundtrip import _dtensors, _state_dicts, collectives_forbidden

ROUTES = ("hooks", "protocol")


def _prepared(seed: int, world_size: int) -> tuple[dict[str, Any], dict[str, DTensor]]:
    """A sharded model's and optimizer's state (hooks attached), and its DTensors by key."""
    model = shard_packed_lm(build_packed_lm(seed), dp_mesh(world_size))
    optimizer = sharded_adam(model)
    ensure_optimizer_state(optimizer)
    with torch.no_grad():
        for state in optimizer.state.values():  # distinct values, not ensure's zeros
            for name, value in state.items():
                if name != "step":
                    value.copy_(torch.randn_like(value))
    model_state, optimizer_state = _state_dicts(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    state = {"model": model_state, "optimizer": optimizer_state}
    return state, dict(_dtensors(model_state, optimizer_state))


def _worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    enable_cpu_execution()
    torch.manual_seed(rank)
    state, saved = _prepared(0, world_size)
    expected = {key: tensor.to_local().detach().clone() for key, tensor in saved.items()}
    facts: dict[str, Any] = {"empty_shards": sum(t.numel() == 0 for t in expected.values())}
    dcp.save(state, checkpoint_id=f"{root}/hooks")
    with collectives_forbidden():
        converted = as_checkpointable(state)
    dcp.save(converted, checkpoint_id=f"{root}/protocol")
    facts["mismatches"] = []
    for written in ROUTES:
        for reader in ROUTES:
            twin, loaded = _prepared(1, world_size)
            dcp.load(
                twin if reader == "hooks" else as_checkpointable(twin),
                checkpoint_id=f"{root}/{written}",
            )
            facts["mismatches"] += [
                f"{written} -> {reader}: {key}"
                for key, tensor in loaded.items()
                if not torch.equal(tensor.to_local(), expected[key])
            ]
    return facts


@pytest.mark.skipif(not PROTOCOL_AVAILABLE, reason="torch < 2.14: tested by the next test")
@pytest.mark.parametrize("world_size", [2, 3])
def test_either_route_writes_the_same_checkpoint_and_loads_the_other(
    world_size: int, tmp_path: Path
) -> None:
    facts = run_distributed(_worker, world_size, str(tmp_path), timeout=300)
    if world_size == 3:  # PackedLM at 3 ranks leaves a rank without rows of some tensor
        assert any(f["empty_shards"] for f in facts), facts
    assert all(not f["mismatches"] for f in facts), [f["mismatches"] for f in facts]
    hooks, protocol = (dcp.FileSystemReader(tmp_path / r).read_metadata() for r in ROUTES)
    differing = [
        field.name
        for field in dataclasses.fields(hooks)
        if getattr(hooks, field.name) != getattr(protocol, field.name)
    ]
    assert differing == ["storage_meta"], differing  # the path and the save's id
    assert hooks.state_dict_metadata and hooks.storage_data
    # Byte for byte too, but for that field: the pickles share (or not) the same objects.
    hooks.storage_meta = protocol.storage_meta = None
    assert pickle.dumps(hooks) == pickle.dumps(protocol)


def test_the_protocol_route_exists_from_torch_2_14_and_refuses_before() -> None:
    has_protocol = TorchVersion(torch.__version__) >= (2, 14)
    assert has_protocol == PROTOCOL_AVAILABLE
    if not PROTOCOL_AVAILABLE:
        with pytest.raises(RuntimeError, match=r"CheckpointableTensor.*hook route"):
            as_checkpointable({})


def _values_worker(rank: int, world_size: int, root: str) -> dict[str, Any]:
    enable_cpu_execution()
    state, _ = _prepared(0, world_size)
    saved = {"state_dict": state["model"], "optimizer_states": [state["optimizer"]]}
    groups = state["optimizer"]["param_groups"]
    expected = [(g["lr"], g["betas"]) for g in groups]
    dcp.save(dcp_view(saved), checkpoint_id=root)
    twin, _ = _prepared(1, world_size)
    for group in twin["optimizer"]["param_groups"]:
        group["lr"], group["betas"] = 123.0, (0.5, 0.5)
    targets = {"state_dict": twin["model"], "optimizer_states": [twin["optimizer"]]}
    view = dcp_view(targets)
    dcp.load(view, checkpoint_id=root)
    keep_loaded_values(targets, view)
    loaded = [(g["lr"], g["betas"]) for g in targets["optimizer_states"][0]["param_groups"]]
    return {"expected": expected, "loaded": loaded, "through_protocol": view is not targets}


def test_values_dcp_reads_as_bytes_reach_the_state_through_either_route(tmp_path: Path) -> None:
    """A load through :func:`dcp_view` (our save and load path) restores the values DCP
    stores as bytes (learning rates, betas) into the caller's state, not only into the
    view's copied containers; the tensors are checked above."""
    facts = run_distributed(_values_worker, 2, str(tmp_path), timeout=300)
    for rank_facts in facts:
        assert rank_facts["through_protocol"] == PROTOCOL_AVAILABLE
        assert rank_facts["loaded"] == rank_facts["expected"], rank_facts
        assert all(lr != 123.0 for lr, _ in rank_facts["loaded"])
