"""Portable checkpoints: full weights and other strategies' checkpoints load into Megatron-FSDP.

Everything is real: ranks are processes in a gloo group (``tests.harness``), the Trainer
is Lightning's, FSDP2 runs through Lightning's own ``ModelParallelStrategy`` (it runs on
CPU/gloo with torch 2.13), and every file is written by the tool that owns its format
(``torch.save``, safetensors, DCP, a single-device Lightning run, our export); one
``meta.pt`` is then relabelled as a GPU run writes it (its tensors on ``cuda:0``), which
a machine without a GPU cannot write itself.

The model, :class:`PackedLit`, wraps ``tests.models.PackedLM`` (a tie under two FQNs,
a 3-D parameter, a fragment packed into another's padding, a Linear whose bias lies on
another rank than its weight) and adds a persistent buffer, so a rank owns rows of some
parameters and none of others. Loaded values are compared bit for bit: each rank's shard
against the source's rows at the offsets ``chunk_metadata_by_fqn`` reports (so a shard
read from canonical ``Shard(0)`` rows fails), and the sharded model's outputs against
the plain model's, computed in the same process.

This module also holds the helpers ``tests/test_portability_resharding.py`` imports.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_megatron_fsdp import (
    CheckpointError,
    MegatronFSDPCheckpointIO,
    MegatronFSDPStrategy,
    attach_uneven_dtensor_metadata,
    chunk_metadata_by_fqn,
    consolidate_checkpoint,
    enable_cpu_execution,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.storage.format import META_FILE
from lightning_megatron_fsdp.strategies.strategy import fsdp_placements
from lightning_megatron_fsdp.weights.pretrained import (
    PretrainedWeights,
    as_pretrained_weights,
    load_full_weights,
)
from tests import models
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import VOCAB, PackedBlock, bf16_policy, build_packed_lm, dp_mesh
from tests.untrusted_attacks import reseal

ROWS = 24  # two steps per epoch at a global batch of 12
GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks: every world size sees the same batches
SEQ = 5
LR = 0.05

# ---------------------------------------------------------------------- shared helpers


class PackedLit(pl.LightningModule):
    """``PackedLM`` (uneven packing, tied embedding/head) plus a persistent buffer.

    Args:
        seed: Seed of the parameter values; ``None`` for zeros (a load target that cannot
            pass a comparison by accident). The buffer is 1.25, or 3.0 for ``None``.
    """

    def __init__(self, seed: int | None = 0) -> None:
        super().__init__()
        self.lm = build_packed_lm(seed)
        self.register_buffer("temperature", torch.tensor([1.25 if seed is not None else 3.0]))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.lm(tokens) / self.temperature

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        logits = self(tokens).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


class Fsdp2PackedLit(PackedLit):
    """The same module, sharded with torch FSDP2 for Lightning's ``ModelParallelStrategy``."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.lm.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def token_data() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)
    return tokens, torch.randint(0, VOCAB, (ROWS, SEQ), generator=generator)


def train_loader(world_size: int) -> DataLoader:
    """Lightning shuffles it with a ``DistributedSampler(seed=0)``: a permutation per epoch,
    the same at every world size, dealt out rank by rank, so step s of an epoch trains on
    the same 12 rows (split differently) whatever the world size."""
    return DataLoader(TensorDataset(*token_data()), batch_size=GLOBAL_BATCH // world_size)


class _LaterEpochSampler(DistributedSampler):
    """Lightning's training sampler, but epoch e deals the permutation of epoch e + shift."""

    def __init__(self, dataset: TensorDataset, world_size: int, rank: int, shift: int) -> None:
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
        self.shift = shift

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch + self.shift)


def later_epoch_loader(world_size: int, rank: int, shift: int) -> DataLoader:
    """:func:`train_loader`'s batches of epoch ``e + shift`` in epoch ``e`` (needs
    ``Trainer(use_distributed_sampler=False)``)."""
    dataset = TensorDataset(*token_data())
    sampler = _LaterEpochSampler(dataset, world_size, rank, shift)
    return DataLoader(dataset, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)


def probe_tokens() -> Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(11))


def probe_outputs(module: nn.Module) -> np.ndarray:
    """``module``'s logits on the probe batch (through the FSDP root: a collective)."""
    with torch.no_grad():
        return module(probe_tokens()).float().numpy().copy()


