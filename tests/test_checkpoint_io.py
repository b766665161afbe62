"""``MegatronFSDPCheckpointIO``: round trips, resharding, atomicity, validation, async save.

Multi-rank tests run real ranks on a real gloo group (``tests.harness``) with
``tests.models.PackedLM`` (nested units, a tie, a fragment in a padding gap, an unevenly
packed Linear, a 3-D parameter), sharded with ``shard_module`` and trained with a
``fully_shard_optimizer`` Adam, and write real DCP files under ``tmp_path``. Failures are
injected through the plugin's public ``storage_options`` with a real ``FileSystemWriter``
subclass, and crashes are reproduced by leaving the directories a crash would leave.

Oracles, independent of the plugin: the saved model's own local shards (bit-exact), the
unsharded model's state dict (names, shapes, dtypes), the ``crc32c`` package over the files
on disk (so the writer's combined per-record CRCs are checked against one pass of the file),
and, for resharding, full tensors assembled in the pytest process from the saving ranks'
local shards at the row offsets ``uneven_dtensor`` attached (each row covered exactly once).
Those offsets are the code under test, so the assembled tensors are themselves checked
against one process that trained the unsharded model on the same batches
(``tests.models.train_unsharded``): an offset wrong the same way on save and load cannot
pass.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import crc32c as crc32c_package
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    ensure_optimizer_state,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    NotACheckpointError,
)
from lightning_megatron_fsdp.storage.commit import resolve_latest_checkpoint
from lightning_megatron_fsdp.storage.filesystem import RECORD_ATTR, VerifyingFileSystemReader
from lightning_megatron_fsdp.storage.format import (
    ASIDE,
    MANIFEST_FILE,
    STAGING,
    FileRecord,
    Manifest,
    TensorSpec,
    compare_fingerprints,
    hidden_path,
    is_complete_checkpoint,
    parse_hidden_name,
    read_manifest,
)
from tests.gpu import assert_ran_on_cuda, cuda_world_size
from tests.harness import run_distributed
from tests.legacy_format import downgrade_to_format_1
from tests.models import (
    build_packed_lm,
    dp_mesh,
    fsdp_placements,
    lm_loss,
    local_shards,
    make_batch,
    shard_packed_lm,
    sharded_adam,
    train_unsharded,
)
from tests.scripts.fault_injection import LR, trained
from tests.scripts.fault_injection import step as _step
from tests.shard_facts import (
    assemble,
    assert_close_to_reference,
    assert_matches_full,
    assert_same_facts,
    reference_facts,
)
from tests.shard_facts import facts as shard_facts

TIMEOUT = 120.0
# DCP frames every stored item with torch.save: ~1.5 KB of zip headers and alignment.
ITEM_OVERHEAD_BYTES = 2048
# Sharded training vs one process: only the rounding of the gradient average differs.
REFERENCE_ATOL = 1e-6


@functools.cache
def _reference() -> dict[str, torch.Tensor]:
    """What ``trained`` holds, computed by one process without sharding."""
    return reference_facts(*train_unsharded(2, lr=LR))


# ---------------------------------------------------------------------------------------
# Helpers run on every rank
# ---------------------------------------------------------------------------------------


class _Wide(nn.Module):
    """Two wide layers: data dwarfs DCP's per-item framing, so file sizes mean something."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 192)
        self.b = nn.Linear(192, 160)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class _FailingWriter(FileSystemWriter):
    """A real ``FileSystemWriter``; on ``fail_rank`` it writes its files, then raises."""

    def __init__(self, path: Path, *, fail_rank: int) -> None:
        super().__init__(path)
        self._fail_rank = fail_rank

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        if dist.get_rank() == self._fail_rank:
            written.wait()
            raise OSError(f"injected write failure on rank {self._fail_rank}")
        return written


def _portable(worker: Any) -> Any:
    """Make a worker return its facts as bytes: tensors in the harness's result queue would
    travel as shared-memory handles, which die with the rank process."""

    @functools.wraps(worker)
    def wrapped(*args: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(worker(*args), buffer)
        return buffer.getvalue()

    return wrapped


def _run(worker: Any, world_size: int, *args: Any) -> list[Any]:
    results = run_distributed(worker, world_size, *args, timeout=TIMEOUT)
    return [torch.load(io.BytesIO(r), weights_only=False) for r in results]


def _failing(fail_rank: int) -> dict[str, Any]:
    return {"storage_writer_factory": functools.partial(_FailingWriter, fail_rank=fail_rank)}


def _checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int
) -> dict[str, Any]:
    """Lightning's checkpoint dict as the strategy hands it over: hooks attached."""
    model_state = get_model_state_dict(model)
    optimizer_state = {} if optimizer is None else get_optimizer_state_dict(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    checkpoint = {
        "state_dict": model_state,
        "global_step": step,
        "epoch": 1,
        "loops": {"fit_loop": {"step": step}},
        "hyper_parameters": {"lr": LR, "name": "packed"},
    }
    if optimizer is not None:
        checkpoint["optimizer_states"] = [optimizer_state]
    return checkpoint


def _targets(
    world_size: int, *, optimizer: bool = True, num_blocks: int = 2
) -> tuple[nn.Module, dict[str, Any]]:
    """An all-zero sharded model and all-zero Adam state (lr 0) to load into."""
    enable_cpu_execution()
    model = shard_packed_lm(build_packed_lm(None, num_blocks=num_blocks), dp_mesh(world_size))
    model_state = get_model_state_dict(model)
    state: dict[str, Any] = {"state_dict": model_state}
    optimizer_state: dict[str, Any] = {}
    if optimizer:
        adam = sharded_adam(model, lr=LR)
        ensure_optimizer_state(adam)
        optimizer_state = get_optimizer_state_dict(model, adam)
        for entries in optimizer_state["state"].values():
            for tensor in entries.values():
                tensor.zero_()
        for group in optimizer_state["param_groups"]:
            group["lr"] = 0.0
        state["optimizer_states"] = [optimizer_state]
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    return model, state


def _tensor_facts(checkpoint: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    return shard_facts(
        {k: checkpoint[k] for k in ("state_dict", "optimizer_states") if k in checkpoint}
    )


def _wide_save(world_size: int, path: Path) -> int:
    """Save a trained wide model; return the bytes of tensor data this rank must write."""
    model = _Wide()
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    shard_module(model, dp_mesh(world_size), fsdp_placements())
    adam = sharded_adam(model)
    model(torch.randn(4, 256, generator=torch.Generator().manual_seed(1))).sum().backward()
    adam.step()
    checkpoint = _checkpoint(model, adam, step=1)
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, path)
    shard_bytes = 0
    for kind, *rest in _tensor_facts(checkpoint).values():
        if kind == "shard" or (kind == "tensor" and dist.get_rank() == 0):
            shard_bytes += rest[-1].nbytes
    return shard_bytes


@_portable
def _save_round_trip(rank: int, world_size: int, root: str, resharded_from: str | None) -> dict:
    """Save at ``world_size``, load back bit-exact; optionally load a checkpoint of another
    world size. Returns facts for the pytest process."""
    root_path = Path(root) / f"ws{world_size}"
    path = root_path / "epoch=1-step=7.ckpt"
    model, adam = trained(world_size)
    checkpoint = _checkpoint(model, adam, step=7)
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint, path)
    saved = _tensor_facts(checkpoint)
    target_model, state = _targets(world_size)
    loaded = plugin.load_checkpoint(path, state=state)
    facts = {
        "saved": saved,
        "loaded": _tensor_facts(loaded),
        "rest": {k: v for k, v in loaded.items() if k not in ("state_dict", "optimizer_states")},
        "model": local_shards(model),
        "target_model": local_shards(target_model),
        "wide_shard_bytes": _wide_save(world_size, root_path / "wide"),
    }
    facts["listing"] = sorted(os.listdir(root_path))
    if resharded_from is not None:
        _, state = _targets(world_size)
        plugin.load_checkpoint(resharded_from, state=state)
        facts["resharded"] = _tensor_facts(state)
    return facts


