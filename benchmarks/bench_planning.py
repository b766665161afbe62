"""The coordinator's work per save at 64 to 8,192 ranks, from synthetic local plans.

At thousands of ranks the save's planning (every rank's local plan gathered to the
coordinator, deduplicated, turned into the global plan and ``.metadata``, and scattered
back) is what times out. This builds the local plans every rank of a 7B-parameter
Llama-shaped model would send (Megatron-FSDP layout: each unit's parameters packed into one
buffer split evenly across the ranks, so each rank holds row ranges of the few parameters
its slice crosses; fp32 main weights plus Adam's ``exp_avg`` and ``exp_avg_sq``) and runs
the coordinator's part of the planning on them, in one process (no process group), whole
at every size:

- ``plans MB``: the local plans pickled, what the coordinator gathers;
- ``first save``: ``create_global_plan`` on them (dedup, global plan, metadata,
  validation) through DCP's default planner and through the planner a save uses
  (``checkpoint.save_plan``), on the same plans, and their ratio;
- ``later saves`` / ``cached MB``: the same on a later save of the same layout with DCP's
  plan caching (what ``checkpoint.save.write_save`` uses): every rank sends an empty plan;
- ``.metadata MB``: the pickled ``Metadata`` with one storage entry per record (with our
  ``lmf_record`` annotation), what rank 0 writes and a load reads;
- ``index``: what rank 0 of a save adds to write ``.metadata`` cut by key
  (``.metadata.keys``, ``storage.metadata_index``) on the first save (the layout's chunk
  columns too) and on a later one (only the record columns), and the file's size;
- the load's table: ``.metadata``'s bytes read from storage per load and its parse (plain
  pickle, the allow-list reader) when every rank reads it; rank 0 reading, checking and
  cutting it once (``checkpoint.metadata_slices``, a checkpoint without the index); rank 0
  reading the index instead (its CRC32C checked as against the manifest, then decoded);
  and each rank assembling the keys it holds (its own local plan's keys), in CPU seconds.

    python -m benchmarks.bench_planning [--ranks 64 128 ... 8192] [--no-dcp | --dcp-up-to N]
        [--no-load]

Growth per 2x ranks and DCP / ours are ratios of CPU seconds: on a shared machine the wall
times carry other jobs' load.
"""

from __future__ import annotations

import argparse
import gc
import math
import pickle
import time
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
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
from lightning_megatron_fsdp.checkpoint.metadata_slices import MetadataSlices
from lightning_megatron_fsdp.checkpoint.save_plan import global_save_plan
from lightning_megatron_fsdp.storage import metadata_index
from lightning_megatron_fsdp.storage.checksums import crc32c
from lightning_megatron_fsdp.storage.safe_unpickling import load_dcp_metadata

VOCAB, HIDDEN, FFN, LAYERS = 32000, 4096, 11008, 32
STATES = ("", ".exp_avg", ".exp_avg_sq")


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


def metadata_file(metadata: Any, global_plan: list[SavePlan]) -> bytes:
    """The pickled ``.metadata``: one storage entry per record (a ``torch.save`` record of
    the chunk: 512 header bytes, then its payload), each with our annotation."""
    storage = {}
    for rank, plan in enumerate(global_plan):
        offset = 0
        for item in plan.items:
            data = item.tensor_data
            length = 512 + math.prod(data.chunk.sizes) * data.properties.dtype.itemsize
            info = _torch.storage_info(f"__{rank}_0.distcp", offset, length)
            info.lmf_record = {
                "crc32c": 0x12345678,
                "payload": [512, length],
                "byteorder": "little",
            }
            storage[item.index] = info
            offset += length
    metadata.storage_data = storage
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


def _clear_caches() -> None:
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.clear()


