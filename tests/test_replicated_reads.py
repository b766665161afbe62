"""A load reads each replicated record from storage once, whatever the number of replicas.

Replicas hold the same rows (HSDP's replica dimension, ``NO_SHARD``, and plain tensors such
as Adam's ``step``, which every rank holds whole); the save writes them once, and the load
reads each on one rank of its replica group and broadcasts it to the others
(``checkpoint/replicated_reads.py``). Real gloo ranks (``tests.harness``) save
``tests.models.PackedLM`` (nested units, a tie, a 3-D parameter) after two Adam steps and
load it into zeroed targets of the same layout, in place and with ``atomic_load``.

Asserted per layout: the tensor bytes the ranks' readers fetched together equal the
checkpoint's tensor records (each once, not once per replica), every rank read some of
them where there are replicas (the reads are spread), each rank reads records from its own
files alone (a replicated record, and a byte record such as a learning rate, is read by the
rank that wrote it and sent to the others), and every rank's targets hold the saved values
bit for bit (the targets' learning rates are zeroed first). Before the change each HSDP
(2, 1) rank read every record, twice the checkpoint (and both FSDP ranks Adam's ``step``
tensors); before readers followed writers, ranks read records from each other's files.
"""

from __future__ import annotations

import fractions
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.storage import VerifyingFileSystemReader, data_file_rank
from tests.harness import run_distributed
from tests.models import sharded_adam
from tests.scripts.fault_injection import LR, checkpoint_dict, live_state, step, zeroed_targets
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
        read_data = reader.read_data

        def files_too(plan: Any, planner: Any) -> Any:
            reader.files = {reader.storage_data[i.storage_index].relative_path for i in plan.items}
            return read_data(plan, planner)

        reader.read_data = files_too
        return reader

    def files(self) -> set[str]:
        """The files the readers read records from."""
        return set().union(*(getattr(r, "files", ()) for r in self.readers))

    def tensor_bytes_read(self) -> int:
        return sum(r.progress.tensor_bytes_read for r in self.readers)

    def take(self) -> tuple[int, int]:
        """Bytes read (all records, tensor records) since the last call
        (``benchmarks/bench_replicas_load.py`` counts each load apart)."""
        readers, self.readers = self.readers, []
        return (
            sum(r.progress.bytes_read for r in readers),
            sum(r.progress.tensor_bytes_read for r in readers),
        )


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
        state = zeroed_targets(target, sharded_adam(target, lr=LR))
        plugin = MegatronFSDPCheckpointIO(atomic_load=atomic)
        plugin.storage = counting = CountingStorage(plugin.storage)
        plugin.load_checkpoint(path, state=state)
        out[f"atomic={atomic}"] = {
            "read": counting.tensor_bytes_read(),
            "files": counting.files(),
            "differing": differing(facts(state), saved),
        }
    out["checkpoint"] = checkpoint_tensor_bytes(path) if rank == 0 else None
    return out


@pytest.mark.parametrize("mesh", [(2, 1), (2, 2), (2,)], ids=["hsdp-2x1", "hsdp-2x2", "fsdp-2"])
def test_replicated_records_are_read_once_per_load(tmp_path: Path, mesh: tuple[int, ...]) -> None:
    """(2, 2): two replica groups of model and Adam rows ({0, 2}, {1, 3}) and one of the
    whole world (Adam's ``step``), broadcasting side by side."""
    world_size = mesh[0] * mesh[-1] if len(mesh) == 2 else mesh[0]
    per_rank = run_distributed(_round_trip, world_size, str(tmp_path), mesh, timeout=TIMEOUT)
    total = per_rank[0]["checkpoint"]
    assert total > 0
    for case in ("atomic=False", "atomic=True"):
        for rank, result in enumerate(per_rank):
            assert result[case]["differing"] == [], (case, rank)
        reads = [result[case]["read"] for result in per_rank]
        assert sum(reads) == total, (case, reads, total)
        if len(mesh) == 2:  # every record has a replica: every rank shares the reading
            assert all(reads), (case, reads)
        # Loaded on the saving ranks: each replicated record, and each byte record, by the
        # rank that wrote it, so every rank reads its own files alone.
        for rank, result in enumerate(per_rank):
            files = result[case]["files"]
            assert files and all(data_file_rank(f) == rank for f in files), (case, rank, files)


