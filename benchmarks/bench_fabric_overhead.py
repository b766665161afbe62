"""Benchmark 6: steps/s of a Fabric loop with our Fabric strategy vs the same loop by hand.

The Fabric strategy adds Fabric's wrappers (``_FabricModule``, ``_FabricOptimizer``, the
loader wrapper), the precision plugin's contexts and its own per-backward work (joining
gradient reduction, releasing unconsumed prefetches, binding ``.full_tensor()``) on top of
what Megatron-FSDP itself costs. The reference is the loop a user would write on
megatron-fsdp's ``fully_shard`` directly, over the very same units and data: every
``Block``, then the top-level ``head``, sharded with ``shard_module`` in one sharding
scope; ``fully_shard_optimizer``; then ``loss = model(x, y)``, ``backward``, ``step``,
``zero_grad`` over the same ``DistributedSampler`` loader.

Setup: ``bench_strategy_overhead.OverheadModel`` (residual MLP blocks as units), Adam, 2
real ranks (gloo, CPU), per-rank batch 32, the two sizes of benchmark 5. Each run is a
fresh process tree; the two sides alternate A B A B. Steps/s in steady state: from the end
of warm-up step ``WARMUP`` to the end of the last step. Each run reports its first losses,
so both sides provably train the same model on the same data.

Target (issue 25): the Fabric loop's steps/s within 5% of the hand loop's.

Run: ``python -m benchmarks.bench_fabric_overhead [--quick] [--json PATH]`` from the repo
root.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

from benchmarks.bench_save_load import bench_main, median
from benchmarks.bench_strategy_overhead import (
    BATCH,
    LR,
    QUICK_SIZES,
    SIZES,
    TIMEOUT,
    WARMUP,
    Block,
    OverheadModel,
)
from lightning_megatron_fsdp import (
    enable_cpu_execution,
    fsdp_placements,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.megatron._megatron import fully_shard_optimizer
from tests.harness import run_distributed

__all__ = ["format_table", "main", "run"]


def _loader(width: int, steps: int, rank: int, world_size: int) -> DataLoader:
    from benchmarks.bench_strategy_overhead import _dataset

    dataset = _dataset(width, steps, world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def _model(width: int, depth: int) -> OverheadModel:
    torch.manual_seed(0)
    return OverheadModel(width, depth)


def _train(model: Any, optimizer: Any, loader: Any, steps: int, backward: Any) -> list[float]:
    ends = []
    for x, y in loader:
        loss = model(x, y)
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
        if len(ends) == steps:
            break
    return ends


def _fabric_loop(rank: int, world_size: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    from lightning.fabric import Fabric

    from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy

    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    strategy = MegatronFSDPStrategy(auto_wrap_policy={Block}, timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    module = _model(width, depth)
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(
        _loader(width, steps, rank, world_size), use_distributed_sampler=False
    )
    ends = _train(model, optimizer, loader, steps, fabric.backward)
    return {"ends": ends, "losses": module.losses}


def _hand_loop(rank: int, world_size: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    enable_cpu_execution()
    model = _model(width, depth)
    mesh = init_device_mesh("cpu", (world_size,))
    with sharding_scope():  # the Fabric strategy's units: the blocks, then the head
        for block in model.blocks:
            shard_module(block, mesh, fsdp_placements())
        shard_module(model.head, mesh, fsdp_placements())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    fully_shard_optimizer(optimizer)
    ends = _train(
        model, optimizer, _loader(width, steps, rank, world_size), steps, lambda t: t.backward()
    )
    return {"ends": ends, "losses": model.losses}


def _steps_per_second(ranks: list[dict[str, Any]], steps: int) -> float:
    """Steady-state steps/s of the slowest rank."""
    rates = []
    for r in ranks:
        ends = r["ends"]
        if len(ends) != steps:
            raise RuntimeError(f"expected {steps} steps, a rank ran {len(ends)}")
        rates.append((steps - WARMUP) / (ends[-1] - ends[WARMUP - 1]))
    return min(rates)


def run(*, quick: bool = False, repeats: int = 5) -> dict[str, Any]:
    """Alternate the Fabric loop and the hand loop at world size 2; steps/s medians."""
    sizes = QUICK_SIZES if quick else SIZES
    repeats = 1 if quick else repeats
    result: dict[str, Any] = {"quick": quick, "repeats": repeats, "rows": []}
    for name, (width, depth, steps) in sizes.items():
        rates: dict[str, list[float]] = {"fabric": [], "loop": []}
        losses: dict[str, list[float]] = {}
        for _ in range(repeats):
            for side, fn, init in (("loop", _hand_loop, True), ("fabric", _fabric_loop, False)):
                ranks = run_distributed(
                    fn, 2, width, depth, steps, init_process_group=init, timeout=600
                )
                rates[side].append(_steps_per_second(ranks, steps))
                losses[side] = ranks[0]["losses"]
        fabric, loop = median(rates["fabric"]), median(rates["loop"])
        same = losses["fabric"] == losses["loop"]
        parameters = sum(p.numel() for p in OverheadModel(width, depth).parameters())
        result["rows"].append(
            {
                "size": name,
                "parameters": parameters,
                "steps": steps,
                "fabric_steps_s": fabric,
                "loop_steps_s": loop,
                "fabric_over_loop": fabric / loop,
                "overhead_ms": (1 / fabric - 1 / loop) * 1e3,
                "met": fabric / loop >= 0.95,
                "same_losses": bool(same),
                "losses": losses,
                "rates": rates,
            }
        )
    return result


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s result."""
    lines = [
        f"World size 2, per-rank batch {BATCH}, Adam; steady-state steps/s (after {WARMUP} "
        f"warm-up steps), median of {result['repeats']} alternating runs per side.",
        "",
        "| model | parameters | steps | fully_shard loop steps/s | Fabric loop steps/s "
        "| Fabric / loop | added per step (ms) | same losses | target (>= 0.95) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['size']} | {row['parameters'] / 1e6:.3f} M | {row['steps']} "
            f"| {row['loop_steps_s']:.1f} | {row['fabric_steps_s']:.1f} "
            f"| {row['fabric_over_loop']:.3f} | {row['overhead_ms']:+.2f} "
            f"| {'yes' if row['same_losses'] else 'NO'} | {'met' if row['met'] else 'NOT met'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the result as JSON."""
    return bench_main(__doc__, run, format_table, "one small model, one run per side", argv)


if __name__ == "__main__":
    sys.exit(main())
