"""A load reads each replicated record from storage once, whatever the number of replicas.

Replicas hold the same rows (HSDP's replica dimension, ``NO_SHARD``, and plain tensors such
as Adam's ``step``, which every rank holds whole); the save writes them once, and the load
reads each on one rank of its replica group and broadcasts it to the others
(``checkpoint/replicated_reads.py``). Real gloo ranks (``tests.harness``) save
``tests.models.PackedLM`` (nested units, a tie, a 3-D parameter) after two Adam steps and
load it into zeroed targets of the same layout, in place and with ``atomic_load``.

Asserted per layout: the tensor bytes the ranks' readers fetched together equal the
checkpoint's tensor records (each once, not once per replica), every rank read some of
them where there are replicas (the reads are spread), and every rank's targets hold the
saved values bit for bit. Before the change each HSDP (2, 1) rank read every record, twice
the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.storage import VerifyingFileSystemReader
from tests.harness import run_distributed
from tests.models import sharded_adam
from tests.scripts.fault_injection import LR, checkpoint_dict, live_state, step
from tests.shard_facts import differing, facts
from tests.test_hsdp_checkpoint import _sharded

pytestmark = pytest.mark.both_versions

TIMEOUT = 150.0


class CountingStorage:
    """The plugin's storage, keeping every reader it hands out (to count what they read)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.readers: list[Any] = []

    def writer(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner.writer(*args, **kwargs)

    def reader(self, location: Any, **kwargs: Any) -> Any:
        reader = self.inner.reader(location, **kwargs)
        self.readers.append(reader)
        return reader

    def tensor_bytes_read(self) -> int:
        return sum(r.progress.tensor_bytes_read for r in self.readers)


def checkpoint_tensor_bytes(path: Path) -> int:
    """The bytes of the checkpoint's tensor records, each once."""
    reader = VerifyingFileSystemReader(path)
    metadata = reader.read_metadata()
    tensors = {
        fqn
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    return sum(info.length for index, info in metadata.storage_data.items() if index.fqn in tensors)


def _round_trip(rank: int, world_size: int, root: str, mesh: tuple[int, ...]) -> dict[str, Any]:
    model = _sharded(mesh, seed=0)
    adam = sharded_adam(model, lr=LR)
    for seed in range(2):
        step(model, adam, seed)
    path = Path(root) / "-".join(map(str, mesh))
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint_dict(model, adam, 2), path)
    saved = facts(live_state(model, adam))
    out: dict[str, Any] = {}
    for atomic in (False, True):
        target = _sharded(mesh, seed=None)
        state = live_state(target, sharded_adam(target, lr=LR))
        for entries in state["optimizer_states"][0]["state"].values():
            for tensor in entries.values():
                tensor.zero_()
        for group in state["optimizer_states"][0]["param_groups"]:
            group["lr"] = 0.0
        plugin = MegatronFSDPCheckpointIO(atomic_load=atomic)
        plugin.storage = counting = CountingStorage(plugin.storage)
        plugin.load_checkpoint(path, state=state)
        out[f"atomic={atomic}"] = {
            "read": counting.tensor_bytes_read(),
            "differing": differing(facts(state), saved),
        }
    out["checkpoint"] = checkpoint_tensor_bytes(path) if rank == 0 else None
    return out


@pytest.mark.parametrize("mesh", [(2, 1), (2,)], ids=["hsdp-2x1", "fsdp-2"])
def test_replicated_records_are_read_once_per_load(tmp_path: Path, mesh: tuple[int, ...]) -> None:
    per_rank = run_distributed(_round_trip, 2, str(tmp_path), mesh, timeout=TIMEOUT)
    total = per_rank[0]["checkpoint"]
    assert total > 0
    for case in ("atomic=False", "atomic=True"):
        for rank, result in enumerate(per_rank):
            assert result[case]["differing"] == [], (case, rank)
        reads = [result[case]["read"] for result in per_rank]
        assert sum(reads) == total, (case, reads, total)
        if mesh == (2, 1):  # every record has a replica: both ranks share the reading
            assert all(reads), (case, reads)


def test_counting_sees_every_byte_a_single_rank_reads(tmp_path: Path) -> None:
    """Anti-vacuity: one rank alone reads the whole checkpoint, as counted."""
    (result,) = run_distributed(_round_trip, 1, str(tmp_path), (1,), timeout=TIMEOUT)
    for case in ("atomic=False", "atomic=True"):
        assert result[case]["differing"] == [], case
        assert result[case]["read"] == result["checkpoint"] > 0, case
        assert isinstance(result[case]["read"], int)