def test_counting_sees_every_byte_a_single_rank_reads(tmp_path: Path) -> None:
    """Anti-vacuity: one rank alone reads the whole checkpoint, as counted."""
    (result,) = run_distributed(_round_trip, 1, str(tmp_path), (1,), timeout=TIMEOUT)
    for case in ("atomic=False", "atomic=True"):
        assert result[case]["differing"] == [], case
        assert result[case]["read"] == result["checkpoint"] > 0, case
        assert isinstance(result[case]["read"], int)


LR_KEY = "optimizer_states.0.param_groups.0.lr"


def _plan_and_share(rank: int, world_size: int, extra: bool, lr: Any = None) -> dict[str, Any]:
    """Plain tensors (replicated over the world) and a learning rate stored as a byte
    record, each rank's its own: rank 0 holds ``c`` too where ``extra``, and the learning
    rate ``lr`` where given."""
    from lightning_megatron_fsdp.agreement import Ranks
    from lightning_megatron_fsdp.checkpoint.replicated_reads import (
        SavedLayout,
        plan_replicated_reads,
    )

    tensors = {k: torch.full((4,), float(rank), dtype=torch.float64) for k in "ab"}
    if extra and rank == 0:
        tensors["c"] = torch.zeros(2)
    group = {"lr": 0.1 * (rank + 1) if lr is None or rank else lr}
    state = {"state_dict": tensors, "optimizer_states": [{"param_groups": [group]}]}
    keys = {"state_dict.a", "state_dict.b", "state_dict.c", LR_KEY}
    ranks = Ranks.of()
    plan = plan_replicated_reads(state, SavedLayout(keys, {LR_KEY}), ranks)
    planned = plan.settle(ranks.all_gather(plan.digests))
    kept = sorted(planned.state["state_dict"])
    read_lr = "lr" in planned.state["optimizer_states"][0]["param_groups"][0]
    try:
        planned.share("test")
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "kept": kept,
        "read_lr": read_lr,
        "groups": len(planned.groups),
        "values": {k: tensors[k][0].item() for k in "ab"},
        "lr": group["lr"],
    }


def test_a_group_whose_ranks_hold_other_targets_reads_as_before() -> None:
    agreed = run_distributed(_plan_and_share, 2, False, timeout=TIMEOUT)
    # Plain tensors every rank holds whole and the byte record: with no writer known,
    # rank 0 reads them, rank 1 receives them (its own values replaced by rank 0's).
    assert [r["kept"] for r in agreed] == [["a", "b"], []]
    assert [r["read_lr"] for r in agreed] == [True, False]
    assert all(r["groups"] == 1 for r in agreed)
    assert [r["values"] for r in agreed] == [{"a": 0.0, "b": 0.0}] * 2
    assert [r["lr"] for r in agreed] == [0.1, 0.1]
    disagreed = run_distributed(_plan_and_share, 2, True, timeout=TIMEOUT)
    assert [r["kept"] for r in disagreed] == [["a", "b", "c"], ["a", "b"]]
    assert [r["read_lr"] for r in disagreed] == [True, True]
    assert all(r["groups"] == 0 for r in disagreed)
    assert [r["values"] for r in disagreed] == [{"a": 0.0, "b": 0.0}, {"a": 1.0, "b": 1.0}]
    assert [r["lr"] for r in disagreed] == [0.1, 0.2]


def test_values_that_would_not_load_weights_only_fail_every_rank() -> None:
    """A value the reader cannot send as the checkpoint's byte records are loaded (a
    ``Fraction``, which the weights-only unpickler refuses) is refused on every rank, each
    naming the rank, and nothing is sent (no rank left waiting in a collective)."""
    failed = run_distributed(_plan_and_share, 2, False, fractions.Fraction(1, 3), timeout=TIMEOUT)
    for result in failed:
        expected = "CheckpointError: test: the byte records that rank(s) [0] read"
        assert result["error"].startswith(expected), result
        assert "trust_checkpoint=True" in result["error"], result
