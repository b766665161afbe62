"""Tensor records written from templates are exactly ``torch.save``'s bytes.

``TensorRecords`` (the default writer's way to write a DCP tensor record without a
``torch.save`` per tensor) must produce, for every tensor, the bytes ``torch.save(tensor,
stream)`` produces, and hand anything it has no template for to ``torch.save`` itself.
In-process, no files: about a second.
"""

from __future__ import annotations

import io

import pytest
import torch

from lightning_megatron_fsdp.storage.records import TensorRecords, _calibrate

DTYPES = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
# 0-d, tiny, a payload at the small-write bound, large enough to span several payload
# blocks, several dimensions, and 0-element tensors (never templated).
SHAPES = ((), (1,), (7,), (1024,), (1025,), (3, 5), (2, 3, 4), (300_000,), (0,), (0, 3))


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 100
    return values > 0 if dtype == torch.bool else values.to(dtype)


def _torch_save(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def _record(records: TensorRecords, tensor: torch.Tensor) -> tuple[bytes, bool, list]:
    """The record's bytes, whether a template wrote it, and the payload offsets it gave."""
    pieces: list[bytes] = []
    offsets: list[tuple[int, int]] = []
    templated = records.write(
        tensor, lambda piece: pieces.append(bytes(piece)), storage=lambda *o: offsets.append(o)
    )
    return b"".join(pieces), templated, offsets


def test_calibration_passes_on_this_torch() -> None:
    assert _calibrate()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_records_equal_torch_save_over_dtypes_and_shapes(dtype: torch.dtype) -> None:
    """First a tensor of each shape teaches its template (written by torch.save); then
    tensors of the same shapes with other values are written from the templates: every
    record equals torch.save's bytes, loads back bit-exactly, and a templated record's
    payload sits where the writer says."""
    records = TensorRecords()
    for seed in range(3):
        for shape in SHAPES:
            tensor = _tensor(dtype, shape, seed)
            data, templated, offsets = _record(records, tensor)
            assert data == _torch_save(tensor), (shape, seed)
            loaded = torch.load(io.BytesIO(data), weights_only=True)
            assert loaded.dtype == dtype and torch.equal(loaded, tensor), (shape, seed)
            empty = tensor.numel() == 0
            assert templated == (seed > 0 and not empty), (shape, seed)
            if templated:
                [(header, payload)] = offsets
                assert data[header : header + 4] == b"PK\x03\x04"
                raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
                assert data[payload : payload + len(raw)] == raw


def test_unusual_tensors_are_written_by_torch_save() -> None:
    """Views at an offset, non-contiguous tensors, storages larger than the tensor,
    tensors with Python attributes, conjugates and subclasses get no template: torch.save
    writes them, so their records are still torch.save's bytes."""
    records = TensorRecords()
    packed = torch.arange(40, dtype=torch.float32)
    tagged = torch.arange(6.0)
    tagged.note = "kept by torch.save"
    unusual = {
        "view at an offset": packed[10:22].view(3, 4),
        "transposed": torch.arange(6.0).view(2, 3).t(),
        "prefix of a larger storage": packed[:5],
        "python attribute": tagged,
        "conjugate": torch.randn(4, dtype=torch.complex64).conj(),
        "parameter": torch.nn.Parameter(torch.arange(3.0)),
    }
    for name, tensor in unusual.items():
        for _ in range(2):  # a second time too: nothing was learnt from the first
            data, templated, _ = _record(records, tensor)
            assert not templated, name
            assert data == _torch_save(tensor), name


def test_requires_grad_and_shape_are_part_of_the_template() -> None:
    """Tensors that differ only in ``requires_grad`` or in shape with equal element count
    pickle differently: each gets its own template, and each record is still exact."""
    records = TensorRecords()
    base = torch.arange(12.0)
    variants = [base, base.clone().requires_grad_(), base.view(3, 4), base.view(4, 3)]
    for round_ in range(2):
        for tensor in variants:
            data, templated, _ = _record(records, tensor)
            assert templated == (round_ == 1)
            assert data == _torch_save(tensor)
