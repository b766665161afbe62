"""Offline export: consolidate, inspect and verify real multi-rank checkpoints, no process group.

Each checkpoint is written by real ranks (tests/harness.py, gloo) training the shared
:class:`~tests.models.PackedLM` (tied embedding/head, packing that defeats canonical
``Shard(0)``, a 3-D parameter) plus two buffers (fp32 and a 0-dim int64), and saved by the
real writer, ``MegatronFSDPCheckpointIO``. The pytest process then consolidates it with
no process group and checks, bit for bit:

* every exported tensor against a reference assembled from the ranks' own local shards
  and chunk offsets (independent of DCP's read path), ties under both FQNs;
* a plain unsharded model that loads the file reproduces the sharded model's logits
  (and did not before loading: the target starts at zero);
* ``--dtype`` casts exactly the floating model tensors; ``--optimizer`` exports Adam state;
* the console script: consolidate, inspect, inspect --json, and inspect --verify on a
  good checkpoint and on a flipped byte, a truncated and a deleted shard file (two runs
  as real subprocesses, the rest through the same ``main`` in-process);
* verify and consolidate catch chunk gaps and overlaps in ``.metadata`` itself;
* bad input is refused with an error naming the file, and nothing is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import crc32c as crc32c_package
import lightning
import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    chunk_metadata_by_fqn,
    enable_cpu_execution,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.storage.format import DCP_METADATA_FILE
from lightning_megatron_fsdp.tools.cli import main
from lightning_megatron_fsdp.tools.export import consolidate_checkpoint
from lightning_megatron_fsdp.tools.inspection import inspect_checkpoint, verify_checkpoint
from tests.harness import THIRD_PARTY_WARNINGS, run_distributed, spawned
from tests.legacy_format import downgrade_to_format_1
from tests.models import (
    PackedLM,
    build_packed_lm,
    dp_mesh,
    lm_loss,
    make_batch,
    shard_packed_lm,
    sharded_adam,
)

STEPS = 2
EPOCH = 1
LR = 0.05
EVAL_SEED = 99


# ---------------------------------------------------------------------------------------
# Writing checkpoints on real ranks
# ---------------------------------------------------------------------------------------


def _add_buffers(model: PackedLM) -> PackedLM:
    """A float and a 0-dim integer buffer: plain (unsharded) tensors in the state dict."""
    model.register_buffer("scale", torch.tensor([1.5, -2.0, 0.25]))
    model.register_buffer("shift", torch.tensor(3, dtype=torch.int64))
    return model


def _write_checkpoint(
    directory: Path, model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> None:
    """Save through the real writer, ``MegatronFSDPCheckpointIO``, as the strategy does."""
    model_sd = get_model_state_dict(model)
    optimizer_sds = [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers]
    for optimizer_sd in optimizer_sds:
        attach_uneven_dtensor_metadata(model, model_sd, optimizer_sd)
    checkpoint = {
        "state_dict": model_sd,
        "optimizer_states": optimizer_sds,
        "epoch": EPOCH,
        "global_step": STEPS,
        "pytorch-lightning_version": lightning.__version__,
        "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": EPOCH}}}},
        "hyper_parameters": {"lr": LR},
    }
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, directory)


def _train_and_save(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Train a sharded PackedLM for STEPS Adam steps, save it, return references.

    Returns:
        ``logits`` of the sharded model on a fixed batch, and ``shards``: this rank's local
        shard of every model tensor and Adam state tensor, with its dim-0 row offset, keyed
        by DCP key (plain tensors, which every rank holds whole, at offset 0).
    """
    enable_cpu_execution()
    model = shard_packed_lm(_add_buffers(build_packed_lm(seed=0)), dp_mesh(world_size))
    optimizer = sharded_adam(model, lr=LR)
    for step in range(STEPS):
        lm_loss(model, make_batch(step)).backward()
        optimizer.step()
        optimizer.zero_grad()
    _write_checkpoint(Path(directory), model, [optimizer])

    chunks = chunk_metadata_by_fqn(model)
    shards: dict[str, tuple[int | None, np.ndarray]] = {}

    def add(key: str, fqn: str, tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):  # this rank's rows, at the chunk's row offset
            shards[key] = (chunks[fqn].offsets[0], tensor._local_tensor.detach().numpy().copy())
        else:  # a plain tensor every rank holds whole (buffers, Adam's step)
            shards[key] = (None, tensor.detach().numpy().copy())

    for fqn, tensor in get_model_state_dict(model).items():
        add(f"state_dict.{fqn}", fqn, tensor)
    for fqn, state in get_optimizer_state_dict(model, optimizer)["state"].items():
        for name, tensor in state.items():
            add(f"optimizer_states.0.state.{fqn}.{name}", fqn, tensor)
    with torch.no_grad():
        logits = model(make_batch(EVAL_SEED)[0])
    return {"logits": logits.numpy().copy(), "shards": shards}


