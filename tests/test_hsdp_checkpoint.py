"""HSDP checkpoints at the IO level: chunks against megatron-fsdp's oracle, and resharding
between HSDP meshes, to and from 1-D FSDP, at several sizes.

Ranks are real processes in a gloo group (``tests.harness``); the model is
``tests.models.PackedLM`` (nested units, a tie, a fragment in a padding gap, a 3-D
parameter), sharded with the strategy's own HSDP placements on a 2-D
``(replicate, shard)`` mesh, trained two Adam steps on the same batches on every rank, and
saved and loaded with ``MegatronFSDPCheckpointIO``.

Sources: HSDP on a (2, 2) mesh and 1-D FSDP on 4 ranks. Targets: (2, 2) (HSDP -> HSDP, and
1-D -> HSDP), (1, 2) and (2, 1) on 2 ranks (HSDP -> HSDP of another size; 1-D -> HSDP), (1,
3) on 3 ranks, and 1-D at 2 and 3 ranks (HSDP -> 1-D). Oracles, none of them the chunk
arithmetic under test:

* megatron-fsdp's ``gather_and_compute_chunk_metadata`` (an all-gather of every shard's
  shape over each mesh dim) for every model and optimizer DTensor on the (2, 2) mesh, and
  DCP's own ``.metadata``: each tensor tiled exactly once, by exactly the oracle's chunks
  (the replicas' duplicates written once);
* one process training the unsharded model on the same batches
  (``tests.models.train_unsharded``), for the full tensors each source's replicas
  assemble (every replica the same bits);
* those full tensors, bit for bit, for every row of every replica of every target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import chunk_metadata_by_fqn, enable_cpu_execution
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.strategies.strategy import fsdp_placements, hsdp_placements
from tests.harness import run_distributed
from tests.models import (
    build_packed_lm,
    dp_mesh,
    hsdp_mesh,
    shard_packed_lm,
    sharded_adam,
    train_unsharded,
)
from tests.scripts.fault_injection import LR, checkpoint_dict, live_state, step, zeroed_targets
from tests.shard_facts import (
    assemble,
    assert_close_to_reference,
    assert_matches_full,
    facts,
    reference_facts,
    same_bits,
)
from tests.test_checkpoint_roundtrip import _tiling_errors

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

TIMEOUT = 150.0
Mesh = tuple[int, ...]  # (world,) for 1-D FSDP, (replicate, shard) for HSDP
SOURCES: dict[str, Mesh] = {"hsdp": (2, 2), "fsdp": (4,)}
# world size -> the target meshes of that run, each loading every source.
TARGETS: dict[int, list[Mesh]] = {4: [(2, 2)], 2: [(1, 2), (2, 1), (2,)], 3: [(1, 3), (3,)]}


def _sharded(mesh: Mesh, seed: int | None) -> Any:
    enable_cpu_execution()
    model = build_packed_lm(seed)
    if len(mesh) == 1:
        return shard_packed_lm(model, dp_mesh(mesh[0]), placements=fsdp_placements())
    return shard_packed_lm(model, hsdp_mesh(*mesh), placements=hsdp_placements())


def _chunk(chunk: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _against_oracle(model: Any, state: dict[str, Any], path: Path) -> dict[str, Any]:
    """This rank's chunks (hooks and ``chunk_metadata_by_fqn``) against the gather oracle;
    on rank 0, the saved ``.metadata`` against every rank's oracle chunks."""
    by_fqn = chunk_metadata_by_fqn(model)
    mine, oracle, mismatched = {}, {}, []
    tensors = [(f"state_dict.{k}", v) for k, v in state["state_dict"].items()]
    for fqn, entries in state["optimizer_states"][0]["state"].items():
        tensors += [(f"optimizer_states.0.state.{fqn}.{k}", v) for k, v in entries.items()]
    for key, tensor in tensors:
        if not isinstance(tensor, DTensor):
            continue
        assert len(tensor.placements) == 2 and tensor.placements[0].is_replicate(), key
        oracle[key] = _chunk(gather_and_compute_chunk_metadata(tensor))
        mine[key] = [_chunk(c) for c in tensor.__create_chunk_list__()]
        if mine[key] != [oracle[key]]:
            mismatched.append(f"{key}: hook {mine[key]}, oracle {oracle[key]}")
        fqn = key.removeprefix("state_dict.")
        if fqn in by_fqn and _chunk(by_fqn[fqn]) != oracle[key]:
            mismatched.append(f"{key}: chunk_metadata_by_fqn {_chunk(by_fqn[fqn])}")
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, oracle)
    result: dict[str, Any] = {"mismatched": mismatched, "checked": len(oracle)}
    if dist.get_rank() == 0:
        metadata = FileSystemReader(path).read_metadata().state_dict_metadata
        result["tiling_errors"] = _tiling_errors(metadata)
        result["metadata_vs_oracle"] = [
            key
            for key in oracle
            if {_chunk(c) for c in metadata[key].chunks}
            != {o[key] for o in every if 0 not in o[key][1]}
        ]
    return result