def _on_disk(plugin: MegatronFSDPCheckpointIO, path: Path, world_size: int) -> dict[str, Any]:
    """Once every rank is done with ``path``: the listing of its folder, its step, and what
    loading it into fresh targets gives."""
    dist.barrier()
    on_disk = {"listing": sorted(os.listdir(path.parent)), "step": read_manifest(path).global_step}
    _, state = _targets(world_size)
    plugin.load_checkpoint(path, state=state)
    return {**on_disk, "loaded": _tensor_facts(state)}


@_portable
def _atomic_overwrite(rank: int, world_size: int, root: str) -> dict:
    """A save that fails on one rank leaves the previous checkpoint loadable; then a good
    overwrite replaces it; a foreign directory is never overwritten."""
    root_path = Path(root)
    path = root_path / "last.ckpt"
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    first = _checkpoint(model, adam, step=2)
    plugin.save_checkpoint(first, path)
    first_facts = _tensor_facts(first)
    _step(model, adam, 2)
    second = _checkpoint(model, adam, step=3)
    with pytest.raises(
        CheckpointSaveError,
        match=r"(?s)failed on rank\(s\) \[1\].*injected write failure on rank 1.*untouched",
    ):
        plugin.save_checkpoint(second, path, storage_options=_failing(fail_rank=1))
    after_failure = _on_disk(plugin, path, world_size)
    plugin.save_checkpoint(second, path)
    after_overwrite = _on_disk(plugin, path, world_size)
    # A malformed checkpoint on one rank only: every rank raises before writing anything.
    malformed = {**second, "state_dict": [1]} if rank == 1 else second
    with pytest.raises(CheckpointSaveError, match=r"rank 1: TypeError: checkpoint\['state_dict'\]"):
        plugin.save_checkpoint(malformed, path)
    foreign = root_path / "notes"
    if rank == 0:
        foreign.mkdir()
        (foreign / "readme.txt").write_text("mine")
    dist.barrier()
    with pytest.raises(
        CheckpointSaveError, match=r"Refusing to overwrite .*notes.*not a checkpoint"
    ):
        plugin.save_checkpoint(second, foreign)
    dist.barrier()
    return {
        "first": first_facts,
        "second": _tensor_facts(second),
        "after_failure": after_failure,
        "after_overwrite": after_overwrite,
        "foreign": sorted(os.listdir(foreign)),
        "final_listing": sorted(os.listdir(root_path)),
    }


def _damaged_copy(good: Path, name: str, damage: Callable[[Path], object]) -> Path:
    """Rank 0 copies the checkpoint ``good`` to ``name`` beside it and applies ``damage`` to
    the copy; every rank returns the copy's path once that is done."""
    copy = good.parent / name
    if dist.get_rank() == 0:
        shutil.copytree(good, copy)
        damage(copy)
    dist.barrier()
    return copy


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)
        file.seek(offset)
        file.write(bytes([byte[0] ^ 0xFF]))


def _zero_file(path: Path) -> None:
    """Same size, every byte zero."""
    path.write_bytes(bytes(path.stat().st_size))


