"""Layout-to-chunk arithmetic of ``uneven_dtensor``: table-driven, no process group.

Each case builds real ``DBuffer`` objects for every rank of a data-parallel layout with
``DBuffer.from_local`` (through ``_megatron.dbuffer_from_local``, which passes 0.7's
allocation stream) -- megatron-fsdp's own constructor, so ``GlobalLayout.build``,
``get_local_range`` and ``get_local_tensor`` are the real code -- and checks
``_dbuffer_chunk_metadata`` against two oracles: megatron's local view (the chunk's sizes
are its shape) and the data itself (every element of the local view equals the element of
the full tensor at the chunk's offset). Per tensor, the chunks of all ranks must tile
dim 0 exactly once, in rank order.

``from_local`` wants a ``DeviceMesh`` only to ask its size and this rank's index on it; a
real mesh needs a process group, so :class:`_RankView` answers those two questions for a
given rank. Nothing else is stood in for.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from lightning_megatron_fsdp.megatron._megatron import (
    DBuffer,
    GlobalLayout,
    dbuffer_flat,
    dbuffer_from_local,
)
from lightning_megatron_fsdp.megatron.uneven_dtensor import (
    _build_chunk_metadata,
    _dbuffer_chunk_metadata,
)
from tests.models import KERNELS, PackedBlock, PackedLM

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

Shape = tuple[int, ...]


class _RankView:
    """What ``DBuffer.from_local`` asks of a 1-D mesh: its size, and this rank's index."""

    ndim = 1

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def size(self, axis: int | None = None) -> int:
        return self.world_size

    def get_local_rank(self, axis: int | None = None) -> int:
        return self.rank


def _full_tensors(shapes: Sequence[Shape]) -> list[torch.Tensor]:
    """One tensor per shape, every element across all tensors distinct (float64-exact)."""
    tensors, base = [], 1
    for shape in shapes:
        numel = torch.Size(shape).numel()
        tensors.append(torch.arange(base, base + numel, dtype=torch.float64).reshape(shape))
        base += numel
    return tensors


def _rank_buffers(shapes: Sequence[Shape], world_size: int) -> list[DBuffer]:
    """Real per-rank DBuffers of ``shapes``, filled as megatron-fsdp would fill them.

    The global flat buffer holds each tensor at its layout offset (NaN in gaps and
    padding); Flat placement gives rank r the r-th of ``world_size`` equal slices.
    """
    layout = GlobalLayout.build(shapes, world_size)
    flat = torch.full((layout.size,), float("nan"), dtype=torch.float64)
    for tensor, offset in zip(_full_tensors(shapes), layout.tensor_to_offset, strict=True):
        flat[offset : offset + tensor.numel()] = tensor.reshape(-1)
    per_rank = layout.size // world_size
    buffers = []
    for rank in range(world_size):
        local = flat[rank * per_rank : (rank + 1) * per_rank].clone()
        buffer = dbuffer_from_local(local, _RankView(rank, world_size), [dbuffer_flat()], shapes)
        assert buffer.layout == layout and buffer.offset == rank * per_rank
        buffers.append(buffer)
    return buffers


def _check_layout(shapes: Sequence[Shape], world_size: int) -> list[list[ChunkStorageMetadata]]:
    """Assert every property of the chunks of ``shapes`` over ``world_size`` ranks.

    Returns:
        ``chunks[rank][tensor]``.
    """
    buffers = _rank_buffers(shapes, world_size)
    full = _full_tensors(shapes)
    chunks = [[_dbuffer_chunk_metadata(b, i) for i in range(len(shapes))] for b in buffers]
    for index, shape in enumerate(shapes):
        where = f"tensor {index} {shape} of {list(shapes)} over {world_size} ranks"
        next_row = 0
        for rank, buffer in enumerate(buffers):
            chunk = chunks[rank][index]
            local = buffer.get_local_tensor(index)
            # Megatron's own view of the shard has exactly the chunk's shape...
            assert tuple(chunk.sizes) == tuple(local.shape), f"{where}, rank {rank}"
            assert tuple(chunk.offsets[1:]) == (0,) * (len(shape) - 1), f"{where}, rank {rank}"
            # ...the chunks tile dim 0 in rank order, with no gap or overlap...
            assert chunk.offsets[0] == next_row, f"{where}, rank {rank}: {chunk}"
            next_row += chunk.sizes[0]
            # ...and the shard's data is the full tensor's data at the chunk's position.
            rows = slice(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])
            assert torch.equal(local, full[index][rows]), f"{where}, rank {rank}: {chunk}"
        assert next_row == shape[0], f"{where}: chunks cover {next_row} of {shape[0]} rows"
        gathered = torch.cat([b.get_local_tensor(index) for b in buffers])
        assert torch.equal(gathered, full[index]), where
    return chunks


