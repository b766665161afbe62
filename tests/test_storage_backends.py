"""A third storage backend is one new module, and needs no code in this package: any fsspec
filesystem is a backend, reached through the same seam as S3 (``storage.locate``).

* fsspec's in-memory filesystem (``memory://``): a 1-rank Trainer saves
  ``ModelCheckpoint``'s checkpoints there, ``fit(ckpt_path="last")`` resumes from them bit
  for bit, and the offline tools (inspect, verify, consolidate, export) read them and write
  their outputs there.
* :class:`DictObjectStore`, defined below and registered through fsspec's public hook
  (``fsspec.register_implementation``): a plain dict with an object store's semantics (no
  directories, an object appears whole when its upload completes, nothing renamed in
  place). The same fit, resume and ``inspect --verify`` go through it.

Both filesystems live in one process: each test runs in one rank's process
(``run_distributed``, one rank), which reports what it saw.

A user's own DCP ``StorageWriter``/``StorageReader`` pair plugs in through the plugin's
factories instead (Lightning's #20205): the plugin's commit stays around it.
"""

from __future__ import annotations

import io
import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
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


class _DictObject(fsspec.spec.AbstractBufferedFile):
    """An object of :class:`DictObjectStore`: ranged reads; a write appears whole at close."""

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self.fs.cat_file(self.path, start, end)

    def _initiate_upload(self) -> None:
        self.parts: list[bytes] = []

    def _upload_chunk(self, final: bool = False) -> bool:
        self.parts.append(self.buffer.getvalue())
        if final:
            self.fs.objects[self.path] = b"".join(self.parts)
        return True