def _bad_inputs(rank: int, world_size: int, root: str) -> list[str]:
    """Every bad input raises its documented error, with its message, on every rank."""
    root_path = Path(root)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    good, weights_only = root_path / "good", root_path / "weights-only"
    full = _checkpoint(model, adam, step=2)
    plugin.save_checkpoint(full, good)
    plugin.save_checkpoint(_checkpoint(model, None, step=2), weights_only)
    saved = _tensor_facts(full)
    checked = []

    def load(path: Path, **kwargs: Any) -> dict[str, Any]:
        state = kwargs.pop("state", None) or _targets(world_size)[1]
        return (kwargs.pop("plugin", None) or plugin).load_checkpoint(path, state=state, **kwargs)

    with pytest.raises(NotACheckpointError, match=r"missing-dir does not exist"):
        load(root_path / "missing-dir")
    checked.append("missing")

    single_file = root_path / "single.ckpt"
    if rank == 0:
        torch.save({"state_dict": {}}, single_file)
    dist.barrier()
    with pytest.raises(
        NotACheckpointError,
        match=r"single-file torch.save checkpoint .*"
        r"MegatronFSDPStrategy\(init_weights_from=\.\.\.\)",
    ):
        load(single_file)
    checked.append("single file")

    weights = root_path / "model.safetensors"  # consolidate's output, passed back by mistake
    if rank == 0:
        safetensors.torch.save_file({"w": torch.zeros(2)}, weights)
    dist.barrier()
    with pytest.raises(
        NotACheckpointError, match=r"model\.safetensors is a safetensors file, .*load_file"
    ) as refused:
        load(weights)
    assert "torch.load it" not in str(refused.value), refused.value  # torch.load cannot
    checked.append("safetensors file")

    no_manifest = _damaged_copy(good, "no-manifest", lambda c: (c / MANIFEST_FILE).unlink())
    with pytest.raises(NotACheckpointError, match=r"holds DCP files but no manifest.json"):
        load(no_manifest)
    checked.append("no manifest")

    garbled = _damaged_copy(good, "garbled", lambda c: (c / MANIFEST_FILE).write_text("{not json"))
    with pytest.raises(NotACheckpointError, match=r"manifest.json cannot be parsed"):
        load(garbled)
    checked.append("garbled manifest")

    truncated = _damaged_copy(good, "truncated", lambda c: os.truncate(c / "__1_0.distcp", 100))
    with pytest.raises(
        CheckpointCorruptedError, match=r"__1_0\.distcp: 100 bytes on disk, \d+ in the manifest"
    ):
        load(truncated)
    checked.append("truncated")

    flipped = _damaged_copy(good, "flipped", lambda c: _flip_byte(c / "__0_0.distcp", 700))
    # Found while reading, by every rank that reads that record; every rank raises, and the
    # message names the record and what each rank had already written into its targets.
    with pytest.raises(
        CheckpointCorruptedError,
        match=r"(?s)__0_0\.distcp: crc32c [0-9a-f]{8} read, [0-9a-f]{8} recorded for the record "
        r"of '[^']+' \(chunk at \[[0-9, ]*\]\), bytes \[\d+, \d+\).*The targets are partly "
        r"loaded \(atomic_load=False\).*rank 0: wrote \d+ of \d+ records",
    ):
        load(flipped)
    checked.append("checksum")

    # Same size, garbage content, checksums off: DCP itself fails while reading, and the
    # failure is translated into a CheckpointError naming the failing rank(s).
    zeroed = _damaged_copy(good, "zeroed", lambda c: _zero_file(c / "__1_0.distcp"))
    with pytest.raises(CheckpointError, match=r"Loading checkpoint .*zeroed failed on rank\(s\)"):
        load(zeroed, plugin=MegatronFSDPCheckpointIO(verify_checksums=False))
    checked.append("dcp failure")

    # Another reader (torch's own) cannot verify records as it reads: the files' CRC32Cs
    # are checked before any read instead, split across ranks, and nothing is written.
    torch_reader = MegatronFSDPCheckpointIO(storage_reader_factory=FileSystemReader)

    def refused_unchanged(path: Path, pattern: str, **kwargs: Any) -> None:
        _, state = _targets(world_size)
        before = _tensor_facts(state)
        with pytest.raises(CheckpointCorruptedError, match=f"(?s){pattern}.*Nothing was loaded"):
            load(path, state=state, **kwargs)
        assert_same_facts(_tensor_facts(state), before)

    refused_unchanged(
        flipped,
        r"__0_0\.distcp: crc32c [0-9a-f]{8} on disk, [0-9a-f]{8} in the manifest.*"
        r"\[rank\(s\) \[\d\]\]",
        plugin=torch_reader,
    )
    _, state = _targets(world_size)
    load(good, plugin=torch_reader, state=state)
    assert_same_facts(_tensor_facts(state), saved)
    checked.append("another reader")

    # Format 1 (sha256, no per-record checksums) loads bit-exactly; damage is found before
    # any read, so even the in-place load changes nothing.
    legacy = root_path / "legacy"
    if rank == 0:
        shutil.copytree(good, legacy)
        downgrade_to_format_1(legacy)
        shutil.copytree(legacy, root_path / "legacy-flipped")
        with open(root_path / "legacy-flipped" / "__1_0.distcp", "r+b") as file:
            file.seek(700)
            byte = file.read(1)
            file.seek(700)
            file.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    assert read_manifest(legacy).checksum == "sha256"
    _, state = _targets(world_size)
    load(legacy, state=state)
    assert_same_facts(_tensor_facts(state), saved)
    refused_unchanged(
        root_path / "legacy-flipped",
        r"__1_0\.distcp: sha256 [0-9a-f]{64} on disk, [0-9a-f]{64} in the manifest",
    )
    checked.append("format 1")

    # Fingerprint: a missing key, an unexpected key, a shape and a dtype, in one message.
    _, state = _targets(world_size)
    model_state = dict(state["state_dict"])
    del model_state["blocks.1.gain"]
    model_state["extra.weight"] = torch.zeros(3)
    model_state["embed.weight"] = torch.zeros(5, 6)
    model_state["head.bias"] = torch.zeros(11, dtype=torch.bfloat16)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"(?s)model: 1 key\(s\) of the target are missing from the checkpoint: "
        r"\['extra.weight'\].*"
        r"model: 1 key\(s\) in the checkpoint are not in the target: \['blocks.1.gain'\].*"
        r"model 'embed.weight': shape \(11, 6\) in the checkpoint, \(5, 6\) in the target.*"
        r"model 'head.bias': dtype float32 in the checkpoint, bfloat16 in the target",
    ) as mismatch:
        load(good, state={**state, "state_dict": model_state})
    # One summary line first (count by kind, the first problem), then the full list.
    summary, *details, advice = str(mismatch.value).splitlines()
    assert summary == (
        f"Cannot load checkpoint {good}: 4 problems (1 missing, 1 unexpected, 1 shape, 1 "
        "dtype); first: model: 1 key(s) of the target are missing from the checkpoint: "
        "['extra.weight']"
    ), summary
    assert len(details) == 4 and all(line.startswith("  - model") for line in details), details
    assert advice.startswith("Nothing was loaded. Build the model and optimizers"), advice
    checked.append("fingerprint")

    # A model with another number of blocks: the extra block's FQNs are named.
    _, state = _targets(world_size, num_blocks=3)
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: .*blocks.2"):
        load(good, state=state)
    # A model of other widths: every FQN's shape differs; the first line says how many.
    _, state = _targets(world_size)
    state["state_dict"] = {k: torch.zeros(2, *v.shape) for k, v in state["state_dict"].items()}
    with pytest.raises(CheckpointMismatchError) as reshaped:
        load(good, state=state)
    count = len(state["state_dict"])
    summary, *details, _ = str(reshaped.value).splitlines()
    assert re.fullmatch(
        rf"Cannot load checkpoint {re.escape(str(good))}: {count} problems \({count} shape\); "
        r"first: model '[\w.]+': shape \(.*\) in the checkpoint, \(2, .*\) in the target",
        summary,
    ), summary
    assert len(details) == count > 10, details
    checked.append("other model")

    # Only rank 1's target is wrong: every rank raises, naming rank 1.
    _, state = _targets(world_size)
    if rank == 1:
        state["state_dict"] = {**state["state_dict"], "only.on.rank1": torch.zeros(2)}
    with pytest.raises(CheckpointMismatchError, match=r"only\.on\.rank1.*\[rank\(s\) \[1\]\]"):
        load(good, state=state)
    checked.append("one rank")

    # Optimizer state asked of a weights-only checkpoint; then the weights-only load.
    with pytest.raises(
        CheckpointMismatchError, match=r"saved weights-only.*leave 'optimizer_states' out"
    ):
        load(weights_only)
    target_model, state = _targets(world_size, optimizer=False)
    loaded = load(weights_only, state=state)
    assert "optimizer_states" not in loaded
    assert_same(local_shards(target_model), local_shards(model))
    checked.append("weights only")

    _, state = _targets(world_size)
    state["optimizer_states"] = state["optimizer_states"] * 2
    with pytest.raises(CheckpointMismatchError, match=r"holds state for 1 optimizer\(s\), but 2"):
        load(good, state=state)
    checked.append("optimizer count")

    with pytest.raises(TypeError, match=r"state must be \{'state_dict'"):
        plugin.load_checkpoint(good, state={"state_dict": 5})
    checked.append("malformed state")

    # strict=False: a target key the checkpoint lacks keeps its value, a checkpoint key the
    # target lacks is ignored, everything else loads; a shape mismatch is still refused.
    _, state = _targets(world_size)
    model_state = dict(state["state_dict"])
    del model_state["head.bias"]
    model_state["extra.buffer"] = torch.full((3,), 7.0)
    state["state_dict"] = model_state
    load(good, state=state, strict=False)
    assert torch.equal(model_state["extra.buffer"], torch.full((3,), 7.0))
    loaded_facts = _tensor_facts(state)
    expected = {k: v for k, v in saved.items() if k != "state_dict/head.bias"}
    assert_same_facts(
        {k: v for k, v in loaded_facts.items() if k != "state_dict/extra.buffer"}, expected
    )
    _, state = _targets(world_size)
    state["state_dict"] = {**state["state_dict"], "embed.weight": torch.zeros(5, 6)}
    with pytest.raises(CheckpointMismatchError, match=r"'embed.weight': shape \(11, 6\)"):
        load(good, state=state, strict=False)
    checked.append("strict=False")

    # remove_checkpoint: rank 0 does the filesystem work (Lightning calls it there only),
    # deletes only our checkpoints, and leaves nothing half-deleted behind.
    if rank == 0:
        for victim in (single_file, no_manifest):
            with pytest.raises(CheckpointError, match=rf"refusing to delete .*{victim.name}: "):
                plugin.remove_checkpoint(victim)
    plugin.remove_checkpoint(good)
    plugin.remove_checkpoint(root_path / "never-existed")
    dist.barrier()
    assert not good.exists() and no_manifest.exists() and single_file.exists()
    assert not [p for p in os.listdir(root_path) if parse_hidden_name(p)]
    checked.append("remove")
    return checked