def first_plan(plans: list[SavePlan], ours: bool) -> tuple[list[SavePlan], Any, float, float]:
    """The coordinator's first planning of ``plans`` through the planner a save uses
    (``ours``) or DCP's default planner (plan caching on in both), timed whole: wall and
    CPU seconds (the CPU time shows the work where other jobs share the cores)."""
    _clear_caches()
    planner = _torch.caching_save_planner("bench", global_save_plan if ours else None)
    gc.collect()
    began, cpu = time.perf_counter(), time.process_time()
    global_plan, metadata = planner.create_global_plan(plans)
    return global_plan, metadata, time.perf_counter() - began, time.process_time() - cpu


def measure(world: int, dcp: bool, load: bool = True) -> dict[str, Any]:
    plans = local_plans(world)
    items = sum(len(p.items) for p in plans)
    gathered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in plans)
    dcp_s, dcp_cpu = first_plan(plans, ours=False)[2:] if dcp else (math.nan, math.nan)
    global_plan, metadata, planned, planned_cpu = first_plan(plans, ours=True)
    scattered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in global_plan)
    planner = _torch.caching_save_planner("bench", global_save_plan)
    for rank_plan in global_plan:  # every rank's finish_plan fills the caches
        planner._pending_local_plan = rank_plan  # (each rank caches its own in DCP)
        planner.finish_plan(rank_plan)
    empty = [SavePlan([], usable=False) for _ in range(world)]
    cached_gathered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in empty)
    later = _torch.caching_save_planner("bench", global_save_plan)
    began = time.perf_counter()
    delta, _ = later.create_global_plan(empty)
    cached = time.perf_counter() - began
    cached_scattered = sum(len(pickle.dumps(p, protocol=pickle.HIGHEST_PROTOCOL)) for p in delta)
    data = metadata_file(metadata, global_plan)
    size = len(data)
    metadata_index._last_layout.clear()
    timed = []
    for _ in range(2):  # the first save, then a later one (the layout's columns cached)
        began = time.process_time()
        index = MetadataSlices.cut(metadata, source="bench", cache=True).encoded()
        timed.append(time.process_time() - began)
    metadata_index._last_layout.clear()
    del global_plan, metadata, delta, planner, later
    gc.collect()
    loaded = measure_load(data, plans, index) if load else {}
    return loaded | {
        "ranks": world,
        "items": items,
        "plans_mb": gathered / 1e6,
        "scatter_mb": scattered / 1e6,
        "dcp_s": dcp_s,
        "dcp_cpu": dcp_cpu,
        "plan_s": planned,
        "plan_cpu": planned_cpu,
        "cached_s": cached,
        "cached_mb": (cached_gathered + cached_scattered) / 1e6,
        "metadata_mb": size / 1e6,
        "index_first_s": timed[0],
        "index_later_s": timed[1],
        "index_mb": len(index) / 1e6,
    }


