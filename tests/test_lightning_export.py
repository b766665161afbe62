"""Inference from our checkpoints: single-file Lightning export, prefix stripping, odd dtypes.

One real run: 2 ranks (``tests.harness``, gloo) train :class:`ExportLM` (``PackedLM`` with
its uneven packing and tied embedding/head, 3 blocks, plus persistent buffers of the
dtypes safetensors stores as U16/U32/U64/C64) with the real ``Trainer``,
``MegatronFSDPStrategy``, AdamW and a per-step ``StepLR``, and a ``LightningDataModule``
with hyper-parameters. ``ModelCheckpoint`` saves it twice, with and without optimizer
state. At ``on_train_end`` each rank records its shards, its Adam state, the scheduler
and the sharded model's logits on a probe batch.

The pytest process then, with no process group:

* exports a single-file Lightning checkpoint and loads it with
  ``ExportLM.load_from_checkpoint``, Lightning's own loader at its default
  ``weights_only``: the hyper-parameters rebuild the 3-block model (the class default is
  2), the weights and odd-dtype buffers are the shards assembled bit for bit, and the
  logits equal the sharded model's (``rtol=0, atol=0``); ``load_lightning_module`` takes
  the directory itself; ``TokenData.load_from_checkpoint`` restores the datamodule's;
* with ``optimizer=True`` a fresh single-device Lightning run resumes ``fit`` from the
  file: its Adam state, scheduler and step at ``on_train_start`` equal the sharded run's
  (checks the FQN -> position conversion), and it trains on;
* ``consolidate --strip-prefix lm.`` writes what a plain ``PackedLM.load_state_dict``
  takes as is;
* every refusal: directory to Lightning's loader, file or parent directory to ours,
  damaged checkpoints, bad options, the console script's exit codes.

A second 2-rank run loads our safetensors export, which holds U16/U32/U64/C64 tensors,
with ``load_full_weights``: into a model that needs them (bit-exact) and one that does not
(``strict=False``); a tensor of a dtype torch lacks is refused, naming it, only when
needed.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import (
    CheckpointCorruptedError,
    CheckpointError,
    MegatronFSDPStrategy,
    NotACheckpointError,
    consolidate_checkpoint,
    enable_cpu_execution,
    export_lightning_checkpoint,
    load_full_weights,
    load_lightning_module,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.strategies.strategy import fsdp_placements
from lightning_megatron_fsdp.tools.cli import main
from lightning_megatron_fsdp.tools.lightning_checkpoint import EXPORT_INFO_KEY
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import VOCAB, PackedBlock, adamw_step_lr, build_packed_lm, dp_mesh, lm_loss
from tests.test_export import _one_thread
from tests.test_portability import assemble, make_trainer, optimizer_shards

TIMEOUT = 240.0
ROWS = 16
SEQ = 5
BLOCKS = 3  # not ExportLM's default: only the saved hyper-parameters rebuild this model
LR = 0.02
ODD_BUFFERS = ("codes16", "codes32", "codes64", "phase")


# ---------------------------------------------------------------------- model and data


class ExportLM(pl.LightningModule):
    """``PackedLM`` with hyper-parameters, AdamW + per-step StepLR, odd-dtype buffers."""

    def __init__(self, lr: float = 0.05, num_blocks: int = 2, label: str = "default") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.lm = build_packed_lm(0, num_blocks=num_blocks)
        # Persistent buffers in every dtype safetensors writes as U16, U32, U64 and C64.
        self.register_buffer("codes16", torch.tensor([1, 65535, 7]).to(torch.uint16))
        self.register_buffer("codes32", torch.tensor([4_000_000_000, 3]).to(torch.uint32))
        self.register_buffer("codes64", torch.tensor([2**62 + 5, 9]).to(torch.uint64))
        self.register_buffer("phase", torch.tensor([1 + 2j, -0.5j], dtype=torch.complex64))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm(tokens)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return lm_loss(self.lm, (batch[0], batch[1]))

    def configure_optimizers(self) -> dict[str, Any]:
        return adamw_step_lr(self.parameters(), self.hparams.lr)


class TokenData(pl.LightningDataModule):
    """Token batches; its hyper-parameters travel in the checkpoint."""

    def __init__(self, batch_size: int = 4, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.hparams.seed)
        tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
        targets = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
        return DataLoader(TensorDataset(tokens, targets), batch_size=self.hparams.batch_size)


def probe_tokens() -> Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(11))


class AtTrainEnd(Callback):
    """This rank's shards, Adam state, scheduler, step and the sharded model's logits."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_megatron_fsdp import chunk_metadata_by_fqn

        chunks = chunk_metadata_by_fqn(pl_module)
        self.params = {
            name: (int(chunks[name].offsets[0]), p._local_tensor.detach().numpy().copy())
            for name, p in pl_module.named_parameters(remove_duplicate=False)
            if isinstance(p, DTensor)
        }
        # numpy: torch's pickling of uint16/32/64 storages cannot be read back.
        self.buffers = {n: b.detach().numpy().copy() for n, b in pl_module.named_buffers()}
        self.optimizer = optimizer_shards(pl_module, trainer.optimizers[0])
        self.scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        self.global_step = trainer.global_step
        with torch.no_grad():
            self.logits = pl_module(probe_tokens()).numpy().copy()