def _random_cases(count: int, seed: int) -> list[list[Shape]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        shapes = []
        for _ in range(rng.randint(1, 7)):
            ndim = rng.randint(1, 4)
            shapes.append(tuple(rng.randint(1, 7) for _ in range(ndim)))
        cases.append(shapes)
    return cases


DOCSTRING_EXAMPLE: list[Shape] = [(2, 6), (4, 4), (4, 4), (1, 2), (1, 6)]

CASES: dict[str, list[Shape]] = {
    "docstring_example": DOCSTRING_EXAMPLE,
    "single_vector": [(7,)],
    "single_matrix": [(5, 3)],
    "linear_weight_bias": [(5, 6), (5,)],
    "two_linears": [(4, 6), (4,), (6, 4), (6,)],
    "fragment_fills_gap": [(5, 6), (1, 4), (3, 4)],
    "conjugate_pair": [(5, 4), (3, 4), (2, 2)],
    "three_and_four_dims": [(3, 2, 4), (2, 3, 2, 2), (5, 8)],
    "fragments_only": [(1, 6), (1, 4), (2,), (1, 3)],
    "row_size_one": [(3,), (9,), (1,), (5,)],
    "lcm_large": [(2, 5), (3, 7), (1, 3)],
    "empty_leading_dim": [(4, 3), (0, 3), (2, 3)],
    "packed_block": [tuple(p.shape) for p in PackedBlock().parameters()],
    "packed_lm_root": [(11, 6), (11,)],
}
CASES.update({f"random_{i}": shapes for i, shapes in enumerate(_random_cases(40, seed=1234))})


@pytest.mark.parametrize("shapes", list(CASES.values()), ids=list(CASES))
def test_chunks_match_megatron_views_and_tile_in_rank_order(shapes: list[Shape]) -> None:
    for world_size in range(1, 6):
        _check_layout(shapes, world_size)


def test_docstring_example_chunks() -> None:
    """The ``GlobalLayout.build`` docstring example, chunk by chunk (empty shards included)."""
    chunks = _check_layout(DOCSTRING_EXAMPLE, 5)
    # (rank, tensor): (row offset, rows); rows of 6-, 4-, 4-, 2- and 6-element tensors.
    expected = {
        (0, 0): (0, 2),
        (1, 1): (0, 3),
        (2, 1): (3, 1),
        (2, 3): (0, 1),
        (2, 2): (0, 1),
        (3, 2): (1, 3),
        (4, 4): (0, 1),
    }
    for rank in range(5):
        for index, shape in enumerate(DOCSTRING_EXAMPLE):
            lower = sum(expected.get((r, index), (0, 0))[1] for r in range(rank))
            offset, rows = expected.get((rank, index), (lower, 0))
            assert chunks[rank][index] == ChunkStorageMetadata(
                offsets=torch.Size((offset, 0)), sizes=torch.Size((rows, shape[1]))
            ), f"rank {rank}, P{index}"
    # Canonical Shard(0) would give rank 1 rows [1, 2) of P1 (torch.chunk of 4 rows in 5).
    canonical = [len(c) for c in torch.empty(4).chunk(5)] + [0]
    assert canonical[1] == 1 and chunks[1][1].sizes[0] == 3


def test_packed_block_layout_exercises_packing() -> None:
    """``tests.models.PackedBlock`` packs the way its docstring claims (guards the model)."""
    names = [name for name, _ in PackedBlock().named_parameters()]
    shapes = [tuple(p.shape) for p in PackedBlock().parameters()]
    assert names == ["mix", "gain", "fc.weight", "fc.bias", "out.weight", "out.bias"]
    for world_size in (2, 3, 4):
        layout = GlobalLayout.build(shapes, world_size)
        offset = dict(zip(names, layout.tensor_to_offset, strict=True))
        numel = {n: torch.Size(s).numel() for n, s in zip(names, shapes, strict=True)}
        chunk_size = 12
        # A small parameter fills another's padding gap.
        mix_end = offset["mix"] + numel["mix"]
        assert numel["mix"] % chunk_size and numel["gain"] < chunk_size
        assert mix_end <= offset["gain"] < -(-mix_end // chunk_size) * chunk_size
        # The Linear's bias is packed away from its weight, and the two split differently.
        assert offset["fc.bias"] != offset["fc.weight"] + numel["fc.weight"]
        chunks = _check_layout(shapes, world_size)
        weight_rows = [c[names.index("fc.weight")].sizes[0] for c in chunks]
        bias_rows = [c[names.index("fc.bias")].sizes[0] for c in chunks]
        assert weight_rows != bias_rows  # both have 4 rows: an even split would match
        # A parameter with three dims, and a layout that defeats canonical Shard(0).
        assert len(shapes[names.index("mix")]) == 3
        canonical = [len(c) for c in torch.empty(KERNELS).chunk(world_size)]
        canonical += [0] * (world_size - len(canonical))
        assert [c[names.index("mix")].sizes[0] for c in chunks] != canonical


def test_packed_lm_ties_embedding_and_head() -> None:
    model = PackedLM()
    assert model.embed.weight is model.head.weight
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    assert "embed.weight" in names and "head.weight" in names


def test_empty_shard_reports_the_offset_a_gather_would() -> None:
    """Zero rows at 0 before the tensor starts, at all rows after it ends."""
    shapes: list[Shape] = [(4, 6), (6,)]  # lcm 6; the vector sits at the tail
    chunks = _check_layout(shapes, 4)
    vector_rows = [c[1] for c in chunks]
    owners = [rank for rank, chunk in enumerate(vector_rows) if chunk.sizes[0]]
    assert owners, "some rank must own the vector"
    for rank, chunk in enumerate(vector_rows):
        if rank < owners[0]:
            assert chunk == ChunkStorageMetadata(torch.Size((0,)), torch.Size((0,)))
        elif rank > owners[-1]:
            assert chunk == ChunkStorageMetadata(torch.Size((6,)), torch.Size((0,)))


@pytest.mark.parametrize(
    ("row_offset", "rows", "shape", "match"),
    [
        (0, 1, torch.Size(()), r"at least 1 dim, got shape"),
        (3, 2, torch.Size((4, 2)), r"Row range \[3, 5\) does not fit in dim 0 of shape \(4, 2\)"),
        (-1, 1, torch.Size((4,)), r"Row range \[-1, 0\) does not fit"),
        (0, -1, torch.Size((4,)), r"Row range \[0, -1\) does not fit"),
    ],
)
def test_build_chunk_metadata_rejects_bad_ranges(
    row_offset: int, rows: int, shape: torch.Size, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        _build_chunk_metadata(row_offset, rows, shape)


def test_misaligned_owned_range_is_an_invariant_error() -> None:
    """A shard boundary inside a row means megatron-fsdp's layout contract changed."""
    shapes: list[Shape] = [(4, 3)]
    buffer = _rank_buffers(shapes, 2)[1]
    assert torch.Size(shapes[0])[1:].numel() == 3
    buffer.offset += 1  # a boundary GlobalLayout never produces: inside a 3-element row
    with pytest.raises(AssertionError, match=r"Tensor 0 of shape \(4, 3\).*3-element rows"):
        _dbuffer_chunk_metadata(buffer, 0)
