"""DCP's coordinator work per save at 64 to 8,192 ranks, from synthetic local plans.

At thousands of ranks the save's planning (every rank's local plan gathered to the
coordinator, deduplicated, turned into the global plan and ``.metadata``, and scattered
back) is what times out. This builds the local plans every rank of a 7B-parameter
Llama-shaped model would send (Megatron-FSDP layout: each unit's parameters packed into one
buffer split evenly across the ranks, so each rank holds row ranges of the few parameters
its slice crosses; fp32 main weights plus Adam's ``exp_avg`` and ``exp_avg_sq``) and runs
the coordinator's part of DCP's planner on them, in one process (no process group):

- ``plans MB``: the local plans pickled, what the coordinator gathers;
- ``plan s``: ``DefaultSavePlanner.create_global_plan`` on them (dedup, global plan,
  metadata, validation), the first save of a run;
- ``cached s`` / ``cached MB``: the same on a later save of the same layout with DCP's plan
  caching (what ``checkpoint.save.write_save`` uses): every rank sends an empty plan;
- ``.metadata MB``: the pickled ``Metadata`` with one storage entry per record (with our
  ``lmf_record`` annotation), what rank 0 writes and every loader reads.

Above ``--measure-up-to`` ranks (default: every size asked for) the first save's planning
is not run whole: DCP's validation compares every pair of row chunks of a wide tensor
(quadratic in the chunks per tensor), which can take too long on a small machine. There
dedup and the global plan are measured whole, the validation is measured on the keys outside
the layers and on three layers (every layer unit has the same chunk geometry), the median
layer scaled by the layer count; the row says "extrapolated" (an estimate only:
benchmarks/RESULTS.md compares it with whole runs). The cached path and the
``.metadata`` size are always measured. ``--check-extrapolation`` also runs the
extrapolation on the measured rows, to compare.

    python -m benchmarks.bench_planning [--ranks 64 256 1024 4096 8192] [--measure-up-to N]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import pickle
import statistics
import time
from collections import ChainMap
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    _validate_global_plan,
    create_default_global_save_plan,
    dedup_save_plans,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from lightning_megatron_fsdp import _torch

VOCAB, HIDDEN, FFN, LAYERS = 32000, 4096, 11008, 32
STATES = ("", ".exp_avg", ".exp_avg_sq")
SAMPLED_LAYERS = (0, LAYERS // 2, LAYERS - 1)  # every layer unit has the same chunk geometry


def units() -> list[list[tuple[str, tuple[int, ...]]]]:
    """The FSDP units of a Llama-2-7B shape: (FQN, shape) per parameter."""
    layers = [
        [
            (f"layers.{i}.input_norm.weight", (HIDDEN,)),
            (f"layers.{i}.attn.q.weight", (HIDDEN, HIDDEN)),
            (f"layers.{i}.attn.k.weight", (HIDDEN, HIDDEN)),
            (f"layers.{i}.attn.v.weight", (HIDDEN, HIDDEN)),
            (f"layers.{i}.attn.o.weight", (HIDDEN, HIDDEN)),
            (f"layers.{i}.post_norm.weight", (HIDDEN,)),
            (f"layers.{i}.mlp.gate.weight", (FFN, HIDDEN)),
            (f"layers.{i}.mlp.up.weight", (FFN, HIDDEN)),
            (f"layers.{i}.mlp.down.weight", (HIDDEN, FFN)),
        ]
        for i in range(LAYERS)
    ]
    return [
        [("embed.weight", (VOCAB, HIDDEN))],
        *layers,
        [("norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))],
    ]


def local_plans(world: int) -> list[SavePlan]:
    """Every rank's local save plan (what DCP's ``create_local_plan`` returns)."""
    properties = TensorProperties(dtype=torch.float32)
    items: list[list[WriteItem]] = [[] for _ in range(world)]
    for unit in units():
        total = sum(math.prod(shape) for _, shape in unit)
        per_rank = -(-total // world)
        start = 0
        for fqn, shape in unit:
            row = math.prod(shape[1:])
            rows = shape[0]
            first, last = start // per_rank, (start + rows * row - 1) // per_rank
            for rank in range(first, last + 1):
                lo = max(0, -(-(rank * per_rank - start) // row))
                hi = min(rows, -(-((rank + 1) * per_rank - start) // row))
                if hi <= lo:
                    continue
                offsets = torch.Size((lo, *([0] * (len(shape) - 1))))
                sizes = torch.Size((hi - lo, *shape[1:]))
                for suffix in STATES:
                    key = (
                        f"state_dict.{fqn}"
                        if not suffix
                        else f"optimizer_states.0.state.{fqn}{suffix}"
                    )
                    items[rank].append(
                        WriteItem(
                            index=MetadataIndex(key, offsets),
                            type=WriteItemType.SHARD,
                            tensor_data=TensorWriteData(
                                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                properties=properties,
                                size=torch.Size(shape),
                            ),
                        )
                    )
            start += rows * row
    plans = []
    for rank_items in items:
        mapping = {item.index.fqn: (item.index.fqn,) for item in rank_items}
        plans.append(SavePlan(rank_items, planner_data=mapping))
    return plans


def metadata_bytes(metadata: Any, global_plan: list[SavePlan]) -> int:
    """The pickled ``.metadata``: one storage entry per record, each with our annotation."""
    storage = {}
    for rank, plan in enumerate(global_plan):
        offset = 0
        for item in plan.items:
            info = _torch.storage_info(f"__{rank}_0.distcp", offset, 1 << 20)
            info.lmf_record = {"crc32c": 0x12345678, "payload": [0, 512], "byteorder": "little"}
            storage[item.index] = info
            offset += 1 << 20
    metadata.storage_data = storage
    return len(pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))


def extrapolated_first_plan(
    key: str, plans: list[SavePlan]
) -> tuple[list[SavePlan], Metadata, float]:
    """DCP's ``_create_global_plan`` step by step (dedup, global plan, merged mappings,
    validation), with the validation timed on the keys outside the layers and on three
    layers, the median layer scaled by ``LAYERS``; the caches filled as DCP's caching path does
    after a successful plan. Returns the global plan, the metadata and the estimated
    seconds."""
    began = time.perf_counter()
    global_plan, metadata = create_default_global_save_plan(dedup_save_plans(plans, False))
    merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
    metadata = dataclasses.replace(metadata, planner_data=merged)
    built = time.perf_counter() - began
    keys = metadata.state_dict_metadata
    rest = {k: v for k, v in keys.items() if ".layers." not in k}
    began = time.perf_counter()
    errors = _validate_global_plan(global_plan, Metadata(state_dict_metadata=rest))
    outside = time.perf_counter() - began
    per_layer = []
    for layer in SAMPLED_LAYERS:
        sample = {k: v for k, v in keys.items() if f".layers.{layer}." in k}
        began = time.perf_counter()
        errors += _validate_global_plan(global_plan, Metadata(state_dict_metadata=sample))
        per_layer.append(time.perf_counter() - began)
    if errors:
        raise AssertionError(f"the synthetic plan does not validate: {errors[:3]}")
    SavePlanner._cached_all_plans[key] = plans
    SavePlanner._cached_global_plan[key] = global_plan
    SavePlanner._cached_metadata[key] = metadata
    return global_plan, metadata, built + outside + LAYERS * statistics.median(per_layer)


def measure(world: int, extrapolate: bool) -> dict[str, Any]:
    key = f"bench:{world}:{extrapolate}"
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.clear()
    plans = local_plans(world)
    items = sum(len(p.items) for p in plans)
    gathered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in plans)
    planner = _torch.caching_save_planner(key)
    gc.collect()
    if extrapolate:
        global_plan, metadata, planned = extrapolated_first_plan(key, plans)
    else:
        began = time.perf_counter()
        global_plan, metadata = planner.create_global_plan(plans)
        planned = time.perf_counter() - began
    scattered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in global_plan)
    for rank_plan in global_plan:  # every rank's finish_plan fills the caches
        planner._pending_local_plan = rank_plan  # (each rank caches its own in DCP)
        planner.finish_plan(rank_plan)
    empty = [SavePlan([], usable=False) for _ in range(world)]
    cached_gathered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in empty)
    later = _torch.caching_save_planner(key)
    began = time.perf_counter()
    delta, _ = later.create_global_plan(empty)
    cached = time.perf_counter() - began
    cached_scattered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in delta)
    size = metadata_bytes(metadata, global_plan)
    return {
        "ranks": world,
        "items": items,
        "plans_mb": gathered / 1e6,
        "scatter_mb": scattered / 1e6,
        "plan_s": planned,
        "extrapolated": extrapolate,
        "cached_s": cached,
        "cached_mb": (cached_gathered + cached_scattered) / 1e6,
        "metadata_mb": size / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    parser.add_argument(
        "--measure-up-to",
        type=int,
        default=None,
        help="run the first save's planning whole up to this many ranks (default: all); "
        "extrapolate above",
    )
    parser.add_argument(
        "--check-extrapolation",
        action="store_true",
        help="also extrapolate the measured rows (to compare the estimate with the run)",
    )
    args = parser.parse_args()
    print(
        "| ranks | records | plans gathered MB | plans scattered MB | plan s (first save) "
        "| cached s (later saves) | cached MB moved | .metadata MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for world in args.ranks:
        modes = [args.measure_up_to is not None and world > args.measure_up_to]
        if args.check_extrapolation and not modes[0]:
            modes.append(True)
        for extrapolate in modes:
            r = measure(world, extrapolate)
            how = "extrapolated" if extrapolate else "measured"
            print(
                f"| {r['ranks']} | {r['items']} | {r['plans_mb']:.1f} | {r['scatter_mb']:.1f} "
                f"| {r['plan_s']:.2f} ({how}) | {r['cached_s']:.4f} | {r['cached_mb']:.2f} "
                f"| {r['metadata_mb']:.1f} |",
                flush=True,
            )
            gc.collect()


if __name__ == "__main__":
    main()