def train_reference(epochs: int) -> list[dict[str, Any]]:
    """``PackedLit`` trained by one plain process, unsharded, on the Trainer's global
    batches: after each epoch, its probe outputs, parameters and Adam state (by
    ``"fqn/key"``).

    At every world size dividing 12, Lightning's ``DistributedSampler(seed=0)`` deals step
    s of an epoch the rows at positions [12 s, 12 s + 12) of that epoch's permutation,
    which is what a 1-replica sampler yields in order.
    """
    model = PackedLit(seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    dataset = TensorDataset(*token_data())
    names = {id(p): n for n, p in model.named_parameters()}
    states = []
    for epoch in range(epochs):
        sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order), GLOBAL_BATCH):
            loss = model.training_step(dataset[order[start : start + GLOBAL_BATCH]], start)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        optimizer_state = {
            f"{names[id(p)]}/{k}": v.detach().numpy().copy()
            for p, state in optimizer.state.items()
            for k, v in state.items()
        }
        states.append(
            {
                "outputs": probe_outputs(model),
                "params": plain_state(model),
                "optimizer": optimizer_state,
            }
        )
    return states


def fit_two_epochs(
    world_size: int, strategy: Any, model: pl.LightningModule, root: str, probe: Callback
) -> dict[str, Any]:
    """Two epochs of :func:`train_loader`, a checkpoint into ``root`` after each: what
    ``probe`` recorded after the first (its ``outputs``, ``params`` and ``optimizer``)."""
    checkpoints = ModelCheckpoint(dirpath=root, save_top_k=-1, every_n_epochs=1)
    trainer = make_trainer(
        world_size,
        strategy,
        max_epochs=2,
        enable_checkpointing=True,
        callbacks=[probe, checkpoints],
    )
    trainer.fit(model, train_loader(world_size))
    return {"outputs": probe.outputs, "params": probe.params, "optimizer": probe.optimizer}


def megatron_strategy(**kwargs: Any) -> MegatronFSDPStrategy:
    return MegatronFSDPStrategy(
        timeout=PROCESS_GROUP_TIMEOUT, auto_wrap_policy={PackedBlock}, **kwargs
    )


def make_trainer(world_size: int, strategy: Any, **kwargs: Any) -> pl.Trainer:
    """:func:`tests.models.make_trainer` without the sanity validation steps."""
    return models.make_trainer(world_size, strategy, **{"num_sanity_val_steps": 0, **kwargs})


# name -> (first global row of this rank's shard or None for a whole tensor, values)
Shards = dict[str, tuple[int | None, np.ndarray]]


def param_shards(module: nn.Module) -> Shards:
    """This rank's main-weight shard of every parameter FQN (ties: each FQN), and buffers.

    Values keep their dtype (a comparison checks it first); numpy has no bf16, so a bf16
    main weight fails here loudly rather than being widened into a passing fp32 copy.
    """
    chunks = chunk_metadata_by_fqn(module)
    shards: Shards = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        assert isinstance(parameter, DTensor), name
        local = parameter._local_tensor.detach().numpy().copy()  # its own dtype
        shards[name] = (int(chunks[name].offsets[0]), local)
    for name, buffer in module.named_buffers():
        shards[name] = (None, buffer.detach().numpy().copy())
    return shards


def optimizer_shards(module: nn.Module, optimizer: Any) -> Shards:
    """This rank's optimizer state, keyed ``"<param fqn>/<state name>"``."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    chunks = chunk_metadata_by_fqn(module)
    names = {id(p): n for n, p in module.named_parameters()}
    shards: Shards = {}
    for parameter, state in optimizer.state.items():
        fqn = names[id(parameter)]
        for name, value in state.items():
            if isinstance(value, DTensor):
                local = value._local_tensor.detach().numpy().copy()
                shards[f"{fqn}/{name}"] = (int(chunks[fqn].offsets[0]), local)
            else:
                shards[f"{fqn}/{name}"] = (None, value.detach().numpy().copy())
    return shards


def assemble(per_rank: list[Shards]) -> dict[str, np.ndarray]:
    """Full tensors from the shards of one replica's ranks; every row written exactly once.

    Whole tensors (``None`` offset) must be equal on every rank.
    """
    full: dict[str, np.ndarray] = {}
    for name in per_rank[0]:
        pieces = [shards[name] for shards in per_rank]
        if pieces[0][0] is None:
            for _, piece in pieces[1:]:
                np.testing.assert_array_equal(piece, pieces[0][1], err_msg=name, strict=True)
            full[name] = pieces[0][1]
            continue
        rows = sum(piece.shape[0] for _, piece in pieces)
        tensor = np.zeros((rows, *pieces[0][1].shape[1:]), dtype=pieces[0][1].dtype)
        written = np.zeros(rows, dtype=np.int64)
        for offset, piece in pieces:
            assert offset is not None
            tensor[offset : offset + piece.shape[0]] = piece
            written[offset : offset + piece.shape[0]] += 1
        assert (written == 1).all(), f"{name}: rows written {written.tolist()}"
        full[name] = tensor
    return full


def assert_same(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name, strict=True)


def plain_state(module: nn.Module) -> dict[str, np.ndarray]:
    """A plain module's state dict as numpy arrays of their own dtype (ties under each FQN)."""
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


