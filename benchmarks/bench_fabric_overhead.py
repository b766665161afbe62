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
real ranks (gloo, CPU), per-rank batch 32, the two sizes of benchmark 5. The loops run in
the same two processes (one process group, Fabric's), each on its own copy of the model:
the Fabric loop, the hand loop, and a second hand loop, the control. They take turns in
blocks of ``BLOCK`` steps, each block in the next of the six orders of the three, so a load
spike on a shared machine hits all alike; a step is timed from fetching its batch to the
end of ``zero_grad``, the first block of each is warm-up, and steps/s is one over the median
step time of the slower rank. The control against the hand loop shows what the method
itself reads into two identical loops (noise and position), so a Fabric / loop ratio is
read against it. Wall time on a loaded machine is mostly waiting for a core and for the
peer, so each step's process CPU time is also taken (all threads, gloo's included): the work
a step does, what decides steps/s on an idle machine. Two more load-independent columns:
Python function calls per step (``cProfile``'s count) and the Fabric strategy's own work
after each backward (joining gradient reduction, releasing prefetches, binding
``.full_tensor()`` of the gradients).
Each loop reports its first losses, so all provably train the same model on the same data.

Target (issue 25): the Fabric loop's steps/s within 5% of the hand loop's.

Run: ``python -m benchmarks.bench_fabric_overhead [--quick] [--json PATH]`` from the repo
root.
"""

from __future__ import annotations

import cProfile
import itertools
import logging
import pstats
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
    Block,
    OverheadModel,
)
from lightning_megatron_fsdp import (
    enable_cpu_execution,
    fsdp_placements,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.megatron._megatron import (
    fully_shard_optimizer,
    join_gradient_reduction,
    release_prefetched,
)
from lightning_megatron_fsdp.megatron.gather import bind_full_tensor
from tests.harness import run_distributed

__all__ = ["format_table", "main", "run"]

BLOCK = 5  # steps per side before switching
# name -> blocks per loop (of BLOCK steps; the first is warm-up; six orders cycle)
BLOCKS: dict[str, int] = {"medium": 18, "small": 48}
QUICK_BLOCKS = 6


def _loader(width: int, steps: int, rank: int, world_size: int) -> DataLoader:
    from benchmarks.bench_strategy_overhead import _dataset

    dataset = _dataset(width, steps, world_size)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=BATCH, sampler=sampler)


def _model(width: int, depth: int) -> OverheadModel:
    torch.manual_seed(0)
    return OverheadModel(width, depth)


def _step(model: Any, optimizer: Any, batches: Any, backward: Any) -> tuple[float, float]:
    """One step, fetching its batch included: its wall time and this process's CPU time
    (every thread's, gloo's included; not the time spent waiting for a core or a peer)."""
    wall, cpu = time.perf_counter(), time.process_time()
    x, y = next(batches)
    loss = model(x, y)
    backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    return time.perf_counter() - wall, time.process_time() - cpu


def _hand_side(
    width: int, depth: int, steps: int, rank: int, world_size: int
) -> tuple[OverheadModel, tuple[Any, ...]]:
    """The loop a user writes on ``fully_shard``: the model and its step's arguments."""
    model = _model(width, depth)
    mesh = init_device_mesh("cpu", (world_size,))
    with sharding_scope():  # the Fabric strategy's units: the blocks, then the head
        for block in model.blocks:
            shard_module(block, mesh, fsdp_placements())
        shard_module(model.head, mesh, fsdp_placements())
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    fully_shard_optimizer(optimizer)
    loader = iter(_loader(width, steps, rank, world_size))
    return model, (model, optimizer, loader, lambda t: t.backward())


def _interleaved(rank: int, world_size: int, width: int, depth: int, blocks: int) -> dict[str, Any]:
    """The Fabric loop, the hand loop and a second hand loop (the control) in this
    process, in blocks of ``BLOCK`` steps, each block in another order of the three."""
    from lightning.fabric import Fabric

    from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy

    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    steps = (blocks + 1) * BLOCK  # one more block for the call counts
    strategy = MegatronFSDPStrategy(auto_wrap_policy={Block}, timeout=TIMEOUT)
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()  # joins the process group every loop uses
    fabric_module = _model(width, depth)
    fabric_model = fabric.setup_module(fabric_module)
    fabric_optimizer = fabric.setup_optimizers(torch.optim.Adam(fabric_model.parameters(), lr=LR))
    fabric_loader = fabric.setup_dataloaders(
        _loader(width, steps, rank, world_size), use_distributed_sampler=False
    )
    enable_cpu_execution()
    hand_model, hand = _hand_side(width, depth, steps, rank, world_size)
    control_model, control = _hand_side(width, depth, steps, rank, world_size)
    sides = {
        "fabric": (fabric_model, fabric_optimizer, iter(fabric_loader), fabric.backward),
        "loop": hand,
        "control": control,
    }
    orders = list(itertools.permutations(sides))
    times: dict[str, list[float]] = {side: [] for side in sides}
    for index in range(blocks):
        for side in orders[index % len(orders)]:
            times[side].extend(_step(*sides[side]) for _ in range(BLOCK))
    return {
        "times": times,
        "losses": {
            "fabric": fabric_module.losses,
            "loop": hand_model.losses,
            "control": control_model.losses,
        },
        "calls": {side: _calls_per_step(sides[side]) for side in ("fabric", "loop")},
        "epilogue_s": _epilogue_seconds(fabric_module),
    }


def _calls_per_step(side: tuple[Any, ...]) -> float:
    """Python function calls per step (``cProfile``'s count: independent of the load)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(BLOCK):
        _step(*side)
    profile.disable()
    return pstats.Stats(profile).total_calls / BLOCK  # type: ignore[attr-defined]


def _epilogue_seconds(module: Any, repeats: int = 200) -> float:
    """Median time of the Fabric strategy's own work after each backward (rank-local)."""
    durations = []
    for _ in range(repeats):
        start = time.perf_counter()
        join_gradient_reduction(module)
        release_prefetched(module)
        bind_full_tensor(module, gradients=True)
        durations.append(time.perf_counter() - start)
    return median(durations)


def run(*, quick: bool = False) -> dict[str, Any]:
    """Both loops interleaved in the same 2 processes; steps/s from median step times."""
    sizes = QUICK_SIZES if quick else SIZES
    result: dict[str, Any] = {"quick": quick, "block": BLOCK, "rows": []}
    for name, (width, depth, _) in sizes.items():
        blocks = QUICK_BLOCKS if quick else BLOCKS[name]
        ranks = run_distributed(
            _interleaved, 2, width, depth, blocks, init_process_group=False, timeout=1800
        )
        sides = ("fabric", "loop", "control")
        medians = {
            side: max(median([w for w, _ in r["times"][side][BLOCK:]]) for r in ranks)
            for side in sides
        }
        cpu = {
            side: max(median([c for _, c in r["times"][side][BLOCK:]]) for r in ranks)
            for side in sides
        }
        fabric, loop = 1 / medians["fabric"], 1 / medians["loop"]
        losses = ranks[0]["losses"]
        parameters = sum(p.numel() for p in OverheadModel(width, depth).parameters())
        result["rows"].append(
            {
                "size": name,
                "parameters": parameters,
                "steps": blocks * BLOCK,
                "fabric_steps_s": fabric,
                "loop_steps_s": loop,
                "fabric_over_loop": fabric / loop,
                "control_over_loop": medians["loop"] / medians["control"],
                "cpu_ms": {side: cpu[side] * 1e3 for side in sides},
                "cpu_fabric_over_loop": cpu["fabric"] / cpu["loop"],
                "cpu_control_over_loop": cpu["control"] / cpu["loop"],
                "overhead_ms": (medians["fabric"] - medians["loop"]) * 1e3,
                "met": fabric / loop >= 0.95,
                "same_losses": losses["fabric"] == losses["loop"] == losses["control"],
                "calls_per_step": {s: ranks[0]["calls"][s] for s in ("fabric", "loop")},
                "epilogue_ms": max(r["epilogue_s"] for r in ranks) * 1e3,
                "losses": losses,
                "times": [r["times"] for r in ranks],
            }
        )
    return result


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s result."""
    lines = [
        f"World size 2, per-rank batch {BATCH}, Adam; the Fabric loop, the hand loop and a "
        f"second hand loop (control) in the same processes, in turns of {result['block']} "
        "steps (six orders cycling); steps/s = 1 / median step time (slower rank), first "
        "block of each excluded. Python calls per step: "
        "cProfile's count over one more block (rank 0). Strategy epilogue: the Fabric "
        "strategy's own work after each backward, median of 200 (slower rank). CPU per "
        "step: the process's CPU time (all its threads; not time spent waiting for a core "
        "or the peer), median, slower rank.",
        "",
        "| model | parameters | steps per side | fully_shard loop steps/s | Fabric loop steps/s "
        "| Fabric / loop | control / loop | added per step (ms) "
        "| CPU ms per step (loop / Fabric / control) | CPU Fabric / loop | CPU control / loop "
        "| Python calls per step (loop / Fabric) "
        "| strategy epilogue (ms) | same losses | target (>= 0.95) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result["rows"]:
        calls, c = row["calls_per_step"], row["cpu_ms"]
        lines.append(
            f"| {row['size']} | {row['parameters'] / 1e6:.3f} M | {row['steps']} "
            f"| {row['loop_steps_s']:.1f} | {row['fabric_steps_s']:.1f} "
            f"| {row['fabric_over_loop']:.3f} | {row['control_over_loop']:.3f} "
            f"| {row['overhead_ms']:+.2f} "
            f"| {c['loop']:.2f} / {c['fabric']:.2f} / {c['control']:.2f} "
            f"| {row['cpu_fabric_over_loop']:.3f} | {row['cpu_control_over_loop']:.3f} "
            f"| {calls['loop']:.0f} / {calls['fabric']:.0f} | {row['epilogue_ms']:.3f} "
            f"| {'yes' if row['same_losses'] else 'NO'} | {'met' if row['met'] else 'NOT met'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the result as JSON."""
    return bench_main(__doc__, run, format_table, "one small model, few blocks", argv)


if __name__ == "__main__":
    sys.exit(main())
