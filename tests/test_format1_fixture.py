"""A checkpoint written by the format-1 code (sha256 digests) still loads, verifies and exports.

Other format-1 tests downgrade a checkpoint today's writer made (``tests/legacy_format.py``),
which proves the reader handles what the downgrade produces, not what the old writer
wrote (its ``torch.save`` of whole packed storages, its manifest fields). This fixture was
written by the format-1 code itself (``tests/fixtures/format1/README.md``): it must load
bit-exactly at the saving world size and another one, pass ``inspect --verify``, export,
and be refused on every rank with nothing loaded when a byte of a shard changes.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_megatron_fsdp import (
    CheckpointCorruptedError,
    consolidate_checkpoint,
    read_manifest,
    verify_checkpoint,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from tests.harness import run_distributed
from tests.scripts.fault_injection import init_group, target_state
from tests.shard_facts import assemble, facts

FIXTURE = Path(__file__).parent / "fixtures" / "format1"
TIMEOUT = 120.0


def _load(rank: int, world_size: int, path: str) -> dict[str, Any]:
    init_group(rank, world_size)
    _, _, state = target_state(world_size)
    try:
        loaded = MegatronFSDPCheckpointIO().load_checkpoint(Path(path), state=state)
    except CheckpointCorruptedError as err:
        return {"error": str(err), "facts": facts(state)}
    return {"global_step": loaded["global_step"], "facts": facts(state)}


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    copy = tmp_path / "format1.ckpt"
    shutil.copytree(FIXTURE / "checkpoint", copy)
    return copy


def _expected() -> dict[str, torch.Tensor]:
    return torch.load(FIXTURE / "expected.pt", weights_only=True)


def _assert_equal(got: dict[str, Any], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    tensors = 0
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=key)
            tensors += 1
        else:
            assert got[key] == value, key
    assert tensors >= 15, tensors  # every weight at least: real tensors were compared


def test_the_fixture_is_format_1() -> None:
    manifest = read_manifest(FIXTURE / "checkpoint")
    assert (manifest.format_version, manifest.checksum) == (1, "sha256")
    assert manifest.world_size == 2 and manifest.global_step == 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_format_1_checkpoint_loads_bit_exactly(checkpoint: Path, world_size: int) -> None:
    results = run_distributed(
        _load, world_size, str(checkpoint), timeout=TIMEOUT, init_process_group=False
    )
    assert all(r.get("global_step") == 2 for r in results), results
    _assert_equal(assemble([r["facts"] for r in results]), _expected())


def test_a_format_1_checkpoint_verifies_and_exports(checkpoint: Path, tmp_path: Path) -> None:
    assert verify_checkpoint(checkpoint) == []
    exported = consolidate_checkpoint(checkpoint, tmp_path / "model.pt")
    weights = torch.load(exported, weights_only=True)
    expected = _expected()
    want = {k.removeprefix("state_dict/"): v for k, v in expected.items() if "state_dict/" in k}
    _assert_equal(weights, want)


def test_a_changed_byte_of_a_format_1_shard_is_refused_before_loading(checkpoint: Path) -> None:
    shard = checkpoint / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    pattern = r"__1_0\.distcp: sha256 [0-9a-f]{64} on disk, [0-9a-f]{64} in the manifest"
    assert any(re.search(pattern, p) for p in verify_checkpoint(checkpoint))
    results = run_distributed(_load, 2, str(checkpoint), timeout=TIMEOUT, init_process_group=False)
    for result in results:
        assert "error" in result and re.search(pattern, result["error"]), result.get("error")
        assert "Nothing was loaded" in result["error"], result["error"]
    # Every target is still all zeros: the damage was found before any record was read.
    for result in results:
        for key, fact in result["facts"].items():
            if fact[0] in ("shard", "tensor"):
                assert not torch.count_nonzero(fact[-1]), key