def shard_packed_lit(model: PackedLit, *, bf16: bool = False) -> PackedLit:
    """Shard like the strategy does (each block, then the root), without a Trainer."""
    mesh = dp_mesh(dist.get_world_size())
    policy = bf16_policy() if bf16 else None
    if bf16:
        model.lm.to(torch.bfloat16)
    with sharding_scope():  # megatron-fsdp 0.7: a parent and its units share one context
        for block in model.lm.blocks:
            shard_module(block, mesh, fsdp_placements(), mixed_precision_policy=policy)
        shard_module(model, mesh, fsdp_placements(), mixed_precision_policy=policy)
    return model


# ---------------------------------------------------------------------- option validation


def test_pretrained_weights_options_are_validated() -> None:
    """Bad options raise where they are given, naming the option (no process group)."""
    with pytest.raises(TypeError, match=r"path must be a str or os\.PathLike, got 3"):
        PretrainedWeights(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="path must not be empty"):
        PretrainedWeights("")
    with pytest.raises(TypeError, match="strict must be a bool, got 'yes'"):
        PretrainedWeights("w.pt", strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="strip_prefix must be a str, got None"):
        PretrainedWeights("w.pt", strip_prefix=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"init_weights_from must be a path .* got \[1\]"):
        MegatronFSDPStrategy(init_weights_from=[1])  # type: ignore[arg-type]
    assert as_pretrained_weights(Path("w.pt")) == PretrainedWeights(Path("w.pt"))
    assert as_pretrained_weights(None) is None
    with pytest.raises(ValueError, match="is not sharded by Megatron-FSDP"):
        load_full_weights(PackedLit(), "w.pt")


# ---------------------------------------------------------------------- sources, directly