def _train(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    probe = AtTrainEnd()
    run = Path(root) / "run"
    trainer = make_trainer(
        world_size,
        MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=PROCESS_GROUP_TIMEOUT),
        max_epochs=1,
        callbacks=[
            probe,
            ModelCheckpoint(dirpath=run, filename="trained"),
            # Its own state key (Lightning refuses two alike): the last step, by step count.
            ModelCheckpoint(
                dirpath=run, filename="weights", save_weights_only=True, every_n_train_steps=4
            ),
        ],
    )
    model = ExportLM(lr=LR, num_blocks=BLOCKS, label="probe")
    trainer.fit(model, datamodule=TokenData(batch_size=2, seed=3))
    return {
        "params": probe.params,
        "buffers": probe.buffers,
        "optimizer": probe.optimizer,
        "scheduler": probe.scheduler,
        "global_step": probe.global_step,
        "logits": probe.logits,
    }


_TRAINED: dict[str, Any] = {}


@pytest.fixture
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 2-rank run's checkpoints and what each rank recorded (once per session)."""
    if not _TRAINED:
        root = tmp_path_factory.mktemp("lightning_export")
        results = run_distributed(_train, 2, str(root), init_process_group=False, timeout=TIMEOUT)
        _TRAINED.update(
            root=root,
            checkpoint=root / "run" / "trained.ckpt",
            weights_only=root / "run" / "weights.ckpt",
            params=assemble([r["params"] for r in results]),
            optimizer=assemble([r["optimizer"] for r in results]),
            results=results,
        )
    return _TRAINED


def _tensors_in(tree: Any, place: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Tensor]]:
    """Every tensor in a nest of dicts, lists and tuples, with its place."""
    if isinstance(tree, Tensor):
        return [(place, tree)]
    if isinstance(tree, dict):
        return [t for key, value in tree.items() for t in _tensors_in(value, (*place, key))]
    if isinstance(tree, list | tuple):
        return [t for i, value in enumerate(tree) for t in _tensors_in(value, (*place, i))]
    return []


def _logits(module: torch.nn.Module) -> np.ndarray:
    with _one_thread(), torch.no_grad():
        return module(probe_tokens()).numpy()


def _assert_module_matches_run(module: ExportLM, trained: dict[str, Any]) -> None:
    """Weights and buffers bit-exact against the shards, logits against the sharded model."""
    state = module.state_dict()
    for name, expected in trained["params"].items():
        np.testing.assert_array_equal(state[name].numpy(), expected, err_msg=name, strict=True)
    for name, expected in trained["results"][0]["buffers"].items():
        np.testing.assert_array_equal(state[name].numpy(), expected, err_msg=name, strict=True)
    np.testing.assert_array_equal(_logits(module), trained["results"][0]["logits"], strict=True)


# ---------------------------------------------------------------------- export -> load