def _assemble(
    results: list[dict[str, Any]], shapes: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's local shards, each row written by exactly one rank."""
    full: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        pieces = [r["shards"][key] for r in results]
        if pieces[0][0] is None:
            assert all(np.array_equal(p[1], pieces[0][1]) for p in pieces), key
            full[key] = torch.from_numpy(pieces[0][1])
            continue
        tensor = torch.from_numpy(np.zeros(shape, dtype=pieces[0][1].dtype))
        writes = torch.zeros(shape[0], dtype=torch.int64)
        for offset, local in pieces:
            tensor[offset : offset + local.shape[0]] = torch.from_numpy(local)
            writes[offset : offset + local.shape[0]] += 1
        assert torch.equal(writes, torch.ones_like(writes)), f"{key}: row writes {writes}"
        full[key] = tensor
    return full


_SAVED: dict[int, dict[str, Any]] = {}


def _saved(world_size: int, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A real checkpoint saved by ``world_size`` ranks and its references (once per run)."""
    if world_size not in _SAVED:
        directory = tmp_path_factory.mktemp(f"export_ws{world_size}") / "checkpoint"
        results = run_distributed(_train_and_save, world_size, str(directory), timeout=180)
        shapes = {key: tuple(v.size) for key, v in _tensor_metadata(directory).items()}
        _SAVED[world_size] = {
            "dir": directory,
            "world_size": world_size,
            "logits": torch.from_numpy(results[0]["logits"]),
            "reference": _assemble(results, shapes),
        }
    return _SAVED[world_size]


@pytest.fixture(params=[2, 3], ids=lambda ws: f"ws{ws}")
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoint of each world size whose layout differs (2 and 3 ranks)."""
    return _saved(request.param, tmp_path_factory)


@pytest.fixture
def saved2(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _saved(2, tmp_path_factory)


@pytest.fixture
def saved3(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _saved(3, tmp_path_factory)


def _tensor_metadata(directory: Path) -> dict[str, Any]:
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}


# ---------------------------------------------------------------------------------------
# Helpers for the pytest process
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Compute on one thread, as the ranks did, so kernels and reduction order match."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _plain_logits(state_dict: dict[str, torch.Tensor] | None) -> torch.Tensor:
    """Logits of an unsharded, all-zero PackedLM after ``load_state_dict(state_dict)``."""
    model = _add_buffers(build_packed_lm(seed=None))
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    with _one_thread(), torch.no_grad():
        return model(make_batch(EVAL_SEED)[0])


def _load(path: Path) -> dict[str, Any]:
    if path.suffix == ".safetensors":
        return safetensors.torch.load_file(path)
    return torch.load(path, weights_only=True)


def _listing(*directories: Path) -> dict[Path, list[str]]:
    return {d: sorted(os.listdir(d)) for d in directories}


def _copy(source: Path, destination: Path, mutate: Callable[[Path], None]) -> Path:
    shutil.copytree(source, destination)
    mutate(destination)
    return destination


def _shard_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".distcp"))


def _flip_byte(directory: Path) -> None:
    file = directory / _shard_files(directory)[0]
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def _truncate(directory: Path) -> None:
    file = directory / _shard_files(directory)[-1]
    file.write_bytes(file.read_bytes()[:-100])


def _delete_shard(directory: Path) -> None:
    (directory / _shard_files(directory)[1]).unlink()


def _rewrite_metadata(directory: Path, edit: Callable[[Metadata], None]) -> None:
    """Edit ``.metadata`` and re-record it in the manifest, so only ``edit`` is wrong."""
    file = directory / ".metadata"
    metadata = pickle.loads(file.read_bytes())
    edit(metadata)
    file.write_bytes(pickle.dumps(metadata))
    manifest = json.loads((directory / "manifest.json").read_text())
    data = file.read_bytes()
    manifest["files"][".metadata"] = {
        "size": len(data),
        "crc32c": f"{crc32c_package.crc32c(data):08x}",
    }
    (directory / "manifest.json").write_text(json.dumps(manifest))


def _split_tensor(metadata: Metadata) -> str:
    """The DCP key of a model tensor saved in more than one chunk."""
    return next(
        k
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("state_dict.") and len(getattr(v, "chunks", ())) > 1
    )


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


@pytest.mark.both_versions
def test_consolidated_file_reproduces_sharded_model(saved: dict, tmp_path: Path) -> None:
    """.pt and .safetensors: every tensor bit-exact, ties under both FQNs, same logits."""
    info = inspect_checkpoint(saved["dir"])
    assert max(t.chunks for t in info.tensors) > 1, "no tensor is split: the test is vacuous"
    reference = saved["reference"]
    zero_logits = _plain_logits(None)
    assert not torch.equal(zero_logits, saved["logits"]), "zero model already matches"
    expected_keys = set(_add_buffers(build_packed_lm(seed=None)).state_dict())
    assert "head.weight" in expected_keys and "embed.weight" in expected_keys

    for suffix in (".pt", ".safetensors"):
        output = tmp_path / f"model{suffix}"
        assert not dist.is_initialized()
        assert consolidate_checkpoint(saved["dir"], output) == output
        assert not dist.is_initialized(), "consolidation must not start a process group"
        state_dict = _load(output)
        assert set(state_dict) == expected_keys, suffix
        for fqn, tensor in state_dict.items():
            torch.testing.assert_close(
                tensor, reference[f"state_dict.{fqn}"], rtol=0, atol=0, msg=f"{suffix} {fqn}"
            )
        assert state_dict["shift"].dtype == torch.int64 and state_dict["shift"].dim() == 0
        torch.testing.assert_close(
            state_dict["head.weight"], state_dict["embed.weight"], rtol=0, atol=0
        )
        torch.testing.assert_close(_plain_logits(state_dict), saved["logits"], rtol=0, atol=0)
        if suffix == ".pt":
            with zipfile.ZipFile(output) as archive:
                assert archive.testzip() is None, "a zip record has a wrong CRC-32"
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.safetensors"], "temp file left"


def test_dtype_cast_and_optimizer_export(saved3: dict, tmp_path: Path) -> None:
    """--dtype casts floating model tensors only; --optimizer adds Adam state, uncast."""
    saved = saved3
    reference = saved["reference"]
    for suffix, dtype in ((".safetensors", "bf16"), (".pt", torch.float16)):
        output = tmp_path / f"export{suffix}"
        consolidate_checkpoint(saved["dir"], output, dtype, include_optimizer=True)
        state_dict = _load(output)
        cast = torch.bfloat16 if dtype == "bf16" else torch.float16
        optimizer_keys = [k for k in state_dict if k.startswith("optimizer_states.0.state.")]
        assert {k.rsplit(".", 1)[1] for k in optimizer_keys} == {"exp_avg", "exp_avg_sq", "step"}
        for key, tensor in state_dict.items():
            if not isinstance(tensor, torch.Tensor):
                continue
            if key.startswith("optimizer_states.0.state."):
                expected = reference[key]
            else:
                expected = reference[f"state_dict.{key}"]
                if expected.is_floating_point():
                    expected = expected.to(cast)
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=key)
        assert state_dict["shift"].dtype == torch.int64
        assert state_dict["optimizer_states.0.state.embed.weight.step"].item() == STEPS
        if suffix == ".pt":
            assert state_dict["optimizer_states.0.param_groups.0.lr"] == LR
            params = state_dict["optimizer_states.0.param_groups.0.params"]
        else:
            with safetensors.safe_open(output, "pt") as handle:
                extra = handle.metadata()
            assert json.loads(extra["optimizer_states.0.param_groups.0.lr"]) == LR
            params = json.loads(extra["optimizer_states.0.param_groups.0.params"])
        assert "embed.weight" in params and "head.weight" not in params  # the tie, once


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """Run the console script's ``main`` in this process; (exit status, stdout, stderr)."""
    capsys.readouterr()
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_console_script(saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """consolidate, inspect, inspect --json, inspect --verify (good and corrupted), errors.

    Two runs are real processes, started at once: the installed ``lightning-megatron-fsdp``
    entry point and ``python -m lightning_megatron_fsdp.tools.cli`` (exit status through the OS).
    The rest call the same ``main`` in-process: a process costs seconds of import time.
    """
    good = saved2["dir"]
    flipped = _copy(good, tmp_path / "flipped", _flip_byte)
    truncated = _copy(good, tmp_path / "truncated", _truncate)
    deleted = _copy(good, tmp_path / "deleted", _delete_shard)
    partial = _copy(good, tmp_path / "partial", lambda d: (d / "manifest.json").unlink())
    script = Path(sys.executable).with_name("lightning-megatron-fsdp")
    assert script.is_file(), f"console script missing at {script}: run `pip install -e .`"
    cli_out = tmp_path / "cli.safetensors"
    env = {**os.environ, "PYTHONWARNINGS": THIRD_PARTY_WARNINGS}
    commands = {
        "script": [str(script), "consolidate", str(good), str(cli_out), "--dtype", "bf16"],
        "module": [
            sys.executable,
            "-m",
            "lightning_megatron_fsdp.tools.cli",
            "inspect",
            "--verify",
            str(flipped),
        ],
    }
    # Both commands die with this test if a check below fails before they are waited for.
    with contextlib.ExitStack() as running:
        processes = {
            name: running.enter_context(spawned(command, env=env))
            for name, command in commands.items()
        }

        metadata = _tensor_metadata(good)
        status, out, err = _main(capsys, "inspect", str(good))
        assert status == 0, err
        for key, md in metadata.items():
            dtype = str(md.properties.dtype).removeprefix("torch.")
            shape = re.escape(str(tuple(md.size)))
            row = rf"^{re.escape(key)} +{shape} +{dtype} +{len(md.chunks)}$"
            assert re.search(row, out, re.MULTILINE), f"no row {row!r} in:\n{out}"
        assert re.search(rf"^global_step +{STEPS}$", out, re.MULTILINE), out
        assert re.search(rf"^epoch +{EPOCH}$", out, re.MULTILINE), out
        assert f"lightning {lightning.__version__}" in out

        status, out, err = _main(capsys, "inspect", "--json", str(good))
        assert status == 0, err
        data = json.loads(out)
        assert (data["global_step"], data["epoch"], data["world_size"]) == (STEPS, EPOCH, 2)
        model_sd = _add_buffers(build_packed_lm(None)).state_dict()
        by_key = {t["key"]: t for t in data["tensors"]}
        for fqn, tensor in model_sd.items():
            entry = by_key[f"state_dict.{fqn}"]
            assert entry["shape"] == list(tensor.shape), fqn
            assert entry["dtype"] == str(tensor.dtype).removeprefix("torch."), fqn
            assert entry["chunks"] == len(metadata[f"state_dict.{fqn}"].chunks), fqn
        assert data["meta"]["pytorch-lightning_version"] == lightning.__version__
        assert "verify" not in data

        status, out, err = _main(capsys, "inspect", "--verify", str(good))
        assert status == 0 and "verify: OK" in out, out + err
        status, out, err = _main(capsys, "inspect", "--verify", "--json", str(truncated))
        verdict = json.loads(out)["verify"]
        file = _shard_files(good)[-1]
        assert status == 1 and not verdict["ok"], out
        assert any(re.match(rf"{file}: \d+ bytes on disk", p) for p in verdict["problems"]), out
        status, out, err = _main(capsys, "inspect", "--verify", str(deleted))
        assert status == 1 and f"{_shard_files(good)[1]}: missing" in out, out

        status, out, err = _main(capsys, "consolidate", str(partial), str(tmp_path / "partial.pt"))
        assert status == 1 and "no manifest.json" in err and "Nothing was written" in err, err
        assert not (tmp_path / "partial.pt").exists()
        status, out, err = _main(capsys, "consolidate", str(good), str(cli_out.with_suffix(".pt")))
        assert status == 0 and "wrote" in out, err
        status, out, err = _main(capsys, "consolidate", str(good), str(cli_out.with_suffix(".pt")))
        assert status == 1 and "already exists" in err and "--overwrite" in err, err
        with pytest.raises(SystemExit) as usage:
            main(["consolidate", str(good), str(cli_out), "--dtype", "int8"])
        assert usage.value.code == 2

        results = {name: (p.wait(timeout=120), *p.communicate()) for name, p in processes.items()}
    status, out, err = results["script"]
    assert status == 0, err
    api_out = consolidate_checkpoint(good, tmp_path / "api.safetensors", torch.bfloat16)
    assert cli_out.read_bytes() == api_out.read_bytes()
    status, out, err = results["module"]
    file = _shard_files(good)[0]
    assert status == 1 and "verify: FAILED" in out and f"{file}: crc32c " in out, out + err


def test_bad_input_is_refused_and_nothing_is_written(saved3: dict, tmp_path: Path) -> None:
    """Partial or corrupt checkpoints, existing outputs and bad options: clear errors."""
    good = saved3["dir"]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a checkpoint")
    split_key = _split_tensor(dcp.FileSystemReader(str(good)).read_metadata())

    def drop_chunk(md: Metadata) -> None:
        md.state_dict_metadata[split_key].chunks.pop()

    def duplicate_chunk(md: Metadata) -> None:
        chunks = md.state_dict_metadata[split_key].chunks
        chunks[1] = chunks[0]

    corrupted = CheckpointCorruptedError
    cases = {
        "empty": (empty, NotACheckpointError, r"empty has no manifest\.json: not a checkpoint"),
        "no_manifest": (
            _copy(good, tmp_path / "a", lambda d: (d / "manifest.json").unlink()),
            NotACheckpointError,
            r"a holds DCP files but no manifest\.json: the save did not finish",
        ),
        "no_metadata": (
            _copy(good, tmp_path / "b", lambda d: (d / ".metadata").unlink()),
            corrupted,
            r"\.metadata: missing \(expected \d+ bytes\)",
        ),
        "deleted": (
            _copy(good, tmp_path / "c", _delete_shard),
            corrupted,
            r"__1_0\.distcp: missing \(expected \d+ bytes\)",
        ),
        "truncated": (
            _copy(good, tmp_path / "d", _truncate),
            corrupted,
            r"__2_0\.distcp: \d+ bytes on disk, \d+ in the manifest",
        ),
        "flipped": (
            _copy(good, tmp_path / "e", _flip_byte),
            corrupted,
            r"__0_0\.distcp: crc32c [0-9a-f]{8} on disk, [0-9a-f]{8} in the manifest",
        ),
        "gap": (
            _copy(good, tmp_path / "f", lambda d: _rewrite_metadata(d, drop_chunk)),
            corrupted,
            rf"tensor '{split_key}': chunks cover \d+ of its \d+ elements",
        ),
        "overlap": (
            _copy(good, tmp_path / "g", lambda d: _rewrite_metadata(d, duplicate_chunk)),
            corrupted,
            rf"tensor '{split_key}': chunks at .* overlap",
        ),
    }
    for name, (directory, error, pattern) in cases.items():
        before = _listing(directory, out_dir)
        problems = verify_checkpoint(directory)
        assert any(re.search(pattern, p) for p in problems), (name, problems)
        for suffix in (".pt", ".safetensors"):
            with pytest.raises(error, match=pattern):
                consolidate_checkpoint(directory, out_dir / f"{name}{suffix}")
        assert _listing(directory, out_dir) == before, f"{name}: something was written"

    partial = inspect_checkpoint(tmp_path / "a")  # inspect still describes a partial save
    assert any("no manifest.json" in note for note in partial.notes), partial.notes
    assert partial.global_step == STEPS  # from meta.pt, the manifest being gone
    with pytest.raises(CheckpointCorruptedError, match=r"\.metadata: missing"):
        inspect_checkpoint(tmp_path / "b")
    with pytest.raises(NotACheckpointError, match=r"empty has no manifest\.json"):
        inspect_checkpoint(empty)

    existing = out_dir / "model.safetensors"
    existing.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match=r"already exists; nothing was written.*overwrite"):
        consolidate_checkpoint(good, existing)
    assert existing.read_bytes() == b"keep me"
    consolidate_checkpoint(good, existing, overwrite=True)
    assert set(safetensors.torch.load_file(existing)) >= {"embed.weight", "head.weight"}

    with pytest.raises(ValueError, match=r"suffix '\.npz'; expected \.safetensors"):
        consolidate_checkpoint(good, out_dir / "model.npz")
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported"):
        consolidate_checkpoint(good, out_dir / "model.pt", "int8")
    with pytest.raises(ValueError, match=r"lies inside the checkpoint directory"):
        consolidate_checkpoint(good, good / "model.pt")
    with pytest.raises(FileNotFoundError, match=r"does not exist; create it first"):
        consolidate_checkpoint(good, out_dir / "missing" / "model.pt")
    assert sorted(os.listdir(out_dir)) == ["model.safetensors"]
    assert verify_checkpoint(good) == [], "the fixture checkpoint itself must verify clean"