def _write_sources(root: Path) -> dict[str, Any]:
    """Every full-weight format, from one plain model (seed 3); returns how to load each."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_model

    plain = PackedLit(seed=3)
    torch.save(plain.state_dict(), root / "plain.pt")
    # Hugging Face style: the bare network (no "lm." prefix, no buffer), the tie stored
    # once (save_model drops the duplicate FQN).
    save_model(plain.lm, os.fspath(root / "bare.safetensors"))
    dcp.save(plain.state_dict(), checkpoint_id=root / "plain_dcp", no_dist=True)
    return {
        "plain.pt": {},
        "bare.safetensors": {"add_prefix": "lm.", "strict": False},
        "plain_dcp": {},
    }


def _load_sources(rank: int, world_size: int, root: str, sources: dict[str, Any]) -> dict:
    enable_cpu_execution()
    plain = PackedLit(seed=3)
    bare = PackedLit(seed=3)
    bare.temperature.fill_(3.0)  # the target's buffer, which the bare network lacks
    result: dict[str, Any] = {
        "plain_outputs": probe_outputs(plain),
        "bare_outputs": probe_outputs(bare),
    }
    for name, options in sources.items():
        model = shard_packed_lit(PackedLit(seed=None))
        loaded = load_full_weights(model, os.path.join(root, name), **options)
        result[name] = {
            "shards": param_shards(model),
            "outputs": probe_outputs(model),
            "kind": loaded.kind,
            "missing": loaded.missing,
            "loaded": loaded.loaded,
        }
    # bf16 compute weights with fp32 main weights: the load must refresh compute weights.
    model = shard_packed_lit(PackedLit(seed=None), bf16=True)
    load_full_weights(model, os.path.join(root, "plain.pt"))
    plain.lm.to(torch.bfloat16)
    result["bf16"] = {
        "shards": param_shards(model),
        "outputs": probe_outputs(model),
        "plain_outputs": probe_outputs(plain),
    }
    return result


def test_full_weight_sources_fill_each_rank_with_its_own_rows(tmp_path: Path) -> None:
    """.pt, .safetensors (bare network, tie stored once) and DCP load into 3 ranks exactly."""
    sources = _write_sources(tmp_path)
    results = run_distributed(_load_sources, 3, str(tmp_path), sources, timeout=120)
    expected = plain_state(PackedLit(seed=3))
    for name in sources:
        full = assemble([r[name]["shards"] for r in results])
        if name == "bare.safetensors":  # no buffer there: it keeps its value (strict=False)
            assert results[0][name]["missing"] == ("temperature",)
            assert full.pop("temperature").tolist() == [3.0]
            assert "lm.head.weight" in results[0][name]["loaded"]  # filled through the tie
            assert_same(full, {k: v for k, v in expected.items() if k != "temperature"})
        else:
            assert results[0][name]["missing"] == ()
            assert_same(full, expected)
        for result in results:
            plain = result["bare_outputs" if name == "bare.safetensors" else "plain_outputs"]
            np.testing.assert_array_equal(result[name]["outputs"], plain)
    assert {r[n]["kind"] for r in results for n in sources} == {"torch", "safetensors", "dcp"}
    # The uneven case is present: some rank owns no row of some parameter.
    assert any(r["plain.pt"]["shards"]["lm.head.bias"][1].shape[0] == 0 for r in results)
    bf16_full = assemble([r["bf16"]["shards"] for r in results])
    assert_same(bf16_full, expected)  # fp32 main weights exact
    for result in results:  # and the bf16 compute weights were refreshed from them
        np.testing.assert_array_equal(result["bf16"]["outputs"], result["bf16"]["plain_outputs"])


# ---------------------------------------------------------------------- errors on every rank


def _bad_loads(rank: int, world_size: int, root: str) -> dict[str, str]:
    enable_cpu_execution()
    model = shard_packed_lit(PackedLit(seed=None))
    before = param_shards(model)
    # One of our checkpoints, then damaged: a shard file loses its last byte.
    state = get_model_state_dict(model)
    attach_uneven_dtensor_metadata(model, state, {})
    MegatronFSDPCheckpointIO().save_checkpoint({"state_dict": state}, os.path.join(root, "ours"))
    if rank == 0:
        shard = Path(root, "ours", "__1_0.distcp")
        shard.write_bytes(shard.read_bytes()[:-1])
    dist.barrier()
    errors: dict[str, str] = {}
    cases: dict[str, tuple[str, dict[str, Any]]] = {
        "mismatch": ("bad.pt", {}),
        "dtype": ("ints.pt", {}),
        # Rank 1 alone cannot read its source: every rank must still raise.
        "one_rank": ("plain.pt" if rank == 0 else "absent.pt", {}),
        "suffix": ("weights.txt", {}),
        "not_dcp": ("empty_dir", {}),
        "prefix": ("plain.pt", {"strip_prefix": "model."}),
        "no_optimizer_state": ("plain.pt", {"optimizers": "adam"}),
        "positional": ("positional.ckpt", {"optimizers": "adam"}),
        "garbage": ("garbage.pt", {}),
        "damaged": ("ours", {}),
    }
    for case, (name, options) in cases.items():
        if options.get("optimizers") == "adam":
            options = {"optimizers": [torch.optim.Adam(model.parameters(), lr=LR)]}
        with pytest.raises(CheckpointError) as info:
            load_full_weights(model, os.path.join(root, name), **options)
        errors[case] = f"{type(info.value).__name__}: {info.value}"
    unchanged = param_shards(model)
    errors["unchanged"] = str(all(np.array_equal(unchanged[k][1], before[k][1]) for k in before))
    return errors


def test_bad_sources_raise_the_same_clear_error_on_every_rank(tmp_path: Path) -> None:
    """Missing, unexpected, mis-shaped and mis-typed FQNs, unreadable sources: all ranks."""
    plain = PackedLit(seed=3)
    torch.save(plain.state_dict(), tmp_path / "plain.pt")
    bad = plain.state_dict()
    del bad["lm.head.bias"]
    bad["lm.blocks.0.gain"] = torch.zeros(3, 6)
    bad["extra.weight"] = torch.zeros(2)
    torch.save(bad, tmp_path / "bad.pt")
    ints = plain.state_dict()
    ints["lm.blocks.1.mix"] = torch.zeros(5, 2, 3, dtype=torch.int64)
    torch.save(ints, tmp_path / "ints.pt")
    # A Lightning-style .ckpt whose position-keyed Adam covered the blocks only.
    blocks_adam = torch.optim.Adam(plain.lm.blocks.parameters(), lr=LR)
    lightning = {"state_dict": plain.state_dict(), "optimizer_states": [blocks_adam.state_dict()]}
    torch.save(lightning, tmp_path / "positional.ckpt")
    (tmp_path / "garbage.pt").write_bytes(b"not a torch file")
    (tmp_path / "weights.txt").write_text("not weights")
    (tmp_path / "empty_dir").mkdir()

    results = run_distributed(_bad_loads, 2, str(tmp_path), timeout=120)
    # The very same error on both ranks (each names the path it was given first).
    for case in results[0]:
        assert results[0][case].split("\n")[1:] == results[1][case].split("\n")[1:], case
    errors = results[0]
    mismatch = errors["mismatch"]
    assert mismatch.startswith("CheckpointMismatchError")
    assert "missing from the source: ['lm.head.bias']" in mismatch
    assert "match no model FQN" in mismatch and "'extra.weight'" in mismatch
    assert "'lm.blocks.0.gain': shape (3, 6) in the source" in mismatch and "(1, 6)" in mismatch
    assert "Nothing was loaded; the model is unchanged." in mismatch
    assert "'lm.blocks.1.mix': dtype torch.int64 in the source" in errors["dtype"]
    assert errors["one_rank"].startswith("CheckpointError")
    assert (
        "absent.pt does not exist" in errors["one_rank"] and "[rank(s) [1]]" in errors["one_rank"]
    )
    assert "unsupported suffix '.txt'" in errors["suffix"]
    assert "without .metadata: not a DCP checkpoint" in errors["not_dcp"]
    assert "strip_prefix='model.'" in errors["prefix"]
    assert "holds no optimizer state" in errors["no_optimizer_state"]
    assert "param groups hold [12] parameters, the live optimizer's [14]" in errors["positional"]
    assert errors["garbage"].startswith("CheckpointError")
    assert "garbage.pt: not a zip archive" in errors["garbage"]
    assert "ours is an incomplete or damaged checkpoint: __1_0.distcp:" in errors["damaged"]
    assert errors["unchanged"] == "True"


# ---------------------------------------------------------------------- Trainer option


class AtTrainStart(Callback):
    """What the model and optimizer hold when training starts (after any restore).

    Args:
        load_from: Load weights and optimizer state from this source first, with
            :func:`load_full_weights` (after recording the outputs ``init_weights_from``
            produced).
    """

    def __init__(self, load_from: str | None = None) -> None:
        self.load_from = load_from
        self.loaded_optimizers = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.outputs = probe_outputs(pl_module)
        if self.load_from is not None:
            loaded = load_full_weights(pl_module, self.load_from, optimizers=trainer.optimizers)
            self.loaded_optimizers = loaded.optimizers
        self.params = param_shards(pl_module)
        self.optimizer = optimizer_shards(pl_module, trainer.optimizers[0])
        self.epoch, self.global_step = trainer.current_epoch, trainer.global_step


class _AtValidationStart(Callback):
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.params = param_shards(pl_module)


def _single_device_fit(rank: int, world_size: int, path: str) -> None:
    """A plain Lightning run on one CPU device; its .ckpt is a full state dict."""
    pl.seed_everything(0, verbose=False)
    model = PackedLit(seed=3)
    trainer = make_trainer(1, "auto", max_steps=2)
    trainer.fit(model, train_loader(1))
    trainer.save_checkpoint(path)


def _init_from_ckpt(rank: int, world_size: int, path: str) -> dict[str, Any]:
    plain = PackedLit(seed=None)
    plain.load_state_dict(torch.load(path, weights_only=True)["state_dict"])
    result: dict[str, Any] = {"plain_outputs": probe_outputs(plain)}
    model = PackedLit(seed=None)
    start = AtTrainStart(load_from=path)
    trainer = make_trainer(
        world_size, megatron_strategy(init_weights_from=path), max_steps=1, callbacks=[start]
    )
    trainer.fit(model, train_loader(world_size))
    result["start"] = {"outputs": start.outputs, "params": start.params}
    result["optimizer"] = start.optimizer
    result["trained"] = param_shards(model)
    # Same model, same option, new Trainer: the trained weights stay (applied once).
    probe = _AtValidationStart()
    make_trainer(
        world_size, megatron_strategy(init_weights_from=PretrainedWeights(path)), callbacks=[probe]
    ).validate(model, DataLoader(TensorDataset(probe_tokens()), batch_size=1))
    result["validated"] = probe.params
    return result


@pytest.mark.both_versions
def test_init_weights_from_a_single_device_lightning_ckpt(tmp_path: Path) -> None:
    """A plain single-device .ckpt initialises a 3-rank run with identical outputs; its
    position-keyed Adam state loads by FQN; a later run keeps the trained weights."""
    path = str(tmp_path / "single.ckpt")
    run_distributed(_single_device_fit, 1, path, init_process_group=False, timeout=120)
    results = run_distributed(_init_from_ckpt, 3, path, init_process_group=False, timeout=150)
    saved = torch.load(path, weights_only=True)
    expected = {k: v.numpy() for k, v in saved["state_dict"].items()}
    assert_same(assemble([r["start"]["params"] for r in results]), expected)
    for result in results:
        np.testing.assert_array_equal(result["start"]["outputs"], result["plain_outputs"])
    # torch's Optimizer.state_dict keys state by parameter position (parameters() order).
    names = [n for n, _ in PackedLit().named_parameters()]
    (adam,) = saved["optimizer_states"]
    expected_state = {
        f"{names[index]}/{key}": value.numpy()
        for index, state in adam["state"].items()
        for key, value in state.items()
    }
    assert len(expected_state) == 3 * len(names)
    assert_same(assemble([r["optimizer"] for r in results]), expected_state)
    trained = assemble([r["trained"] for r in results])
    assert not np.array_equal(trained["lm.embed.weight"], expected["lm.embed.weight"])
    assert_same(assemble([r["validated"] for r in results]), trained)


# ---------------------------------------------------------------------- FSDP2 <-> ours


class _Fsdp2AtEpochEnd(Callback):
    """FSDP2's full weights, optimizer state and outputs after the first epoch."""

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch != 0:
            return
        self.outputs = probe_outputs(pl_module)
        self.params = _full_fsdp2_state(pl_module)
        optimizer = trainer.optimizers[0]
        names = {id(p): n for n, p in pl_module.named_parameters()}
        self.optimizer = {
            f"{names[id(p)]}/{k}": _full(v)
            for p, state in optimizer.state.items()
            for k, v in state.items()
        }


