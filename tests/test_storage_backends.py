"""A third storage backend needs no code outside ``storage/``: fsspec's in-memory filesystem
(``memory://``) goes through the same seam as S3 (``storage.locate``), so a 1-rank Trainer
saves ``ModelCheckpoint``'s checkpoints there, ``fit(ckpt_path="last")`` resumes from them
bit for bit, and the offline tools (inspect, verify, consolidate, export) read them and
write their outputs there.

The memory filesystem lives in one process: the whole test runs in one rank's process
(``run_distributed``, one rank), which reports what it saw.

A user's own DCP ``StorageWriter``/``StorageReader`` pair plugs in through the plugin's
factories instead (Lightning's #20205): the plugin's commit stays around it.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron_fsdp import MegatronFSDPCheckpointIO, MegatronFSDPStrategy
from lightning_megatron_fsdp.errors import NotACheckpointError
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock
from tests.test_trainer_checkpointing import (
    ACCUMULATE,
    SAVED_STEP,
    TOTAL_STEPS,
    BatchCounter,
    CheckpointedLM,
    MemoryLogger,
    Probe,
    assert_same,
    make_trainer,
    snapshot,
    token_loader,
)

TIMEOUT = 300.0


def _trainer(url: str, max_steps: int, callbacks: list[Any], **plugin: Any) -> pl.Trainer:
    strategy = MegatronFSDPStrategy(
        auto_wrap_policy={PackedBlock},
        timeout=PROCESS_GROUP_TIMEOUT,
        checkpoint_io=MegatronFSDPCheckpointIO(**plugin),
    )
    checkpoints = ModelCheckpoint(dirpath=url, every_n_train_steps=2, save_top_k=-1, save_last=True)
    return make_trainer(
        1,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=[*callbacks, checkpoints],
        logger=MemoryLogger(),
    )


def _fit_save_and_resume(
    url: str, after_save: Callable[[dict[str, Any]], None] = lambda result: None, **plugin: Any
) -> dict[str, Any]:
    """An uninterrupted reference run; a run saving into ``url`` to ``SAVED_STEP`` (then
    ``after_save(result)``); and a run resumed from ``"last"`` there to the end (the
    plugin built with ``plugin`` each time)."""
    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    reference = make_trainer(
        1, max_steps=TOTAL_STEPS, callbacks=[BatchCounter()], enable_checkpointing=False
    )
    reference.fit(model, token_loader(1))
    result: dict[str, Any] = {"reference": {**snapshot(reference, model), "losses": model.losses}}

    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    trainer = _trainer(url, SAVED_STEP, [BatchCounter(), Probe()], **plugin)
    trainer.fit(model, token_loader(1))
    result["saved"] = snapshot(trainer, model)
    after_save(result)

    pl.seed_everything(0, verbose=False)
    model, probe = CheckpointedLM(), Probe()
    trainer = _trainer(url, TOTAL_STEPS, [BatchCounter(), probe], **plugin)
    trainer.fit(model, token_loader(1), ckpt_path="last")
    result["resumed"] = {
        "start": probe.train_start,
        "final": snapshot(trainer, model),
        "losses": model.losses,
        "ckpt_path": trainer.ckpt_path,
    }
    return result


def _assert_resumed_bit_exactly(run: dict[str, Any]) -> None:
    """The resumed run restored the saved state at ``SAVED_STEP`` and ended, step for step,
    where the uninterrupted run did."""
    reference, saved, resumed = run["reference"], run["saved"], run["resumed"]
    assert (resumed["start"]["epoch"], resumed["start"]["global_step"]) == (2, SAVED_STEP)
    assert_same(resumed["start"], saved, "restored")
    assert len(resumed["losses"]) == (TOTAL_STEPS - SAVED_STEP) * ACCUMULATE
    assert resumed["losses"] == reference["losses"][SAVED_STEP * ACCUMULATE :]
    assert_same(resumed["final"], {k: v for k, v in reference.items() if k in saved}, "end")


def _fit_resume_and_tools(rank: int, world_size: int, local: str) -> dict[str, Any]:
    import fsspec

    from lightning_megatron_fsdp.tools import (
        consolidate_checkpoint,
        export_lightning_checkpoint,
        inspect_checkpoint,
        verify_checkpoint,
    )
    from lightning_megatron_fsdp.tools.cli import main

    run = f"memory://lmf-{uuid.uuid4().hex[:8]}"
    url = f"{run}/checkpoints"
    memory = fsspec.filesystem("memory")

    def list_objects(result: dict[str, Any]) -> None:
        result["objects"] = sorted(memory.find(url.removeprefix("memory:/")))
        result["local_memory_dir"] = any(Path(p).exists() for p in ("memory:", "./memory:"))

    result = _fit_save_and_resume(url, list_objects)

    # The tools, on the checkpoint the resumed run left (step 8) and on its prefix.
    last = f"{url}/last.ckpt"
    info = inspect_checkpoint(last)
    result["inspected"] = {
        "step": None if info.manifest is None else info.manifest.global_step,
        "tensors": sorted(t.key for t in info.tensors),
        "model": sorted(
            t.key.removeprefix("state_dict.")
            for t in info.tensors
            if t.key.startswith("state_dict.lm.")
        ),
        "notes": list(info.notes),
    }
    result["problems"] = verify_checkpoint(last)
    try:
        inspect_checkpoint(url)
    except NotACheckpointError as err:
        result["prefix_error"] = str(err)
    result["cli_verify"] = main(["inspect", "--verify", last])
    result["consolidated"] = consolidate_checkpoint(last, f"{run}/out/model.pt")
    consolidate_checkpoint(last, os.path.join(local, "model.pt"))
    result["consolidated_bytes"] = memory.cat_file(f"{run.removeprefix('memory:/')}/out/model.pt")
    result["exported"] = export_lightning_checkpoint(last, f"{run}/out/model.ckpt")
    export_lightning_checkpoint(last, os.path.join(local, "model.ckpt"))
    result["exported_bytes"] = memory.cat_file(f"{run.removeprefix('memory:/')}/out/model.ckpt")
    try:
        consolidate_checkpoint(last, f"{last}/inside.pt")
    except ValueError as err:
        result["inside_error"] = str(err)
    return result


def test_memory_backend_through_the_trainer_and_the_tools(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    (run,) = run_distributed(
        _fit_resume_and_tools, 1, str(tmp_path), init_process_group=False, timeout=TIMEOUT
    )
    assert not run["local_memory_dir"]  # a URL is never a local directory named "memory:"
    # Versioned saves on the store: manifest.json in each checkpoint's one version.
    manifests = [o for o in run["objects"] if o.endswith("/manifest.json")]
    assert len(manifests) == 3, run["objects"]  # epoch=0-step=2, epoch=1-step=4, last

    ckpt_path = run["resumed"]["ckpt_path"]
    assert ckpt_path.startswith("memory://") and ckpt_path.endswith("/checkpoints/last.ckpt")
    _assert_resumed_bit_exactly(run)

    assert run["inspected"]["step"] == TOTAL_STEPS
    assert run["inspected"]["tensors"], "no tensor inspected"
    assert any("complete (the one loaded)" in n for n in run["inspected"]["notes"])
    assert run["problems"] == []
    assert (
        "is a prefix of checkpoints" in run["prefix_error"] and "step=2.ckpt" in run["prefix_error"]
    )
    assert run["cli_verify"] == 0
    assert "lies inside the checkpoint" in run["inside_error"]

    # The outputs on the memory store are byte for byte the local exports.
    assert run["consolidated"].startswith("memory://") and run["exported"].startswith("memory://")
    assert run["consolidated_bytes"] == (tmp_path / "model.pt").read_bytes()
    assert run["exported_bytes"] == (tmp_path / "model.ckpt").read_bytes()
    weights = torch.load(io.BytesIO(run["consolidated_bytes"]), weights_only=True)
    assert set(weights) >= set(run["inspected"]["model"]) > set()


def _fit_and_resume_through_user_storage(
    rank: int, world_size: int, dirpath: str
) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    made: list[str] = []

    def writer(staging: Any) -> FileSystemWriter:
        made.append(f"writer {type(staging).__name__}")
        return FileSystemWriter(staging)

    def reader(location: Any) -> FileSystemReader:
        made.append(f"reader {type(location).__name__}")
        return FileSystemReader(location)

    factories = {"storage_writer_factory": writer, "storage_reader_factory": reader}
    result = _fit_save_and_resume(dirpath, **factories)
    result["made"] = sorted(set(made))
    return result


def test_a_user_storage_writer_and_reader_through_the_plugin_factories(tmp_path: Path) -> None:
    """Lightning's ask for a user's own DCP ``StorageWriter``/``StorageReader`` under the
    Trainer (#20205): torch's plain pair, handed to the plugin's factories, saves every
    checkpoint the plugin commits and resumes from ``"last"`` bit for bit."""
    (run,) = run_distributed(
        _fit_and_resume_through_user_storage,
        1,
        str(tmp_path / "checkpoints"),
        init_process_group=False,
        timeout=TIMEOUT,
    )
    assert run["made"] == ["reader PosixPath", "writer PosixPath"], run["made"]
    _assert_resumed_bit_exactly(run)
    assert (tmp_path / "checkpoints" / "last.ckpt" / "manifest.json").is_file()