def test_a_directory_of_checkpoints_is_named_once_with_its_checkpoints(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Pointing a tool at ``ModelCheckpoint``'s ``dirpath`` (or at an empty directory) gives
    one problem, naming the checkpoints inside, in ``inspect``, ``--verify``, the API and
    ``consolidate`` alike: no consequential "``.metadata``: missing" lines, no "1 problems"."""
    run = tmp_path / "checkpoints"
    run.mkdir()
    for name in ("last.ckpt", "step=4.ckpt"):
        shutil.copytree(saved2["dir"], run / name)
    (run / ".last.ckpt.tmp-0123abcd").mkdir()  # a save in progress is not offered
    empty = tmp_path / "empty"
    empty.mkdir()
    named = r"is a directory of checkpoints \(pass one of them: last\.ckpt; step=4\.ckpt\)"

    status, out, err = _main(capsys, "inspect", str(run))
    assert status == 1 and re.search(named, err), err
    with pytest.raises(NotACheckpointError, match=named):
        inspect_checkpoint(run)
    (problem,) = verify_checkpoint(run)
    assert re.search(named, problem), problem
    status, out, err = _main(capsys, "inspect", "--verify", str(run))
    assert status == 1 and out == "" and len(re.findall(named, err)) == 1, out + err
    status, out, err = _main(capsys, "consolidate", str(run), str(tmp_path / "x.pt"))
    assert status == 1 and len(re.findall(named, err)) == 1 and "Nothing was written" in err, err
    assert not (tmp_path / "x.pt").exists()
    flipped = _copy(saved2["dir"], tmp_path / "flipped", _flip_byte)
    status, out, err = _main(capsys, "consolidate", str(flipped), str(tmp_path / "x.pt"))
    assert status == 1 and "checkpoint (1 problem):\n" in err, err

    (problem,) = verify_checkpoint(empty)
    assert re.search(r"empty has no manifest\.json: not a checkpoint", problem), problem


def test_a_deleted_shard_file_is_one_problem(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its records are not also reported as "not plain torch.save zips" (with the
    ``ENOENT`` of opening the file that is already reported missing)."""
    deleted = _copy(saved2["dir"], tmp_path / "deleted", _delete_shard)
    (problem,) = verify_checkpoint(deleted)
    assert re.fullmatch(r"__1_0\.distcp: missing \(expected \d+ bytes\)", problem), problem
    status, out, _err = _main(capsys, "inspect", "--verify", str(deleted))
    assert status == 1 and "verify: FAILED, 1 problem:\n" in out and "Errno" not in out, out


def test_output_into_a_closed_pipe_is_quiet(saved2: dict) -> None:
    """``inspect CKPT | head`` : a reader that stops reading gets no "BrokenPipeError" line
    from the script and no traceback; the status is a SIGPIPE death's (141), not 1
    (which would read as "the checkpoint has problems")."""
    script = Path(sys.executable).with_name("lightning-megatron-fsdp")
    env = {**os.environ, "PYTHONWARNINGS": THIRD_PARTY_WARNINGS}
    for options in ([], ["--verify"], ["--json"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first line is written
        try:
            ran = subprocess.run(
                [str(script), "inspect", *options, str(saved2["dir"])],
                stdout=write_end,
                stderr=subprocess.PIPE,
                text=True,
                timeout=120,
                env=env,
            )
        finally:
            os.close(write_end)
        assert (ran.returncode, ran.stderr) == (141, ""), (options, ran.returncode, ran.stderr)


def test_an_output_directory_is_refused_as_one(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``consolidate CKPT out/`` says the output is a directory (as ``export-lightning``
    does), not that ``''`` is an unsupported suffix."""
    with pytest.raises(IsADirectoryError, match=r"output .* is a directory; expected a file"):
        consolidate_checkpoint(saved2["dir"], tmp_path)
    for command in ("consolidate", "export-lightning"):
        status, _out, err = _main(capsys, command, str(saved2["dir"]), str(tmp_path))
        assert status == 1 and "is a directory; expected a file path" in err, err
        assert "suffix" not in err, err


def test_a_truncated_index_or_meta_file_is_named_once(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect`` on a truncated ``meta.pt`` or ``.metadata``: one error naming the file
    once (its path), not ``meta.pt: <dir>/meta.pt: ...``."""
    for index, name in enumerate(("meta.pt", ".metadata")):
        damaged = _copy(saved2["dir"], tmp_path / f"damaged{index}", lambda d: None)
        with open(damaged / name, "r+b") as file:
            file.truncate(100)
        status, _out, err = _main(capsys, "inspect", str(damaged))
        assert status == 1 and f"{damaged / name}: 100 bytes on disk" in err, err
        assert err.count(name) == 1, err


def test_skip_checksums_without_verify_is_a_usage_error(
    saved2: dict, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect --skip-checksums`` alone checks nothing, so it is refused (status 2)
    naming ``--verify``, not silently ignored."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:
        main(["inspect", "--skip-checksums", str(saved2["dir"])])
    err = capsys.readouterr().err
    assert usage.value.code == 2 and "--skip-checksums only applies with --verify" in err, err
    status, out, err = _main(capsys, "inspect", "--verify", "--skip-checksums", str(saved2["dir"]))
    assert status == 0 and "verify: OK" in out, out + err


def test_verify_and_export_a_format_1_sha256_checkpoint(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpoints written before CRC32C (sha256 digests) verify and export as before."""
    legacy = _copy(saved2["dir"], tmp_path / "legacy", downgrade_to_format_1)
    assert json.loads((legacy / "manifest.json").read_text())["format_version"] == 1
    assert verify_checkpoint(legacy) == []
    status, out, err = _main(capsys, "inspect", "--verify", str(legacy))
    assert status == 0 and "verify: OK" in out, out + err
    exported = consolidate_checkpoint(legacy, tmp_path / "legacy.safetensors")
    fresh = consolidate_checkpoint(saved2["dir"], tmp_path / "fresh.safetensors")
    assert exported.read_bytes() == fresh.read_bytes()

    flipped = _copy(legacy, tmp_path / "legacy-flipped", _flip_byte)
    file = _shard_files(flipped)[0]
    pattern = rf"{file}: sha256 [0-9a-f]{{64}} on disk, [0-9a-f]{{64}} in the manifest"
    assert any(re.search(pattern, p) for p in verify_checkpoint(flipped))
    status, out, err = _main(capsys, "inspect", "--verify", str(flipped))
    assert status == 1 and f"{file}: sha256 " in out, out + err
    with pytest.raises(CheckpointCorruptedError, match=pattern):
        consolidate_checkpoint(flipped, tmp_path / "never.pt")
    assert not (tmp_path / "never.pt").exists()


def test_storage_problems_count_their_items_in_agreement() -> None:
    """``--verify``'s file findings say "1 item", "2 items" (not "1 items")."""
    from types import SimpleNamespace

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from lightning_megatron_fsdp.tools.inspection import _storage_problems

    def stored(*placed: tuple[str, str, int, int]) -> Any:
        return SimpleNamespace(
            storage_data={
                MetadataIndex(fqn): _StorageInfo(file, offset, length)
                for fqn, file, offset, length in placed
            }
        )

    one = _storage_problems(stored(("w", "a.distcp", 0, 100)), {"a.distcp": 50}, None)
    assert one == ["a.distcp: 1 item past its end (50 bytes; truncated): 'w' at bytes [0, 100)"]
    two = _storage_problems(
        stored(("w", "b.distcp", 0, 8), ("v", "b.distcp", 8, 8)), {"a.distcp": 50}, None
    )
    assert two == [f"b.distcp: missing; {DCP_METADATA_FILE} stores 2 items there: 'w'; 'v'"]
    lone = _storage_problems(stored(("w", "b.distcp", 0, 8)), {}, None)
    assert lone == [f"b.distcp: missing; {DCP_METADATA_FILE} stores 1 item there: 'w'"]


# ---------------------------------------------------------------------------------------
# The console script's papercuts: what it says on a damaged, missing or foreign input
# ---------------------------------------------------------------------------------------


def test_random_bytes_metadata_is_not_dcp_metadata_with_or_without_trust(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ``.metadata`` that is no pickle at all is "not DCP metadata": the allow-list did not
    refuse anything, so neither run suggests ``--trust-checkpoint``, which would not help."""

    def garble(directory: Path) -> None:
        (directory / "manifest.json").unlink()  # else its checksum catches the bytes first
        (directory / DCP_METADATA_FILE).write_bytes(np.random.default_rng(0).bytes(4096))

    garbled = _copy(saved2["dir"], tmp_path / "garbled", garble)
    for trust in ([], ["--trust-checkpoint"]):
        status, _out, err = _main(capsys, "inspect", *trust, str(garbled))
        assert status == 1 and ".metadata: not DCP metadata" in err, (trust, err)
        assert "refused" not in err and "--trust-checkpoint" not in err, (trust, err)


def test_plain_inspect_compares_file_sizes_with_the_manifest(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A truncated shard: plain ``inspect`` (which reads no tensor bytes) still prints the
    table, then says the file is damaged and to run ``--verify``, with exit status 1."""
    truncated = _copy(saved2["dir"], tmp_path / "truncated", _truncate)
    file = _shard_files(truncated)[-1]
    status, out, err = _main(capsys, "inspect", str(truncated))
    assert status == 1 and re.search(r"^global_step +\d+$", out, re.MULTILINE), out + err
    assert "damaged: run --verify" in err and re.search(rf"{file}: \d+ bytes on disk", err), err
    status, out, err = _main(capsys, "inspect", "--json", str(truncated))
    data = json.loads(out)
    assert status == 1 and any(p.startswith(f"{file}: ") for p in data["damaged"]), out
    status, out, err = _main(capsys, "inspect", "--json", str(saved2["dir"]))
    assert status == 0 and json.loads(out)["damaged"] == [], out + err


def test_verify_prints_its_verdict_before_the_table(
    saved2: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``inspect --verify`` says OK or FAILED on its first line, once, not after every row."""
    truncated = _copy(saved2["dir"], tmp_path / "truncated", _truncate)
    for directory, verdict in ((saved2["dir"], "verify: OK"), (truncated, "verify: FAILED")):
        _status, out, err = _main(capsys, "inspect", "--verify", str(directory))
        assert out.startswith(verdict) and out.count("verify:") == 1, out + err


def test_a_missing_path_is_one_line_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every command on a path that does not exist: one line naming it, no ``--verify``
    suggestion on it; with ``--json``, that error as JSON on stdout."""
    missing = str(tmp_path / "nope")
    for command in (
        ["inspect", missing],
        ["inspect", "--verify", missing],
        ["consolidate", missing, str(tmp_path / "w.pt")],
        ["export-lightning", missing, str(tmp_path / "m.ckpt")],
    ):
        status, out, err = _main(capsys, *command)
        assert status == 1 and out == "" and err.count("\n") == 1, (command, out, err)
        assert f"{missing} does not exist" in err and "--verify" not in err, (command, err)
    assert not list(tmp_path.iterdir()), "something was written"
    for options in ([], ["--verify"]):
        status, out, err = _main(capsys, "inspect", "--json", *options, missing)
        data = json.loads(out)
        assert status == 1 and err == "" and f"{missing} does not exist" in data["error"], out
