"""Benchmark 1: chunk-metadata cost, ours (rank-local) vs megatron-fsdp's gather-based helper.

For a model with P parameters (100 and 1,000) sharded at world size W (2 and 4), time:
    * ``attach_uneven_dtensor_metadata`` on the model + Adam state dicts (ours);
    * ``preprocess_state_dict_for_uneven_dtensor`` on the same state dicts (megatron-fsdp:
      one ``all_gather_object`` per DTensor);
    * one ``dcp.save`` of those state dicts, to put the metadata cost in proportion.
Both sides run in the same process tree, one after the other, so the ratio is fair on a
noisy machine. Targets (issue 6): >= 100x faster at 1,000 parameters for W=2 and 4, and
< 1% of a save's wall time.

Run: ``python -m benchmarks.bench_metadata`` from the repository root.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    ensure_optimizer_state,
    fsdp_placements,
    shard_module,
)
from lightning_megatron_fsdp.megatron._megatron import fully_shard_optimizer
from tests.harness import run_distributed

REPEATS = 5


def _model(num_parameters: int) -> nn.Module:
    """``num_parameters / 2`` Linear layers of varied widths (weight + bias each)."""
    layers = [nn.Linear(8 + i % 7, 5 + i % 11) for i in range(num_parameters // 2)]
    return nn.Sequential(*layers)


def _median_seconds(fn: object, repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(rank: int, world_size: int, num_parameters: int, directory: str) -> dict[str, float]:
    enable_cpu_execution()
    mesh = init_device_mesh("cpu", (world_size,))
    placements = fsdp_placements()
    torch.manual_seed(0)
    model = _model(num_parameters)
    shard_module(model, mesh, placements)
    optimizer = torch.optim.Adam(model.parameters())
    fully_shard_optimizer(optimizer)
    ensure_optimizer_state(optimizer)

    def state() -> tuple[dict, dict]:
        return get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)

    msd, osd = state()
    ours = _median_seconds(lambda: attach_uneven_dtensor_metadata(model, msd, osd))
    msd2, osd2 = state()
    theirs = _median_seconds(
        lambda: (
            preprocess_state_dict_for_uneven_dtensor(msd2),
            preprocess_state_dict_for_uneven_dtensor(osd2),
        ),
        repeats=max(1, REPEATS // 2),
    )
    counter = iter(range(1000))
    save = _median_seconds(
        lambda: dcp.save({"m": msd, "o": osd}, checkpoint_id=f"{directory}/save{next(counter)}"),
        repeats=3,
    )
    # The slowest rank bounds a collective operation's wall time.
    values = torch.tensor([ours, theirs, save], dtype=torch.float64)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {"ours": values[0].item(), "theirs": values[1].item(), "save": values[2].item()}


def main() -> int:
    rows = []
    for world_size in (2, 4):
        for num_parameters in (100, 1000):
            with tempfile.TemporaryDirectory() as directory:
                result = run_distributed(
                    _measure, world_size, num_parameters, directory, timeout=900
                )[0]
            rows.append((world_size, num_parameters, result))
    print(
        "| world | params | ours (ms) | megatron gather (ms) | speed-up | dcp.save (ms) |"
        " ours / save |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for world_size, num_parameters, r in rows:
        speedup = r["theirs"] / r["ours"]
        share = r["ours"] / r["save"]
        print(
            f"| {world_size} | {num_parameters} | {r['ours'] * 1e3:.2f} | {r['theirs'] * 1e3:.1f} "
            f"| {speedup:.0f}x | {r['save'] * 1e3:.0f} | {share:.2%} |"
        )
        if num_parameters == 1000:
            ok &= speedup >= 100 and share < 0.01
    print(f"\ntarget (>=100x at 1,000 parameters, <1% of a save): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
