"""``thread_count > 1``: each rank's records are split over several files written at once.

Each writer thread writes its own files (``__<rank>_<n>.distcp``), and every record's
offset and CRC32C is taken from the stream of the file it is in, so an offset or checksum
mixed up between threads would go unseen at ``thread_count=1``. Two ranks save with 2, 3
and 4 writer threads; the files each rank wrote are counted (the threads were used), the
load into zeroed targets is bit-exact with every record's CRC32C checked, ``inspect
--verify`` passes, and a byte flipped in a file the last thread wrote is caught by that
record's CRC32C.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_megatron_fsdp import CheckpointCorruptedError
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.tools.inspection import verify_checkpoint
from tests.harness import run_distributed
from tests.scripts.fault_injection import (
    checkpoint_dict,
    init_group,
    live_state,
    target_state,
    trained,
)
from tests.shard_facts import differing, facts

TIMEOUT = 120.0


def _round_trip(rank: int, world_size: int, root: str, threads: int) -> dict[str, Any]:
    init_group(rank, world_size)
    path = Path(root) / "last.ckpt"
    model, adam = trained(world_size, num_blocks=4)
    plugin = MegatronFSDPCheckpointIO(thread_count=threads)
    plugin.save_checkpoint(checkpoint_dict(model, adam, 3), path)
    _, _, state = target_state(world_size, num_blocks=4)
    loaded = plugin.load_checkpoint(path, state=state)
    want = facts(live_state(model, adam))
    result = {
        "differing": differing(facts(state), want),
        "compared": sum(f[0] != "value" for f in want.values()),
        "global_step": loaded["global_step"],
    }
    dist.barrier()
    if rank == 0:  # flip one byte in the middle of the last thread's file of rank 1
        victim = path / f"__1_{threads - 1}.distcp"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
    dist.barrier()
    _, _, state = target_state(world_size, num_blocks=4)
    try:
        plugin.load_checkpoint(path, state=state)
    except CheckpointCorruptedError as err:
        result["flipped"] = str(err)
    return result


@pytest.mark.parametrize("threads", [2, 3, 4])
def test_several_writer_threads_round_trip_bit_exactly(tmp_path: Path, threads: int) -> None:
    # Saved, loaded and checked in one run; verified offline before the flip.
    results = run_distributed(
        _round_trip, 2, str(tmp_path), threads, timeout=TIMEOUT, init_process_group=False
    )
    for rank, result in enumerate(results):
        assert result["differing"] == [], (rank, result["differing"][:5])
        assert result["compared"] > 30, result["compared"]
        assert result["global_step"] == 3
        # The flipped byte is a record's byte: its CRC32C, recorded by the writer thread
        # that wrote it, catches it, on every rank.
        flipped = result.get("flipped", "")
        pattern = (
            rf"__1_{threads - 1}\.distcp: crc32c \w{{8}} read, \w{{8}} recorded for the record"
        )
        assert re.search(pattern, flipped), flipped
    last = tmp_path / "last.ckpt"
    shards = sorted(p.name for p in last.glob("*.distcp"))
    assert shards == [f"__{r}_{t}.distcp" for r in range(2) for t in range(threads)], shards
    problems = verify_checkpoint(last)
    assert any(f"__1_{threads - 1}.distcp" in p for p in problems), problems


def test_verify_passes_before_damage(tmp_path: Path) -> None:
    """``inspect --verify`` checks every byte of a 4-thread save against the manifest."""
    run_distributed(_save_only, 2, str(tmp_path), timeout=TIMEOUT, init_process_group=False)
    last = tmp_path / "last.ckpt"
    assert len(list(last.glob("*.distcp"))) == 8
    assert verify_checkpoint(last) == []


def _save_only(rank: int, world_size: int, root: str) -> None:
    init_group(rank, world_size)
    model, adam = trained(world_size, num_blocks=4)
    MegatronFSDPCheckpointIO(thread_count=4).save_checkpoint(
        checkpoint_dict(model, adam, 3), Path(root) / "last.ckpt"
    )
