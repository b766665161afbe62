"""A checkpoint saved under torch 2.15 loads under every supported torch.

torch 2.15 pickles a sixth field (``strides``) into DCP's ``TensorProperties``; torch 2.13
and 2.14 unpickle five and fail ("too many values to unpack"). The allow-list unpickler
reads the newer form there (``storage.safe_unpickling``). The fixture was written by
this package under torch 2.15 (``tests/fixtures/torch215/make_fixture.py``); CI's first two
passes run this on torch 2.13, the third on 2.15.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_megatron_fsdp import inspect_checkpoint, verify_checkpoint
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from tests.fixtures.torch215.values import state

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "torch215" / "checkpoint"


def test_a_torch_215_checkpoint_loads_bit_exactly_here() -> None:
    expected = state()["state_dict"]
    targets = {key: torch.zeros_like(value) for key, value in expected.items()}
    loaded = MegatronFSDPCheckpointIO().load_checkpoint(FIXTURE, state={"state_dict": targets})
    for key, value in expected.items():
        assert targets[key].dtype == value.dtype, key
        torch.testing.assert_close(targets[key], value, rtol=0, atol=0, msg=key)
    assert loaded["global_step"] == 7
    assert verify_checkpoint(FIXTURE) == []
    info = inspect_checkpoint(FIXTURE)
    assert {t.key for t in info.tensors} == {f"state_dict.{key}" for key in expected}