def _save_and_load_at_4(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save both sources; check the HSDP source's chunks; load both into (2, 2)."""
    out: dict[str, Any] = {"saved": {}, "loaded": {}}
    plugin = MegatronFSDPCheckpointIO()
    for name, mesh in SOURCES.items():
        model = _sharded(mesh, seed=0)
        adam = sharded_adam(model, lr=LR)
        for seed in range(2):
            step(model, adam, seed)
        path = Path(root) / name
        plugin.save_checkpoint(checkpoint_dict(model, adam, 2), path)
        state = live_state(model, adam)
        out["saved"][name] = facts(state)
        if name == "hsdp":
            out["oracle"] = _against_oracle(model, state, path)
    out["loaded"] = _load_all(root, TARGETS[world_size])
    return out


def _load_all(root: str, targets: list[Mesh]) -> dict[str, Any]:
    """Every source loaded into zeroed targets on each of ``targets``."""
    plugin = MegatronFSDPCheckpointIO()
    loaded = {}
    for mesh in targets:
        for name in SOURCES:
            model = _sharded(mesh, seed=None)
            state = zeroed_targets(model, sharded_adam(model, lr=LR))
            global_step = plugin.load_checkpoint(Path(root) / name, state=state)["global_step"]
            loaded[f"{name} -> {mesh}"] = {"facts": facts(state), "global_step": global_step}
    return loaded


def _load_elsewhere(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {"loaded": _load_all(root, TARGETS[world_size])}


def _replicas(per_rank: list[Any], mesh: Mesh) -> list[list[Any]]:
    """Per replica, its ranks' facts in shard order (a 1-D mesh is one replica)."""
    shard = mesh[-1]
    return [per_rank[i : i + shard] for i in range(0, len(per_rank), shard)]


def test_hsdp_chunks_match_the_gather_oracle_and_reshard_to_and_from_1d(tmp_path: Path) -> None:
    at_4 = run_distributed(_save_and_load_at_4, 4, str(tmp_path), timeout=TIMEOUT)
    for result in at_4:
        assert result["oracle"]["mismatched"] == []
        assert result["oracle"]["checked"] == 15 + 2 * 14  # model entries, Adam moments
    assert at_4[0]["oracle"]["tiling_errors"] == []
    assert at_4[0]["oracle"]["metadata_vs_oracle"] == []

    # The full tensors of each source: every replica assembles the same bits, and they
    # are what one unsharded process trained.
    reference = reference_facts(*train_unsharded(2, lr=LR))
    full = {}
    for name, mesh in SOURCES.items():
        replicas = [assemble(r) for r in _replicas([r["saved"][name] for r in at_4], mesh)]
        for other in replicas[1:]:
            assert other.keys() == replicas[0].keys(), name
            for key, value in replicas[0].items():
                tensor = isinstance(value, torch.Tensor)
                assert same_bits(other[key], value) if tensor else other[key] == value, key
        assert_close_to_reference(replicas[0], reference, atol=1e-6)
        full[name] = replicas[0]

    results = {4: at_4}
    for world_size in (2, 3):
        results[world_size] = run_distributed(
            _load_elsewhere, world_size, str(tmp_path), timeout=TIMEOUT
        )
    checked = []
    for world_size, targets in TARGETS.items():
        for mesh in targets:
            for name in SOURCES:
                key = f"{name} -> {mesh}"
                per_rank = [r["loaded"][key] for r in results[world_size]]
                assert all(r["global_step"] == 2 for r in per_rank), key
                for replica in _replicas([r["facts"] for r in per_rank], mesh):
                    assert_matches_full(full[name], replica)
                checked.append(key)
    assert len(checked) == 2 * sum(len(t) for t in TARGETS.values())