@_portable
def _async_vs_sync(rank: int, world_size: int, root: str) -> dict:
    """An async save equals a sync save byte for byte although training goes on during
    it; a failing background save is reported at poll() and at the next save."""
    root_path = Path(root)
    model, adam = trained(world_size)
    checkpoint = _checkpoint(model, adam, step=3)
    before = _tensor_facts(checkpoint)
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, root_path / "sync")
    plugin = MegatronFSDPCheckpointIO(async_save=True)
    plugin.save_checkpoint(checkpoint, root_path / "async")
    _step(model, adam, 3)  # trains on, and changes every tensor the save is writing
    changed = _tensor_facts(checkpoint)
    plugin.wait()
    _, state = _targets(world_size)
    MegatronFSDPCheckpointIO().load_checkpoint(root_path / "async", state=state)
    loaded = _tensor_facts(state)

    # A failing background save: save_checkpoint returns, poll() raises it once.
    plugin.save_checkpoint(
        _checkpoint(model, adam, step=4), root_path / "async", storage_options=_failing(0)
    )
    with pytest.raises(CheckpointSaveError, match=r"(?s)rank\(s\) \[0\].*injected write failure"):
        while not plugin.poll():
            time.sleep(0.01)
    plugin.wait()  # reported once
    after_failure_step = read_manifest(root_path / "async").global_step
    # Another one: the next save_checkpoint raises it before starting.
    plugin.save_checkpoint(
        _checkpoint(model, adam, step=4), root_path / "async", storage_options=_failing(1)
    )
    with pytest.raises(CheckpointSaveError, match=r"injected write failure on rank 1"):
        plugin.save_checkpoint(_checkpoint(model, adam, step=4), root_path / "async")
    # Removing the checkpoint a background save is writing waits for that save first.
    plugin.save_checkpoint(_checkpoint(model, adam, step=5), root_path / "removed")
    plugin.remove_checkpoint(root_path / "removed")
    plugin.wait()
    dist.barrier()
    removed_exists = (root_path / "removed").exists()
    # A later async save copies into the earlier saves' staging buffers (the same memory)
    # and still writes exactly what a sync save of the state at its call writes.
    first_buffers = {t.data_ptr() for t in plugin._copies._held}
    _step(model, adam, 1)
    checkpoint = _checkpoint(model, adam, step=6)
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, root_path / "sync2")
    plugin.save_checkpoint(checkpoint, root_path / "async2")
    reused = {t.data_ptr() for t in plugin._copies._held} == first_buffers
    _step(model, adam, 1)
    plugin.wait()
    # teardown waits for the last save.
    plugin.save_checkpoint(_checkpoint(model, adam, step=5), root_path / "teardown")
    plugin.teardown()
    complete_after_teardown = is_complete_checkpoint(root_path / "teardown")
    dist.barrier()
    return {
        "before": before,
        "changed": changed,
        "loaded": loaded,
        "after_failure_step": after_failure_step,
        "complete_after_teardown": complete_after_teardown,
        "removed_exists": removed_exists,
        "reused": reused and bool(first_buffers),
        "listing": sorted(os.listdir(root_path)),
    }