def _full(value: Tensor) -> np.ndarray:
    """FSDP2 shards are canonical ``Shard(0)``: ``full_tensor`` is right for them (dtype kept)."""
    value = value.full_tensor() if isinstance(value, DTensor) else value
    return value.detach().numpy().copy()


def _full_fsdp2_state(module: nn.Module) -> dict[str, np.ndarray]:
    return {k: _full(v) for k, v in module.state_dict().items()}


def _fsdp2_fit(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    pl.seed_everything(0, verbose=False)
    model = Fsdp2PackedLit(seed=3)
    probe = _Fsdp2AtEpochEnd()
    strategy = ModelParallelStrategy(
        data_parallel_size=world_size, tensor_parallel_size=1, timeout=PROCESS_GROUP_TIMEOUT
    )
    first_epoch = fit_two_epochs(world_size, strategy, model, root, probe)
    return {**first_epoch, "final": _full_fsdp2_state(model)}


def _megatron_from_fsdp2(rank: int, world_size: int, source: str, root: str) -> dict[str, Any]:
    model = PackedLit(seed=None)
    start = AtTrainStart(load_from=source)
    checkpoints = ModelCheckpoint(dirpath=root, filename="ours")
    trainer = make_trainer(
        world_size,
        megatron_strategy(init_weights_from=source),
        max_epochs=1,
        enable_checkpointing=True,
        callbacks=[start, checkpoints],
        use_distributed_sampler=False,
    )
    # The batches of FSDP2's second epoch: its weights and optimizer, not its loop state.
    trainer.fit(model, later_epoch_loader(world_size, rank, shift=1))
    return {
        "outputs": start.outputs,
        "loaded_optimizers": start.loaded_optimizers,
        "params": start.params,
        "optimizer": start.optimizer,
        "final": param_shards(model),
        "final_optimizer": optimizer_shards(model, trainer.optimizers[0]),
    }


def _megatron_resumes_fsdp2(rank: int, world_size: int, source: str) -> dict[str, Any]:
    """``trainer.fit(ckpt_path=<FSDP2 checkpoint>)``: weights, Adam state and loop position."""
    model = PackedLit(seed=None)
    start = AtTrainStart()
    trainer = make_trainer(world_size, megatron_strategy(), max_epochs=2, callbacks=[start])
    trainer.fit(model, train_loader(world_size), ckpt_path=source)
    return {
        "outputs": start.outputs,
        "params": start.params,
        "optimizer": start.optimizer,
        "epoch": start.epoch,
        "global_step": start.global_step,
    }


def _export_loads_back(
    rank: int, world_size: int, export: str, full: str, checkpoint: str
) -> dict[str, Any]:
    """Our export into FSDP2 (through Lightning's own full-state-dict path, which
    ``ModelParallelStrategy`` uses); our export with optimizer state, and our 3-rank
    checkpoint itself, into Megatron-FSDP at 2 ranks."""
    from lightning.fabric.strategies.model_parallel import _load_raw_module_state_from_path
    from megatron_fsdp.experimental import fully_shard_optimizer
    from torch.distributed.fsdp import fully_shard

    mesh = dp_mesh(world_size)
    model = PackedLit(seed=None)
    for block in model.lm.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _load_raw_module_state_from_path(Path(export), model, world_size=world_size)
    plain = PackedLit(seed=None)
    plain.load_state_dict(torch.load(export, weights_only=True))
    result: dict[str, Any] = {
        "params": _full_fsdp2_state(model),
        "outputs": probe_outputs(model),
        "plain_outputs": probe_outputs(plain),
    }
    enable_cpu_execution()
    for name, source in (("export", full), ("checkpoint", checkpoint)):
        ours = shard_packed_lit(PackedLit(seed=None))
        adam = torch.optim.Adam(ours.parameters(), lr=LR / 7)  # hyper-parameters load too
        fully_shard_optimizer(adam)
        loaded = load_full_weights(ours, source, optimizers=[adam])
        result[name] = {
            "kind": loaded.kind,
            "params": param_shards(ours),
            "optimizer": optimizer_shards(ours, adam),
            "lr": adam.param_groups[0]["lr"],
            "betas": adam.param_groups[0]["betas"],
        }
    return result


def test_fsdp2_checkpoint_resumes_under_megatron_and_our_export_loads_back(
    tmp_path: Path,
) -> None:
    """ModelParallelStrategy (2 ranks) -> ours (3 ranks) -> export -> plain and FSDP2.

    Weights and Adam state load by FQN bit-exactly; training on continues like FSDP2's
    own second epoch (same global batches); our export loads into a plain module and,
    through Lightning's full-state-dict path, into an FSDP2 module.
    """
    fsdp2 = run_distributed(
        _fsdp2_fit, 2, str(tmp_path / "fsdp2"), init_process_group=False, timeout=150
    )[0]
    source = tmp_path / "fsdp2" / "epoch=0-step=2.ckpt"
    assert (source / ".metadata").is_file() and (source / "meta.pt").is_file()
    ours = run_distributed(
        _megatron_from_fsdp2,
        3,
        str(source),
        str(tmp_path / "ours"),
        init_process_group=False,
        timeout=150,
    )
    for result in ours:
        np.testing.assert_array_equal(result["outputs"], fsdp2["outputs"])
        assert result["loaded_optimizers"] == 1
    assert_same(assemble([r["params"] for r in ours]), fsdp2["params"])
    optimizer = assemble([r["optimizer"] for r in ours])
    assert sorted(optimizer) == sorted(fsdp2["optimizer"])
    for key, value in fsdp2["optimizer"].items():
        np.testing.assert_array_equal(optimizer[key], value, err_msg=key, strict=True)
    final = assemble([r["final"] for r in ours])
    for name, value in fsdp2["final"].items():
        np.testing.assert_allclose(final[name], value, rtol=0, atol=1e-6, err_msg=name, strict=True)
    assert not np.array_equal(final["lm.embed.weight"], fsdp2["params"]["lm.embed.weight"])

    # The same FSDP2 checkpoint through trainer.fit(ckpt_path=...): the loop position too.
    resumed = run_distributed(
        _megatron_resumes_fsdp2, 3, str(source), init_process_group=False, timeout=150
    )
    for result in resumed:
        np.testing.assert_array_equal(result["outputs"], fsdp2["outputs"])
        assert (result["epoch"], result["global_step"]) == (1, 2)
    assert_same(assemble([r["params"] for r in resumed]), fsdp2["params"])
    optimizer = assemble([r["optimizer"] for r in resumed])
    for key, value in fsdp2["optimizer"].items():
        np.testing.assert_array_equal(optimizer[key], value, err_msg=key, strict=True)

    # Our checkpoint, exported, loads into a plain module, into FSDP2, and (weights and
    # Adam state, from safetensors) into a 2-rank Megatron-FSDP model; so does the
    # checkpoint directory itself.
    ckpt = tmp_path / "ours" / "ours.ckpt"
    export = consolidate_checkpoint(ckpt, tmp_path / "ours.pt")
    full = consolidate_checkpoint(ckpt, tmp_path / "full.safetensors", include_optimizer=True)
    plain = PackedLit(seed=None)
    plain.load_state_dict(torch.load(export, weights_only=True))
    assert_same(plain_state(plain), final)
    loaded = run_distributed(_export_loads_back, 2, str(export), str(full), str(ckpt), timeout=120)
    final_optimizer = assemble([r["final_optimizer"] for r in ours])
    for result in loaded:
        assert_same(result["params"], final)
        np.testing.assert_array_equal(result["outputs"], result["plain_outputs"])
    for name, kind in (("export", "safetensors"), ("checkpoint", "dcp")):
        for result in loaded:
            assert result[name]["kind"] == kind
            assert (result[name]["lr"], result[name]["betas"]) == (LR, (0.9, 0.999))
        assert_same(assemble([r[name]["params"] for r in loaded]), final)
        assert_same(assemble([r[name]["optimizer"] for r in loaded]), final_optimizer)


# ---------------------------------------------------------------------- GPU -> CPU

# In meta.pt's pickle (protocol 2), the location torch.save records for a storage in CPU
# memory (one memoised string for all of them), and what it records for one on the first GPU.
_CPU_LOCATION = b"X\x03\x00\x00\x00cpu"
_CUDA_LOCATION = b"X\x06\x00\x00\x00cuda:0"


class _TensorState(Callback):
    """Callback state holding a tensor on the training device, as ``ModelCheckpoint``'s
    best score does (a CUDA tensor in a GPU run); records what a resume restored."""

    def __init__(self) -> None:
        self.score = torch.tensor(0.0)
        self.restored: Tensor | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.score = torch.tensor(float(trainer.global_step) + 0.5)

    def state_dict(self) -> dict[str, Any]:
        return {"score": self.score}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = state_dict["score"]


def _fit_with_tensor_state(
    rank: int, world_size: int, root: str, ckpt_path: str | None
) -> dict[str, Any]:
    state = _TensorState()
    saving = ModelCheckpoint(root, save_last=True, save_top_k=0, every_n_train_steps=2)
    trainer = make_trainer(
        world_size,
        megatron_strategy(),
        max_steps=4 if ckpt_path else 2,
        callbacks=[state, saving],
        enable_checkpointing=True,
    )
    trainer.fit(PackedLit(), train_loader(world_size), ckpt_path=ckpt_path)
    restored = state.restored
    return {"restored": None if restored is None else (restored.device.type, float(restored))}


def _as_saved_on_a_gpu(meta_pt: Path) -> None:
    """Rewrite ``meta.pt`` as a GPU run's rank 0 writes it: its tensors on ``cuda:0``."""
    with zipfile.ZipFile(meta_pt) as source:
        entries = [(info, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(meta_pt, "w") as target:
        for info, data in entries:
            if info.filename.endswith("/data.pkl"):
                assert _CPU_LOCATION in data, "torch.save's pickle changed"
                data = data.replace(_CPU_LOCATION, _CUDA_LOCATION)
            target.writestr(info, data)  # stored, as torch.save writes every entry


def test_a_checkpoint_saved_on_a_gpu_resumes_on_cpu(tmp_path: Path) -> None:
    """``meta.pt`` (Lightning's non-tensor state: callbacks, loops, random states) is loaded
    onto CPU, as Lightning's own ``TorchCheckpointIO`` loads a checkpoint: a GPU run's
    checkpoint resumes on a machine without one, and on GPUs no rank gets tensors on rank
    0's device (a monitored score compared with its own device's metric would fail)."""
    root = tmp_path / "run"
    run_distributed(
        _fit_with_tensor_state, 2, str(root), None, init_process_group=False, timeout=120
    )
    last = root / "last.ckpt"
    _as_saved_on_a_gpu(last / META_FILE)
    reseal(last)
    if not torch.cuda.is_available():  # the file is a GPU's: torch.load as is cannot map it
        with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
            torch.load(last / META_FILE, weights_only=True)
    results = run_distributed(
        _fit_with_tensor_state, 2, str(root), str(last), init_process_group=False, timeout=120
    )
    assert [r["restored"] for r in results] == [("cpu", 2.5)] * 2