def measure_load(data: bytes, plans: list[SavePlan], index: bytes) -> dict[str, Any]:
    """A load's metadata work: every rank parsing the whole ``.metadata`` (plain pickle and
    the allow-list reader), against rank 0 parsing, checking and cutting it once and each
    rank unpickling what the first round broadcasts, the skeleton, and its keys' tables,
    checked, with DCP's objects for the chunks overlapping its own (its local plan's chunks;
    a few ranks sampled, the slowest reported); CPU seconds."""
    began = time.process_time()
    pickle.loads(data)
    plain = time.process_time() - began
    gc.collect()
    source = "bench/.metadata"
    began = time.process_time()
    metadata = load_dcp_metadata(data, source=source)
    allow_list = time.process_time() - began
    slices = MetadataSlices.cut(metadata, source=source)
    once = time.process_time() - began
    sent = pickle.dumps(slices, protocol=pickle.HIGHEST_PROTOCOL)
    del metadata
    gc.collect()
    began = time.process_time()
    crc32c(index)
    read = MetadataSlices.read(index, source="bench/.metadata.keys")
    from_index = time.process_time() - began
    assert read is not None and read.keys == slices.keys and read.files == slices.files
    del slices, read
    gc.collect()
    world = len(plans)
    per_rank, received, built = [], [], []
    for rank in sorted({0, world // 3, world // 2, world - 1}):
        local: dict[str, list[Any]] = {}
        for item in plans[rank].items:
            local.setdefault(item.index.fqn, []).append(item.tensor_data.chunk)
        began = time.process_time()
        slices = pickle.loads(sent)
        unpickled = time.process_time() - began
        assembled = slices.skeleton_metadata(trust=False)
        for key, chunks in local.items():
            slices.fill(assembled, key, chunks)
        per_rank.append(time.process_time() - began)
        received.append(unpickled)
        built.append(len(assembled.storage_data))
        del slices, assembled
    return {
        "plain_s": plain,
        "allow_list_s": allow_list,
        "once_s": once,
        "index_s": from_index,
        "slices_mb": len(sent) / 1e6,
        "rank_s": max(per_rank),
        "received_s": max(received),
        "built": max(built),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 2048, 4096, 8192]
    )
    parser.add_argument(
        "--no-dcp", action="store_true", help="skip DCP's default planner (the slow reference)"
    )
    parser.add_argument(
        "--dcp-up-to", type=int, default=None, help="run DCP's planner only up to this many ranks"
    )
    parser.add_argument("--no-load", action="store_true", help="skip the load's table")
    args = parser.parse_args()
    print(
        "| ranks | records | plans gathered MB | plans scattered MB | first save: DCP s "
        "(CPU s) | first save: ours s (CPU s) | DCP / ours (CPU) | ours x per 2x ranks (CPU) "
        "| later saves s | cached MB moved | .metadata MB | index: first save / later CPU s "
        "| index MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    previous: tuple[int, float] | None = None
    rows = []
    for world in args.ranks:
        dcp = not args.no_dcp and (args.dcp_up_to is None or world <= args.dcp_up_to)
        r = measure(world, dcp, not args.no_load)
        rows.append(r)
        growth = "-"
        if previous is not None and world == 2 * previous[0]:
            growth = f"{r['plan_cpu'] / previous[1]:.2f}"
        previous = (world, r["plan_cpu"])
        print(
            f"| {r['ranks']} | {r['items']} | {r['plans_mb']:.1f} | {r['scatter_mb']:.1f} "
            f"| {r['dcp_s']:.2f} ({r['dcp_cpu']:.2f}) | {r['plan_s']:.2f} ({r['plan_cpu']:.2f}) "
            f"| {r['dcp_cpu'] / r['plan_cpu']:.1f} "
            f"| {growth} | {r['cached_s']:.4f} | {r['cached_mb']:.2f} | {r['metadata_mb']:.1f} "
            f"| {r['index_first_s']:.2f} / {r['index_later_s']:.2f} | {r['index_mb']:.1f} |",
            flush=True,
        )
        gc.collect()
    print(
        "\n| ranks | .metadata MB | before: read from storage per load GB | before: per-rank "
        "parse CPU s (plain pickle / allow-list) | after: read per load GB (index / without) "
        "| rank 0 without "
        "the index: parse + cut CPU s | rank 0 with the index: CRC32C + decode CPU s "
        "| MB sent in round 1 | per-rank assembly CPU s (max of 4 ranks; of which unpickling "
        "round 1) | storage entries built per rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows if not args.no_load else []:
        print(
            f"| {r['ranks']} | {r['metadata_mb']:.1f} | {r['ranks'] * r['metadata_mb'] / 1e3:.2f} "
            f"| {r['plain_s']:.2f} / {r['allow_list_s']:.2f} "
            f"| {r['index_mb'] / 1e3:.3f} / {r['metadata_mb'] / 1e3:.3f} "
            f"| {r['once_s']:.2f} | {r['index_s']:.3f} | {r['slices_mb']:.1f} | {r['rank_s']:.3f} "
            f"({r['received_s']:.3f}) | {r['built']} |"
        )


if __name__ == "__main__":
    main()