def test_export_loads_with_load_from_checkpoint(trained: dict[str, Any], tmp_path: Path) -> None:
    """Model.load_from_checkpoint(export): hparams rebuild the model; weights, buffers and
    logits equal the sharded run's bit for bit; datamodule hparams and versions kept."""
    checkpoint = trained["checkpoint"]
    with pytest.raises(IsADirectoryError):  # what Lightning alone does with our directory
        ExportLM.load_from_checkpoint(checkpoint)

    output = export_lightning_checkpoint(checkpoint, tmp_path / "model.ckpt")
    assert output == tmp_path / "model.ckpt"
    assert not dist.is_initialized(), "the export must not start a process group"
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"], "temporary file left behind"

    model = ExportLM.load_from_checkpoint(output)  # Lightning's loader, default weights_only
    assert dict(model.hparams) == {"lr": LR, "num_blocks": BLOCKS, "label": "probe"}
    assert len(model.lm.blocks) == BLOCKS
    assert model.lm.head.weight is model.lm.embed.weight  # the tie survives
    _assert_module_matches_run(model, trained)
    assert not np.array_equal(_logits(ExportLM(num_blocks=BLOCKS)), trained["results"][0]["logits"])

    data = TokenData.load_from_checkpoint(output)
    assert dict(data.hparams) == {"batch_size": 2, "seed": 3}

    raw = torch.load(output, weights_only=True)
    assert (raw["epoch"], raw["global_step"]) == (0, trained["results"][0]["global_step"])
    assert raw["pytorch-lightning_version"] == pl.__version__
    assert raw["hparams_name"] == "kwargs"
    assert raw[EXPORT_INFO_KEY]["world_size"] == 2
    assert raw[EXPORT_INFO_KEY]["versions"]["torch"] == torch.__version__
    assert "optimizer_states" not in raw and "loops" in raw and "lr_schedulers" in raw
    assert set(raw["state_dict"]) == set(ExportLM(num_blocks=BLOCKS).state_dict())
    # Every tensor meta.pt holds (the callbacks' kth_value, the ranks' random states) is
    # exported as saved, not as the zeros torch.save reserves for its data.
    held = _tensors_in(torch.load(checkpoint / "meta.pt", weights_only=False))
    assert any("kth_value" in place for place, _ in held), [place for place, _ in held]
    for place, tensor in held:
        exported = raw
        for key in place:
            exported = exported[key]
        torch.testing.assert_close(exported, tensor, rtol=0, atol=0, msg=str(place))

    # The directory itself, through load_lightning_module (a temporary export), and the file.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    direct = load_lightning_module(ExportLM, checkpoint, tmp_dir=scratch, map_location="cpu")
    assert os.listdir(scratch) == [], "the temporary export was not removed"
    _assert_module_matches_run(direct, trained)
    assert dict(direct.hparams) == dict(model.hparams)
    overridden = load_lightning_module(ExportLM, output, label="override")
    assert overridden.hparams.label == "override"

    # bf16 cast (the README's command line): floating tensors only.
    cast = tmp_path / "bf16.ckpt"
    assert main(["export-lightning", str(checkpoint), str(cast), "--dtype", "bf16"]) == 0
    raw = torch.load(cast, weights_only=True)["state_dict"]
    assert raw["lm.embed.weight"].dtype == torch.bfloat16
    assert raw["codes16"].dtype == torch.uint16 and raw["phase"].dtype == torch.complex64
    expected = torch.from_numpy(trained["params"]["lm.embed.weight"]).to(torch.bfloat16)
    assert torch.equal(raw["lm.embed.weight"], expected)


