"""``global_save_plan`` against DCP's own coordinator step, on the same local plans.

Pure planning, no process group: the local plans every rank of a small packed model would
send (each unit's parameters flattened into one buffer split evenly across the ranks, so a
rank holds row ranges of the parameters its slice crosses, some empty; fp32 weights and two
optimizer states; a bytes record and a whole tensor every rank holds, which dedup must give
to one), at 1 to 5 ranks. Our planner's global plan and ``.metadata`` must pickle to the same
bytes as DCP's default planner's (through the planners the save uses, plan caching on), and
plans with an overlap, a hole or a chunk outside its tensor must be refused, by DCP and by
us, with our error naming the tensor.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.checkpoint.save_plan import global_save_plan

pytestmark = pytest.mark.both_versions

UNITS = [
    [("embed.weight", (50, 8))],
    [("layer.norm", (8,)), ("layer.wide", (8, 30)), ("layer.tall", (30, 8))],
    [("head.weight", (50, 8)), ("head.bias", (50,))],
]
STATES = ("model.", "optim.exp_avg.", "optim.exp_avg_sq.")


def _tensor_item(key: str, shape: tuple[int, ...], lo: int, hi: int, kind: WriteItemType):
    offsets = torch.Size((lo, *([0] * (len(shape) - 1))))
    sizes = torch.Size((hi - lo, *shape[1:]))
    return WriteItem(
        index=MetadataIndex(key, offsets),
        type=kind,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=torch.float32),
            size=torch.Size(shape),
        ),
    )


def local_plans(world: int) -> list[SavePlan]:
    """Every rank's local save plan for ``UNITS`` packed Megatron-FSDP style."""
    items: list[list[WriteItem]] = [[] for _ in range(world)]
    for unit in UNITS:
        per_rank = -(-sum(math.prod(s) for _, s in unit) // world)
        start = 0
        for fqn, shape in unit:
            row, rows = math.prod(shape[1:]), shape[0]
            for rank in range(world):
                lo = min(rows, max(0, -(-(rank * per_rank - start) // row)))
                hi = min(rows, max(0, -(-((rank + 1) * per_rank - start) // row)))
                if hi > lo:
                    for state in STATES:
                        items[rank].append(
                            _tensor_item(state + fqn, shape, lo, hi, WriteItemType.SHARD)
                        )
            start += rows * row
    for rank in range(world):  # what every rank holds: dedup keeps one
        items[rank].insert(0, _tensor_item("optim.step", (1,), 0, 1, WriteItemType.TENSOR))
        items[rank].append(
            WriteItem(
                index=MetadataIndex("extra"),
                type=WriteItemType.BYTE_IO,
                bytes_io_data=BytesIOWriteData(nbytes=7),
            )
        )
    return [
        SavePlan(r, planner_data={i.index.fqn: tuple(i.index.fqn.split(".")) for i in r})
        for r in items
    ]


def _planned(plans: list[SavePlan], ours: bool, lowest: bool = False) -> tuple[bytes, bytes]:
    """The global plans and metadata the save's planner gives, pickled."""
    key = f"test_save_plan:{ours}:{len(plans)}:{lowest}:{id(plans)}"
    planner = _torch.caching_save_planner(key, global_save_plan if ours else None)
    planner.dedup_save_to_lowest_rank = lowest
    global_plan, metadata = planner.create_global_plan(plans)
    return pickle.dumps(global_plan), pickle.dumps(metadata)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("lowest", [False, True])
def test_the_same_global_plan_and_metadata_as_dcp_byte_for_byte(world: int, lowest: bool) -> None:
    plans = local_plans(world)
    ours, theirs = _planned(plans, True, lowest), _planned(plans, False, lowest)
    assert ours[1] == theirs[1], "the .metadata differs from DCP's"
    assert ours[0] == theirs[0], "the global plan differs from DCP's"
    # Anti-vacuity: dedup left the shared records to one rank, and chunks carry their hints.
    global_plan = pickle.loads(ours[0])
    holders = [p for p in global_plan if any(i.index.fqn == "optim.step" for i in p.items)]
    assert len(holders) == 1
    hints = [
        i.index.index for p in global_plan for i in p.items if i.index.fqn == "model.embed.weight"
    ]
    assert hints == list(range(len(hints))) and len(hints) == min(world, 50)


def _broken(kind: str) -> list[SavePlan]:
    plans = local_plans(3)
    rank1 = plans[1]
    items = list(rank1.items)
    (at,) = [n for n, i in enumerate(items) if i.index.fqn == "model.layer.wide"]
    item = items[at]
    chunk = item.tensor_data.chunk
    if kind == "hole":
        del items[at]
    else:
        lo = chunk.offsets[0] - 1 if kind == "overlap" else chunk.offsets[0] + 1
        offsets = torch.Size((lo, 0))
        items[at] = dataclasses.replace(
            item,
            index=MetadataIndex(item.index.fqn, offsets),
            tensor_data=dataclasses.replace(
                item.tensor_data,
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=chunk.sizes),
            ),
        )
    plans[1] = dataclasses.replace(rank1, items=items)
    return plans


@pytest.mark.parametrize(
    ("kind", "says"),
    [("overlap", "overlap: offsets"), ("hole", "a hole"), ("outside", "outside the tensor")],
)
def test_an_overlap_a_hole_or_a_chunk_outside_is_refused_naming_the_tensor(
    kind: str, says: str
) -> None:
    plans = _broken(kind)
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        _planned(plans, False)  # DCP refuses the same plans
    with pytest.raises(ValueError, match=rf"the chunks of `model\.layer\.wide` .*{says}"):
        _planned(plans, True)