class DictObjectStore(fsspec.AbstractFileSystem):
    """A third backend, one class: objects in a plain dict under ``dictstore://``. Keys are
    full paths; a "directory" is only a common prefix of keys, as on S3."""

    protocol = "dictstore"
    root_marker = ""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.objects: dict[str, bytes] = {}

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path).rstrip("/")
        if path in self.objects:
            return {"name": path, "size": len(self.objects[path]), "type": "file"}
        if path == "" or any(k.startswith(path + "/") for k in self.objects):
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        path = self._strip_protocol(path).rstrip("/")
        if path in self.objects:
            entries = [self.info(path)]
        else:
            prefix = f"{path}/" if path else ""
            children = {
                k[len(prefix) :].split("/")[0] for k in self.objects if k.startswith(prefix)
            }
            entries = [self.info(f"{prefix}{child}") for child in sorted(children)]
            if not entries:
                raise FileNotFoundError(path)
        return entries if detail else [e["name"] for e in entries]

    def cat_file(
        self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any
    ) -> bytes:
        path = self._strip_protocol(path)
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path][start:end]

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self.objects[self._strip_protocol(path)] = bytes(value)

    def cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        self.pipe_file(path2, self.cat_file(path1))

    def rm_file(self, path: str) -> None:
        if self.objects.pop(self._strip_protocol(path), None) is None:
            raise FileNotFoundError(path)

    def rm(self, path: Any, recursive: bool = False, maxdepth: int | None = None) -> None:
        for one in [path] if isinstance(path, str) else path:
            one = self._strip_protocol(one).rstrip("/")
            for key in [
                k for k in self.objects if k == one or (recursive and k.startswith(one + "/"))
            ]:
                del self.objects[key]

    def mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        """Nothing: a prefix appears with its first object."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """Nothing: a prefix appears with its first object."""

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        return _DictObject(self, path, mode, block_size or "default", **kwargs)


def _fit_and_resume(dirpath: str, **plugin: Any) -> dict[str, Any]:
    """A reference run of :data:`TOTAL_STEPS`; a run checkpointing into ``dirpath`` up to
    :data:`SAVED_STEP`; a run resuming from its ``"last"``: what each saw."""
    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    reference = make_trainer(
        1, max_steps=TOTAL_STEPS, callbacks=[BatchCounter()], enable_checkpointing=False
    )
    reference.fit(model, token_loader(1))
    result: dict[str, Any] = {"reference": {**snapshot(reference, model), "losses": model.losses}}
    pl.seed_everything(0, verbose=False)
    model = CheckpointedLM()
    trainer = _trainer(dirpath, SAVED_STEP, [BatchCounter(), Probe()], **plugin)
    trainer.fit(model, token_loader(1))
    result["saved"] = snapshot(trainer, model)
    pl.seed_everything(0, verbose=False)
    model, probe = CheckpointedLM(), Probe()
    trainer = _trainer(dirpath, TOTAL_STEPS, [BatchCounter(), probe], **plugin)
    trainer.fit(model, token_loader(1), ckpt_path="last")
    result["resumed"] = {
        "start": probe.train_start,
        "final": snapshot(trainer, model),
        "losses": model.losses,
        "ckpt_path": trainer.ckpt_path,
    }
    return result


def _assert_resumed_exactly(run: dict[str, Any]) -> None:
    reference, saved, resumed = run["reference"], run["saved"], run["resumed"]
    assert (resumed["start"]["epoch"], resumed["start"]["global_step"]) == (2, SAVED_STEP)
    assert_same(resumed["start"], saved, "restored")
    assert len(resumed["losses"]) == (TOTAL_STEPS - SAVED_STEP) * ACCUMULATE
    assert resumed["losses"] == reference["losses"][SAVED_STEP * ACCUMULATE :]
    assert_same(resumed["final"], {k: v for k, v in reference.items() if k in saved}, "end")


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


def _assert_one_version_each(objects: list[str]) -> None:
    """Versioned saves on the store: each checkpoint of both runs holds one complete
    version (manifest.json in it) and nothing else; last.ckpt's older versions were
    retired."""
    manifests = [o.split("/")[-3:-1] for o in objects if o.endswith("/manifest.json")]
    names = [name for name, _ in manifests]
    assert names == [
        "epoch=0-step=2.ckpt",
        "epoch=1-step=4.ckpt",
        "epoch=2-step=4.ckpt",  # the resumed run's first save (Lightning's epoch count)
        "epoch=2-step=6.ckpt",
        "epoch=3-step=8.ckpt",
        "last.ckpt",
    ], manifests
    assert manifests[-1][1].startswith("v00000005-"), manifests
    assert all(o.split("/")[-2] in {v for _, v in manifests} for o in objects)


def _fit_resume_and_tools(rank: int, world_size: int, local: str) -> dict[str, Any]:
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
    result = _fit_and_resume(url)
    result["objects"] = sorted(memory.find(url.removeprefix("memory:/")))
    result["local_memory_dir"] = any(Path(p).exists() for p in ("memory:", "./memory:"))

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
    _assert_one_version_each(run["objects"])

    assert run["resumed"]["ckpt_path"].startswith("memory://")
    assert run["resumed"]["ckpt_path"].endswith("/checkpoints/last.ckpt")
    _assert_resumed_exactly(run)

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
    result = _fit_and_resume(dirpath, **factories)
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
    _assert_resumed_exactly(run)
    assert (tmp_path / "checkpoints" / "last.ckpt" / "manifest.json").is_file()


def _fit_resume_and_verify_through_a_dict(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_megatron_fsdp.tools.cli import main

    fsspec.register_implementation("dictstore", DictObjectStore, clobber=True)
    url = f"dictstore://bucket/lmf-{uuid.uuid4().hex[:8]}/checkpoints"
    result = _fit_and_resume(url)
    store = fsspec.filesystem("dictstore")
    result["objects"] = sorted(store.objects)
    result["cli_verify"] = main(["inspect", "--verify", f"{url}/last.ckpt"])
    return result


def test_a_third_backend_is_one_module(tmp_path: Path) -> None:
    """:class:`DictObjectStore` (a dict, registered with fsspec, no code in the package):
    a 1-rank fit checkpoints into it, resumes from ``"last"`` bit for bit, and
    ``inspect --verify`` passes on what it holds."""
    (run,) = run_distributed(
        _fit_resume_and_verify_through_a_dict, 1, init_process_group=False, timeout=TIMEOUT
    )
    assert run["resumed"]["ckpt_path"].startswith("dictstore://")
    _assert_resumed_exactly(run)
    _assert_one_version_each(run["objects"])
    assert run["cli_verify"] == 0