def _resume_single_device(rank: int, world_size: int, path: str, steps: int) -> dict[str, Any]:
    """A plain single-device Lightning run resuming ``fit`` from the exported file."""

    class AtTrainStart(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            optimizer = trainer.optimizers[0]
            names = {id(p): n for n, p in pl_module.named_parameters()}
            self.optimizer = {
                f"{names[id(p)]}/{key}": value.detach().numpy().copy()
                for p, state in optimizer.state.items()
                for key, value in state.items()
            }
            self.lr = [group["lr"] for group in optimizer.param_groups]
            self.scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
            self.global_step = trainer.global_step

    start = AtTrainStart()
    trainer = make_trainer(
        1, "auto", max_steps=steps + 1, callbacks=[start], enable_checkpointing=False
    )
    model = ExportLM(lr=LR, num_blocks=BLOCKS)
    trainer.fit(model, datamodule=TokenData(batch_size=2, seed=3), ckpt_path=path)
    return {
        "optimizer": start.optimizer,
        "lr": start.lr,
        "scheduler": start.scheduler,
        "global_step": start.global_step,
        "final_step": trainer.global_step,
        "strategy": type(trainer.strategy).__name__,
    }


def test_export_with_optimizer_resumes_on_a_single_device(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    """--optimizer writes torch's positional optimizer format: a single-device run
    resumes fit from the file with the sharded run's Adam state, scheduler and step."""
    output = tmp_path / "full.ckpt"
    assert main(["export-lightning", str(trained["checkpoint"]), str(output), "--optimizer"]) == 0
    raw = torch.load(output, weights_only=True)
    (adam,) = raw["optimizer_states"]
    names = [n for n, _ in ExportLM(num_blocks=BLOCKS).named_parameters()]
    assert adam["param_groups"][0]["params"] == list(range(len(names)))
    assert sorted(adam["state"]) == list(range(len(names)))

    steps = trained["results"][0]["global_step"]
    resumed = run_distributed(
        _resume_single_device, 1, str(output), steps, init_process_group=False, timeout=TIMEOUT
    )[0]
    assert resumed["strategy"] == "SingleDeviceStrategy"
    assert resumed["global_step"] == steps and resumed["final_step"] == steps + 1
    assert sorted(resumed["optimizer"]) == sorted(trained["optimizer"])
    assert len(resumed["optimizer"]) == 3 * len(names)  # step, exp_avg, exp_avg_sq
    for key, expected in trained["optimizer"].items():
        np.testing.assert_array_equal(resumed["optimizer"][key], expected, err_msg=key)
    assert resumed["scheduler"] == trained["results"][0]["scheduler"]
    assert resumed["lr"] == [trained["results"][0]["scheduler"]["_last_lr"][0]]


def test_strip_prefix_writes_the_inner_modules_state_dict(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    """--strip-prefix lm.: a plain PackedLM.load_state_dict takes the file as is; the
    entries outside the prefix are left out with a warning (API) or note (CLI)."""
    checkpoint = trained["checkpoint"]
    with pytest.warns(UserWarning, match=r"4 model entries .* outside strip_prefix='lm\.'"):
        output = consolidate_checkpoint(checkpoint, tmp_path / "lm.safetensors", strip_prefix="lm.")
    inner = build_packed_lm(None, num_blocks=BLOCKS)
    state = safetensors.torch.load_file(output)
    assert set(state) == set(inner.state_dict())
    inner.load_state_dict(state, strict=True)
    for name, value in inner.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), trained["params"][f"lm.{name}"], err_msg=name)
    np.testing.assert_array_equal(_logits(inner), trained["results"][0]["logits"], strict=True)

    pt = tmp_path / "lm.pt"
    status = main(["consolidate", str(checkpoint), str(pt), "--strip-prefix", "lm."])
    assert status == 0
    assert set(torch.load(pt, weights_only=True)) == set(state)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_bad_input_is_refused_with_a_clear_error(
    trained: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every refusal names the path or option and what to do; nothing is written."""
    checkpoint, run = trained["checkpoint"], trained["checkpoint"].parent
    out = tmp_path / "out"
    out.mkdir()
    exported = export_lightning_checkpoint(checkpoint, tmp_path / "model.ckpt")

    with pytest.raises(NotACheckpointError, match=r"model\.ckpt is a file, expected a .*load_from"):
        export_lightning_checkpoint(exported, out / "again.ckpt")
    with pytest.raises(
        NotACheckpointError,
        match=r"is a directory of checkpoints \(pass one of them: trained\.ckpt",
    ):
        export_lightning_checkpoint(run, out / "parent.ckpt")
    with pytest.raises(ValueError, match=r"is \.safetensors, which holds tensors only"):
        export_lightning_checkpoint(checkpoint, out / "model.safetensors")
    with pytest.raises(ValueError, match=r"dtype='int8' is not supported"):
        export_lightning_checkpoint(checkpoint, out / "model.ckpt", dtype="int8")
    with pytest.raises(ValueError, match=r"no optimizer state .* saved weights-only"):
        export_lightning_checkpoint(trained["weights_only"], out / "w.ckpt", optimizer=True)
    with pytest.raises(FileExistsError, match=r"already exists; nothing was written"):
        export_lightning_checkpoint(checkpoint, exported)

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoint, damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptedError, match=rf"{shard.name}: crc32c .* on disk"):
        export_lightning_checkpoint(damaged, out / "damaged.ckpt")
    unpicklable = tmp_path / "meta.ckpt"
    shutil.copytree(checkpoint, unpicklable)
    meta = unpicklable / "meta.pt"
    meta.write_bytes(b"\0" * meta.stat().st_size)  # same size: only a checksum would see it
    with pytest.raises(CheckpointCorruptedError, match=r"meta\.pt does not unpickle"):
        export_lightning_checkpoint(unpicklable, out / "meta.ckpt", verify_checksums=False)

    with pytest.raises(FileNotFoundError, match=r"absent does not exist; expected a \.ckpt"):
        load_lightning_module(ExportLM, tmp_path / "absent")
    with pytest.raises(
        NotACheckpointError, match=r"^load_lightning_module: (?s:.*)is a directory of"
    ):
        load_lightning_module(ExportLM, run)

    with pytest.raises(ValueError, match=r"strip_prefix='lm' must be a module path ending in"):
        consolidate_checkpoint(checkpoint, out / "x.safetensors", strip_prefix="lm")
    with pytest.raises(ValueError, match=r"strip_prefix='lm\.' with include_optimizer"):
        consolidate_checkpoint(
            checkpoint, out / "x.safetensors", strip_prefix="lm.", include_optimizer=True
        )
    with pytest.raises(ValueError, match=r"strip_prefix='model\.' matches no model key .*'lm\.'"):
        consolidate_checkpoint(checkpoint, out / "x.safetensors", strip_prefix="model.")
    assert os.listdir(out) == [], "a refused export wrote something"

    status, stdout, err = _main(capsys, "export-lightning", str(checkpoint), str(out / "c.ckpt"))
    assert status == 0 and "wrote" in stdout, err
    from_cli = torch.load(out / "c.ckpt", weights_only=True)
    from_api = torch.load(exported, weights_only=True)
    assert from_cli.keys() == from_api.keys()
    for name, value in from_api["state_dict"].items():
        assert torch.equal(from_cli["state_dict"][name], value), name
    status, stdout, err = _main(capsys, "export-lightning", str(exported), str(out / "d.ckpt"))
    assert status == 1 and "is a file, expected a checkpoint directory" in err, err
    status, stdout, err = _main(
        capsys, "consolidate", str(checkpoint), str(out / "e.safetensors"), "--strip-prefix", "lm."
    )
    assert status == 0 and "note: consolidate_checkpoint: 4 model entries" in err, err
    with pytest.raises(SystemExit) as usage:
        main(
            [
                "consolidate",
                str(checkpoint),
                str(out / "f.pt"),
                "--optimizer",
                "--strip-prefix",
                "lm.",
            ]
        )
    assert usage.value.code == 2


# ---------------------------------------------------------------------- safetensors dtypes


def _with_unknown_dtype(source: Path, destination: Path, key: str, code: str) -> None:
    """Copy a safetensors file, relabelling tensor ``key`` as dtype ``code`` (6-bit
    floats, which torch has no dtype for) over the same bytes."""
    raw = source.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, end = header[key]["data_offsets"]
    header[key]["dtype"] = code
    header[key]["shape"] = [(end - begin) * 8 // 6]
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    destination.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :])


def _shard(module: torch.nn.Module, blocks: torch.nn.ModuleList) -> torch.nn.Module:
    mesh = dp_mesh(dist.get_world_size())
    with sharding_scope():  # one context for the blocks and their parent (megatron-fsdp 0.7)
        for block in blocks:
            shard_module(block, mesh, fsdp_placements())
        shard_module(module, mesh, fsdp_placements())
    return module


def _load_odd_dtypes(rank: int, world_size: int, root: str, run: str) -> dict[str, Any]:
    enable_cpu_execution()
    export, unknown = os.path.join(root, "odd.safetensors"), os.path.join(root, "f6.safetensors")
    result: dict[str, Any] = {}
    # Needed: the module that has the buffers (zeroed first), strict.
    needs = ExportLM(num_blocks=BLOCKS)
    for name in ODD_BUFFERS:
        getattr(needs, name).zero_()
    needs = _shard(needs, needs.lm.blocks)
    loaded = load_full_weights(needs, export)
    result["needs"] = {
        "buffers": {n: b.numpy().copy() for n, b in needs.named_buffers()},
        "loaded": loaded.loaded,
    }
    # Not needed: the inner network alone, strict=False; the odd tensors are only unexpected.
    for name, path in (("not_needed", export), ("unknown_not_needed", unknown)):
        inner = build_packed_lm(None, num_blocks=BLOCKS)
        inner = _shard(inner, inner.blocks)
        loaded = load_full_weights(inner, path, strip_prefix="lm.", strict=False)
        result[name] = {"unexpected": loaded.unexpected, "missing": loaded.missing}
    # Needed and of a dtype torch lacks: refused on every rank, naming the key.
    target = ExportLM(num_blocks=BLOCKS)
    target = _shard(target, target.lm.blocks)
    with pytest.raises(CheckpointError) as error:
        load_full_weights(target, unknown)
    result["unknown_needed"] = str(error.value)
    with pytest.raises(CheckpointError) as error:
        load_full_weights(target, run)
    result["parent"] = str(error.value)
    return result


def test_safetensors_with_u16_u32_u64_c64_load_when_needed_or_not(
    trained: dict[str, Any], tmp_path: Path
) -> None:
    """Our export's U16/U32/U64/C64 tensors load bit-exactly where the model has them and
    are ignored where it does not; a dtype torch lacks fails only when it is needed."""
    export = consolidate_checkpoint(trained["checkpoint"], tmp_path / "odd.safetensors")
    with safetensors.safe_open(export, "pt") as handle:
        codes = {key: handle.get_slice(key).get_dtype() for key in ODD_BUFFERS}
    assert codes == {"codes16": "U16", "codes32": "U32", "codes64": "U64", "phase": "C64"}
    _with_unknown_dtype(export, tmp_path / "f6.safetensors", "codes16", "F6_E3M2")
    run = str(trained["checkpoint"].parent)
    results = run_distributed(_load_odd_dtypes, 2, str(tmp_path), run, timeout=TIMEOUT)
    for result in results:
        for name, expected in trained["results"][0]["buffers"].items():
            got = result["needs"]["buffers"][name]
            np.testing.assert_array_equal(got, expected, err_msg=name, strict=True)
        assert set(ODD_BUFFERS) <= set(result["needs"]["loaded"])
        assert result["not_needed"] == {"unexpected": ODD_BUFFERS, "missing": ()}
        assert sorted(result["unknown_not_needed"]["unexpected"]) == sorted(ODD_BUFFERS)
        error = result["unknown_needed"]
        assert "tensor 'codes16' has safetensors dtype F6_E3M2" in error, error
        assert "the model needs it" in error and "Nothing was loaded" in error, error
        parent = result["parent"]
        assert "without .metadata: not a DCP checkpoint" in parent, parent
        assert "holds checkpoint directories ['trained.ckpt', 'weights.ckpt']" in parent, parent
    assert (
        results[0]["unknown_needed"].split("\n")[1:] == results[1]["unknown_needed"].split("\n")[1:]
    )