# ---------------------------------------------------------------------------------------
# Assertions (pytest process)
# ---------------------------------------------------------------------------------------


def assert_same(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def assert_same_save(sync: Path, asynchronous: Path, world_size: int) -> None:
    """Byte for byte: every shard file and meta.pt. DCP's .metadata differs only in its
    StorageMeta (the directory it was written to and a random save id), as does `.metadata.keys`
    (its skeleton), and the manifests
    only in that file's record."""
    shards = [f"__{rank}_0.distcp" for rank in range(world_size)]
    names = sorted(os.listdir(sync))
    assert names == sorted(os.listdir(asynchronous))
    assert names == sorted([".metadata", ".metadata.keys", *shards, MANIFEST_FILE, "meta.pt"])
    for name in [*shards, "meta.pt"]:
        assert (sync / name).read_bytes() == (asynchronous / name).read_bytes(), name
    sync_metadata = FileSystemReader(sync).read_metadata()
    async_metadata = FileSystemReader(asynchronous).read_metadata()
    for field in ("state_dict_metadata", "planner_data", "storage_data", "version"):
        assert getattr(sync_metadata, field) == getattr(async_metadata, field), field
    sync_manifest = read_manifest(sync).to_json()
    async_manifest = read_manifest(asynchronous).to_json()
    for name in (".metadata", ".metadata.keys"):  # both carry the save's StorageMeta
        del sync_manifest["files"][name], async_manifest["files"][name]
    assert sync_manifest == async_manifest


def assert_manifest(path: Path, world_size: int) -> Manifest:
    """The manifest against independent oracles: the unsharded model and crc32c."""
    manifest = read_manifest(path)
    reference = build_packed_lm(0).state_dict(keep_vars=False)
    assert manifest.fingerprint == {
        k: TensorSpec(tuple(v.shape), "float32") for k, v in reference.items()
    }
    assert len(manifest.optimizer_fingerprints) == 1
    expected_optimizer = {}  # per parameter: the tied head.weight has no state of its own
    for fqn, value in build_packed_lm(0).named_parameters():
        expected_optimizer[f"{fqn}/step"] = TensorSpec((), "float32")
        for name in ("exp_avg", "exp_avg_sq"):
            expected_optimizer[f"{fqn}/{name}"] = TensorSpec(tuple(value.shape), "float32")
    assert manifest.optimizer_fingerprints[0] == expected_optimizer
    assert manifest.world_size == world_size
    assert manifest.mesh == {"shape": [world_size], "dim_names": None}
    assert (manifest.global_step, manifest.epoch) == (7, 1)
    assert set(manifest.versions) == {
        "torch",
        "lightning",
        "megatron_fsdp",
        "lightning_megatron_fsdp",
    }
    on_disk = sorted(os.listdir(path))
    assert on_disk == sorted([*manifest.files, MANIFEST_FILE])
    assert {f"__{r}_0.distcp" for r in range(world_size)} <= set(manifest.files)
    for name, record in manifest.files.items():
        data = (path / name).read_bytes()
        assert record.size == len(data), name
        assert record.crc32c == f"{crc32c_package.crc32c(data):08x}", name
        assert record.sha256 is None, name
    assert manifest.format_version == 2 and manifest.checksum == "crc32c"
    return manifest


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A checkpoint saved (and round-tripped) by 4 ranks, and the full reference tensors."""
    root = tmp_path_factory.mktemp("ws4")
    results = _run(_save_round_trip, 4, str(root), None)
    return {
        "root": root,
        "path": root / "ws4" / "epoch=1-step=7.ckpt",
        "results": results,
        "full": assemble([r["saved"] for r in results]),
    }


def _check_round_trip(root: Path, world_size: int, results: list[dict]) -> None:
    for rank, facts in enumerate(results):
        assert_same_facts(facts["loaded"], facts["saved"])
        assert_same(facts["target_model"], facts["model"])  # loaded in place into the model
        assert facts["rest"] == {
            "global_step": 7,
            "epoch": 1,
            "loops": {"fit_loop": {"step": 7}},
            "hyper_parameters": {"lr": LR, "name": "packed"},
        }, rank
        assert facts["listing"] == ["epoch=1-step=7.ckpt", "wide"], rank  # no hidden dirs
    # The saved optimizer state is real (Adam moved it), and lr came back, not the target's 0.
    saved = results[0]["saved"]
    assert saved["optimizer_states/0/param_groups/0/lr"] == ("value", LR)
    assert any(f[0] == "shard" and f[-1].abs().sum() > 0 for f in saved.values())
    # Every row of every tensor was saved by exactly one rank and compared...
    full = assemble([r["saved"] for r in results])
    assert_matches_full(full, [r["loaded"] for r in results])
    # ...and the rows, put together at the offsets under test, are the unsharded model's.
    assert_close_to_reference(full, _reference(), REFERENCE_ATOL)
    assert_manifest(root / f"ws{world_size}" / "epoch=1-step=7.ckpt", world_size)
    # On disk: the shards, never a gathered tensor (that would be world_size times larger).
    wide = root / f"ws{world_size}" / "wide"
    distcp = sum(p.stat().st_size for p in wide.glob("*.distcp"))
    shard_bytes = sum(r["wide_shard_bytes"] for r in results)
    items = len(FileSystemReader(wide).read_metadata().storage_data)
    assert shard_bytes <= distcp <= shard_bytes + ITEM_OVERHEAD_BYTES * items
    assert ITEM_OVERHEAD_BYTES * items < 0.1 * shard_bytes  # the bound is tight


def test_round_trip_at_4_is_bit_exact(saved_at_4: dict[str, Any]) -> None:
    _check_round_trip(saved_at_4["root"], 4, saved_at_4["results"])


@pytest.mark.both_versions
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_round_trip_and_resharding_from_4(
    world_size: int, tmp_path: Path, saved_at_4: dict[str, Any]
) -> None:
    """Same-size round trip at ``world_size``, and the 4-rank checkpoint loaded here."""
    results = _run(_save_round_trip, world_size, str(tmp_path), str(saved_at_4["path"]))
    _check_round_trip(tmp_path, world_size, results)
    assert_close_to_reference(saved_at_4["full"], _reference(), REFERENCE_ATOL)
    assert_matches_full(saved_at_4["full"], [r["resharded"] for r in results])


def test_failed_save_keeps_previous_checkpoint_and_overwrite_is_atomic(tmp_path: Path) -> None:
    results = _run(_atomic_overwrite, 2, str(tmp_path))
    full_first = assemble([r["first"] for r in results])
    full_second = assemble([r["second"] for r in results])
    assert any(not torch.equal(full_first[k], full_second[k]) for k in full_first if "exp_avg" in k)
    for facts in results:
        failed = facts["after_failure"]
        assert failed["listing"] == ["last.ckpt"]  # the failed save left nothing behind
        assert failed["step"] == 2
        overwritten = facts["after_overwrite"]
        assert overwritten["listing"] == ["last.ckpt"]  # no aside copy, no temp dir
        assert overwritten["step"] == 3
        assert facts["foreign"] == ["readme.txt"]
        assert facts["final_listing"] == ["last.ckpt", "notes"]
    assert_matches_full(full_first, [r["after_failure"]["loaded"] for r in results])
    assert_matches_full(full_second, [r["after_overwrite"]["loaded"] for r in results])


def test_bad_inputs_raise_on_every_rank(tmp_path: Path) -> None:
    results = run_distributed(_bad_inputs, 2, str(tmp_path), timeout=TIMEOUT)
    expected = [
        "missing",
        "single file",
        "safetensors file",
        "no manifest",
        "garbled manifest",
        "truncated",
        "checksum",
        "dcp failure",
        "another reader",
        "format 1",
        "fingerprint",
        "other model",
        "one rank",
        "weights only",
        "optimizer count",
        "malformed state",
        "strict=False",
        "remove",
    ]
    assert results == [expected, expected]


def test_async_save_equals_sync_save_and_reports_failures(tmp_path: Path) -> None:
    results = _run(_async_vs_sync, 2, str(tmp_path))
    assert_same_save(tmp_path / "sync", tmp_path / "async", world_size=2)
    assert_same_save(tmp_path / "sync2", tmp_path / "async2", world_size=2)
    before = assemble([r["before"] for r in results])
    changed = assemble([r["changed"] for r in results])
    assert any(not torch.equal(before[k], changed[k]) for k in before if "exp_avg" in k)
    assert_matches_full(before, [r["loaded"] for r in results])  # the staged copy, not later
    for facts in results:
        assert facts["after_failure_step"] == 3  # the failed saves left the old one
        assert facts["complete_after_teardown"]
        assert not facts["removed_exists"]
        assert facts["reused"]
        assert facts["listing"] == ["async", "async2", "sync", "sync2", "teardown"]


# ---------------------------------------------------------------------------------------
# Single-process tests: crash recovery, discovery, removal, the manifest (no process group)
# ---------------------------------------------------------------------------------------


def _plain_checkpoint(step: int) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((4, 3), float(step))}, "global_step": step}


def _load_plain(plugin: MegatronFSDPCheckpointIO, path: Path) -> torch.Tensor:
    state = {"state_dict": {"w": torch.zeros(4, 3)}}
    plugin.load_checkpoint(path, state=state)
    return state["state_dict"]["w"]


def test_crash_windows_recover_and_latest_is_complete(tmp_path: Path) -> None:
    plugin = MegatronFSDPCheckpointIO()
    last, last_v1 = tmp_path / "last.ckpt", tmp_path / "last-v1.ckpt"
    plugin.save_checkpoint(_plain_checkpoint(5), last)
    plugin.save_checkpoint(_plain_checkpoint(3), last_v1)
    # Crash during a save of last.ckpt, between "rename old aside" and "rename new in":
    # the aside copy is complete, the new one too (manifest written), the final name gone.
    aside = hidden_path(last, ASIDE, "a" * 32)
    os.rename(last, aside)
    shutil.copytree(last_v1, hidden_path(last, STAGING, "b" * 32))
    # And debris a reader must never pick: a save that crashed before its manifest, and
    # complete-looking names that are not complete.
    crashed = hidden_path(last, STAGING, "c" * 32)
    crashed.mkdir()
    (crashed / ".metadata").write_bytes(b"partial")
    (tmp_path / "last-v2.ckpt").mkdir()  # no manifest
    truncated = tmp_path / "last-v3.ckpt"
    shutil.copytree(last_v1, truncated)
    with open(truncated / "meta.pt", "r+b") as file:
        file.truncate(10)
    assert not is_complete_checkpoint(last)
    assert not is_complete_checkpoint(truncated)
    assert resolve_latest_checkpoint(tmp_path, recover=False) == last_v1
    assert resolve_latest_checkpoint(tmp_path) == last  # restored: step 5 beats step 3
    assert not aside.exists() and is_complete_checkpoint(last)
    assert read_manifest(last).global_step == 5
    assert resolve_latest_checkpoint(tmp_path, "epoch*") is None
    assert resolve_latest_checkpoint(tmp_path / "nowhere") is None
    # load_checkpoint restores it too.
    os.rename(last, aside)
    torch.testing.assert_close(_load_plain(plugin, last), torch.full((4, 3), 5.0), rtol=0, atol=0)
    # The next commit under that name deletes the stale hidden siblings.
    plugin.save_checkpoint(_plain_checkpoint(6), last)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "last-v1.ckpt",
        "last-v2.ckpt",
        "last-v3.ckpt",
        "last.ckpt",
    ]
    # The manifest's mtime breaks a step tie: the newer of two step-6 checkpoints wins.
    plugin.save_checkpoint(_plain_checkpoint(6), last_v1)
    os.utime(last / MANIFEST_FILE, ns=(10**18, 10**18))
    os.utime(last_v1 / MANIFEST_FILE, ns=(10**18 + 1, 10**18 + 1))
    assert resolve_latest_checkpoint(tmp_path) == last_v1
    os.utime(last / MANIFEST_FILE, ns=(10**18 + 2, 10**18 + 2))
    assert resolve_latest_checkpoint(tmp_path) == last


def test_remove_checkpoint_deletes_only_ours(tmp_path: Path) -> None:
    plugin = MegatronFSDPCheckpointIO()
    path = tmp_path / "epoch=0.ckpt"
    plugin.save_checkpoint(_plain_checkpoint(1), path)
    staging = hidden_path(tmp_path / "x.ckpt", STAGING, "d" * 32)
    staging.mkdir()
    (tmp_path / "mine").mkdir()
    (tmp_path / "file.ckpt").write_bytes(b"data")
    with pytest.raises(CheckpointError, match=r"refusing to delete .*mine: it is not a checkpoint"):
        plugin.remove_checkpoint(tmp_path / "mine")
    with pytest.raises(CheckpointError, match=r"refusing to delete .*file.ckpt"):
        plugin.remove_checkpoint(tmp_path / "file.ckpt")
    # A link (Lightning's save_last="link") goes, its target stays; saving over one too.
    (tmp_path / "link.ckpt").symlink_to(path.name)
    (tmp_path / "saved-over-link.ckpt").symlink_to(path.name)
    plugin.remove_checkpoint(tmp_path / "link.ckpt")
    plugin.save_checkpoint(_plain_checkpoint(2), tmp_path / "saved-over-link.ckpt")
    assert read_manifest(path).global_step == 1
    assert read_manifest(tmp_path / "saved-over-link.ckpt").global_step == 2
    assert not (tmp_path / "saved-over-link.ckpt").is_symlink()
    plugin.remove_checkpoint(tmp_path / "saved-over-link.ckpt")
    plugin.remove_checkpoint(path)
    plugin.remove_checkpoint(staging)
    plugin.remove_checkpoint(tmp_path / "gone")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.ckpt", "mine"]


def test_save_replaces_a_single_file_checkpoint_and_validates_options(tmp_path: Path) -> None:
    plugin = MegatronFSDPCheckpointIO(write_checksums=False)
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {}}, path)  # e.g. from a run with another strategy
    plugin.save_checkpoint(_plain_checkpoint(2), path)
    manifest = read_manifest(path)
    assert all(record.digest() is None for record in manifest.files.values())
    assert manifest.checksum is None
    torch.testing.assert_close(_load_plain(plugin, path), torch.full((4, 3), 2.0), rtol=0, atol=0)
    with pytest.raises(CheckpointSaveError, match=r"rank 0: TypeError: checkpoint\['state_dict'\]"):
        plugin.save_checkpoint({"state_dict": [1]}, tmp_path / "bad")
    with pytest.raises(CheckpointSaveError, match=r"storage_options must be None or"):
        plugin.save_checkpoint(_plain_checkpoint(1), tmp_path / "bad", storage_options={"x": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    with pytest.raises(TypeError, match=r"async_save must be a bool, got 'yes'"):
        MegatronFSDPCheckpointIO(async_save="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"thread_count must be >= 1, got 0"):
        MegatronFSDPCheckpointIO(thread_count=0)


def test_manifest_parsing_and_fingerprint_messages() -> None:
    spec = TensorSpec((2, 3), "float32")
    assert compare_fingerprints({"a": spec}, {"a": spec}, what="model", strict=True) == []
    problems = compare_fingerprints(
        {"a": spec, "b": spec, "obj": TensorSpec(None, None)},
        {"a": TensorSpec((3, 2), "bfloat16"), "c": spec, "obj": spec},
        what="model",
        strict=True,
    )
    assert [(p.category, p.text) for p in problems] == [
        ("missing", "model: 1 key(s) of the target are missing from the checkpoint: ['c']"),
        ("unexpected", "model: 1 key(s) in the checkpoint are not in the target: ['b']"),
        ("shape", "model 'a': shape (2, 3) in the checkpoint, (3, 2) in the target"),
        ("dtype", "model 'a': dtype float32 in the checkpoint, bfloat16 in the target"),
        (
            "value",
            "model 'obj': the checkpoint holds a non-tensor value, the target holds (2, 3) float32",
        ),
    ]
    assert {p.error for p in problems} == {CheckpointMismatchError}
    many = {f"k{i:02d}": spec for i in range(25)}
    (problem,) = compare_fingerprints({}, many, what="optimizer 0", strict=True)
    assert problem.text.endswith("'k19', ... and 5 more]")
    assert compare_fingerprints({}, many, what="m", strict=False) == []

    manifest = Manifest(
        fingerprint={"w": spec},
        optimizer_fingerprints=[],
        world_size=2,
        mesh={"shape": [2], "dim_names": ["dp"]},
        versions={"torch": torch.__version__},
        global_step=4,
        epoch=0,
        files={".metadata": FileRecord(10, crc32c="0" * 8), "meta.pt": FileRecord(3)},
    )
    assert Manifest.from_json(json.loads(manifest.dumps())) == manifest
    document = manifest.to_json()
    assert (document["format_version"], document["checksum"]) == (2, "crc32c")
    # Format 1 (sha256, no "checksum" field) still parses; its digests stay sha256.
    legacy = dataclasses.replace(
        manifest,
        format_version=1,
        files={".metadata": FileRecord(10, "0" * 64), "meta.pt": FileRecord(3)},
    )
    assert "checksum" not in legacy.to_json()
    assert Manifest.from_json(json.loads(legacy.dumps())) == legacy
    assert legacy.checksum == "sha256"
    for change, message in [
        ({"format": "other"}, r"'format' is 'other', expected 'lightning-megatron-fsdp'"),
        ({"format_version": 3}, r"format_version 3 is not supported"),
        ({"checksum": "sha256"}, r"'checksum' is 'sha256' but the files carry 'crc32c'"),
        ({"world_size": 0}, r"world_size must be an int >= 1, got 0"),
        ({"files": {"meta.pt": {"size": 1}}}, r"files must list '.metadata' and 'meta.pt'"),
        ({"fingerprint": {"w": {"shape": [2]}}}, r"expected \{'shape': ..., 'dtype': ...\}"),
        ({"fingerprint": {"w": {"shape": [2], "dtype": "floaty"}}}, r"'floaty' is not a torch"),
        ({"global_step": "4"}, r"global_step must be an int or None"),
    ]:
        with pytest.raises(ValueError, match=message):
            Manifest.from_json({**document, **change})
    with pytest.raises(ValueError, match=r"malformed manifest \(KeyError"):
        Manifest.from_json({k: v for k, v in document.items() if k != "epoch"})
    assert parse_hidden_name(".last.ckpt.tmp-" + "0" * 32) == ("last.ckpt", "tmp")
    assert parse_hidden_name("last.ckpt") is None
    with pytest.raises(ValueError, match=r"bad kind 'new'"):
        hidden_path("/x/last.ckpt", "new", "0" * 32)


# ---------------------------------------------------------------------------------------
# GPU: the same async == sync check with NCCL as the default backend
# ---------------------------------------------------------------------------------------


def _gpu_async_vs_sync(rank: int, world_size: int, root: str) -> str:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (world_size,))
    model = build_packed_lm(0).cuda()
    with sharding_scope():  # megatron-fsdp 0.7: a parent and its units share one context
        for block in model.blocks:
            shard_module(block, mesh, fsdp_placements())
        shard_module(model, mesh, fsdp_placements())
    adam = sharded_adam(model)
    lm_loss(model, tuple(t.cuda() for t in make_batch(0))).backward()
    adam.step()
    checkpoint = _checkpoint(model, adam, step=1)
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, Path(root) / "sync")
    plugin = MegatronFSDPCheckpointIO(async_save=True)
    plugin.save_checkpoint(checkpoint, Path(root) / "async")
    plugin.teardown()
    return str(next(model.parameters()).device)


@pytest.mark.gpu
def test_async_save_equals_sync_save_on_gpu(tmp_path: Path) -> None:
    world_size = cuda_world_size()
    devices = run_distributed(
        _gpu_async_vs_sync, world_size, str(tmp_path), timeout=TIMEOUT, init_process_group=False
    )
    assert_ran_on_cuda(devices, world_size)
    assert_same_save(tmp_path / "sync", tmp_path / "async", world_size)


def test_records_carry_their_crc32c_and_any_dcp_reader_reads_them(tmp_path: Path) -> None:
    """Every record's CRC32C (checked here with the ``crc32c`` package over the bytes on
    disk) and its tensor payload offset ride in ``.metadata``; each record is byte for byte
    ``torch.save``'s output for its tensor (the second tensor of a kind is written from the
    first one's template); torch's own reader and ours both load the files bit-exactly,
    including a view into a packed buffer, a transposed tensor, bf16, an empty and a 0-d
    tensor."""
    packed = torch.arange(40, dtype=torch.float32)
    tensors = {
        "view": packed[10:22].view(3, 4),
        "transposed": torch.arange(6.0).view(2, 3).t(),
        "bf16": torch.randn(5, generator=torch.Generator().manual_seed(0)).bfloat16(),
        "empty": torch.empty(0, 2),
        "scalar": torch.tensor(7),
        "ints": torch.arange(9, dtype=torch.int64),
        "ints_2": torch.arange(9, 18, dtype=torch.int64),
        "bf16_2": torch.randn(5, generator=torch.Generator().manual_seed(1)).bfloat16(),
    }
    path = tmp_path / "records.ckpt"
    MegatronFSDPCheckpointIO().save_checkpoint({"state_dict": tensors, "global_step": 1}, path)
    metadata = FileSystemReader(str(path)).read_metadata()
    payloads = 0
    for index, info in metadata.storage_data.items():
        record = getattr(info, RECORD_ATTR)
        data = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        assert record["crc32c"] == crc32c_package.crc32c(data), index.fqn
        tensor = tensors[index.fqn.removeprefix("state_dict.")].contiguous()
        raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        _, payload = record["payload"]
        assert data[payload : payload + len(raw)] == raw, index.fqn
        # The record is exactly torch.save's output for the tensor in a storage of its own.
        expected = io.BytesIO()
        torch.save(tensor.clone(memory_format=torch.contiguous_format), expected)
        assert data == expected.getvalue(), index.fqn
        payloads += 1
    assert payloads == len(tensors)

    for reader in (FileSystemReader, VerifyingFileSystemReader):
        plugin = MegatronFSDPCheckpointIO(storage_reader_factory=reader)
        targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
        targets["transposed"] = torch.zeros(3, 2)  # contiguous target, transposed source
        plugin.load_checkpoint(path, state={"state_dict": targets})
        for key, value in tensors.items():
            torch.testing.assert_close(targets[key], value, rtol=0, atol=0, msg=key)


def test_files_of_another_writer_are_hashed_after_writing_and_checked_before_reading(
    tmp_path: Path,
) -> None:
    """torch's own ``FileSystemWriter`` records no per-record CRC: the plugin hashes its
    files after writing, and the default reader checks them whole before any record is read,
    so a damaged one is refused with the targets untouched."""
    tensors = {"w": torch.arange(12.0).view(3, 4), "b": torch.arange(5, dtype=torch.int32)}
    path = tmp_path / "other-writer.ckpt"
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(
        {"state_dict": tensors}, path, storage_options={"storage_writer_factory": FileSystemWriter}
    )
    manifest = read_manifest(path)
    for name, record in manifest.files.items():
        assert record.crc32c == f"{crc32c_package.crc32c((path / name).read_bytes()):08x}", name
    metadata = FileSystemReader(str(path)).read_metadata()
    assert not any(hasattr(info, RECORD_ATTR) for info in metadata.storage_data.values())
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
    plugin.load_checkpoint(path, state={"state_dict": targets})
    for key, value in tensors.items():
        torch.testing.assert_close(targets[key], value, rtol=0, atol=0, msg=key)

    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-30] ^= 0x01
    shard.write_bytes(bytes(data))
    targets = {k: torch.full_like(v, 7) for k, v in tensors.items()}
    with pytest.raises(
        CheckpointCorruptedError,
        match=r"(?s)__0_0\.distcp: crc32c [0-9a-f]{8} on disk, [0-9a-f]{8} in the manifest.*"
        r"Nothing was loaded: no rank had begun reading tensor data",
    ):
        plugin.load_checkpoint(path, state={"state_dict": targets})
    assert all(torch.equal(t, torch.full_like(t, 7)) for t in targets.values())
