"""``MegatronFSDPStrategy`` trains exactly like one process would, with the real Trainer.

Every multi-rank test runs real processes in a gloo group (``tests.harness``) with a
real ``lightning.pytorch.Trainer``; the reference is plain single-process torch on the
same global batches, computed in the pytest process. Global batches are reproduced with
the same ``DistributedSampler`` Lightning injects (``shuffle=True, seed=0`` for training).

Final weights are assembled from each rank's local shards at the offsets
``chunk_metadata_by_fqn`` reports, checking every element is written exactly once, so a
wrong layout cannot hide. The model's root unit packs unevenly: at 3 ranks one rank owns
none of ``head``/``scale``.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import Tensor, nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_megatron_fsdp import (
    MegatronFSDPPrecision,
    MegatronFSDPStrategy,
    chunk_metadata_by_fqn,
    shard_module,
    sharded_grad_norm,
)
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron._megatron import FsdpModule
from tests.gpu import assert_ran_on_cuda, cuda_world_size
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import PackedBlock, PackedLM, build_packed_lm, lm_loss, make_batch, make_trainer
from tests.scripts.strategy_fit import Block  # one auto-wrapped unit
from tests.test_portability import assemble

ATOL = 1e-5  # fp32 equivalence bound from the issue
BATCH = 2  # per-rank micro-batch
STEPS = 3


# ---------------------------------------------------------------------- models and data


class MLP(pl.LightningModule):
    """Two ``Block`` units plus root-owned ``head`` and ``scale``; records what it sees."""

    def __init__(self, optimizer: str = "adam", lr: float = 0.05) -> None:
        super().__init__()
        self.b1 = Block(5, 7)
        self.b2 = Block(7, 6)
        self.head = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        self.val_mse = torchmetrics.MeanSquaredError()
        self.optimizer_name = optimizer
        self.lr = lr
        self.step_losses: list[float] = []
        self.output_dtypes: list[str] = []
        self.grad_placements: list[str] = []
        self.norms: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.head(self.b2(self.b1(x)))
        self.output_dtypes.append(str(hidden.dtype))  # the matmul's dtype (autocast or not)
        return hidden * self.scale

    def training_step(self, batch: list[Tensor], batch_idx: int) -> dict[str, Tensor]:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out.float(), y.float())
        global_loss = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
        self.step_losses.append(float(global_loss))
        self.log("train_loss", loss, sync_dist=True)
        return {"loss": loss}  # a dict: the strategy must route ["loss"] through the root hook

    def on_after_backward(self) -> None:
        grad = self.b1.lin.weight.grad
        assert isinstance(grad, DTensor)
        self.grad_placements.append(str(grad.placements))

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.norms.append(float(sharded_grad_norm(self.parameters())))

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        x, y = batch
        self.val_mse(self(x), y)
        self.log("val_mse", self.val_mse)

    def test_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: list[Tensor], batch_idx: int) -> tuple[Tensor, Tensor]:
        index, x = batch
        return index, self(x)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def _regression_data(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=generator), torch.randn(rows, 3, generator=generator)


def _strategy(**kwargs: Any) -> MegatronFSDPStrategy:
    return MegatronFSDPStrategy(timeout=PROCESS_GROUP_TIMEOUT, **kwargs)


def _trainer(world_size: int, strategy: MegatronFSDPStrategy, **kwargs: Any) -> pl.Trainer:
    return make_trainer(world_size, strategy, **{"max_steps": STEPS, **kwargs})


def _global_batches(
    rows: int, world_size: int, batch: int, steps: int, micro_batches: int = 1
) -> list[list[int]]:
    """Row indices of each optimizer step's global batch, as Lightning's sampler deals them."""
    per_rank = [
        list(DistributedSampler(range(rows), num_replicas=world_size, rank=r, seed=0))
        for r in range(world_size)
    ]
    span = batch * micro_batches
    return [
        [i for r in range(world_size) for i in per_rank[r][s * span : (s + 1) * span]]
        for s in range(steps)
    ]


def _shards(model: nn.Module) -> dict[str, tuple[int, np.ndarray]]:
    """This rank's shard of every parameter FQN (ties too): (row offset, fp32 values)."""
    chunks = chunk_metadata_by_fqn(model)
    result = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        assert isinstance(parameter, DTensor), name
        local = parameter._local_tensor.detach().float().cpu().numpy().copy()
        result[name] = (int(chunks[name].offsets[0]), local)
    return result


def _assemble(per_rank: list[dict[str, tuple[int, np.ndarray]]]) -> dict[str, Tensor]:
    """Full tensors from every rank's shards; each element must be written exactly once."""
    return {name: torch.from_numpy(full) for name, full in assemble(per_rank).items()}


def _assert_params_close(
    full: dict[str, Tensor], reference: nn.Module, atol: float = ATOL, prefix: str = ""
) -> None:
    expected = dict(reference.named_parameters(remove_duplicate=False))
    assert set(full) == {prefix + name for name in expected}
    for name, parameter in expected.items():
        actual = full[prefix + name]
        expected_value = parameter.detach().reshape(actual.shape)
        torch.testing.assert_close(actual, expected_value, rtol=0, atol=atol)


def _reference_mlp(
    batches: list[list[int]],
    data: tuple[Tensor, Tensor],
    *,
    optimizer: str = "adam",
    lr: float = 0.05,
    micro_batch_divisor: int = 1,
    clip: Callable[[nn.Module], float] | None = None,
) -> tuple[MLP, list[float], list[float]]:
    """Single-process training of ``MLP`` on the given global batches."""
    pl.seed_everything(0, verbose=False)
    model = MLP()
    x, y = data
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        scheduler = None
    else:
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    losses, norms = [], []
    for indices in batches:
        loss = nn.functional.mse_loss(model(x[indices]), y[indices])
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        if clip is not None:
            norms.append(clip(model))
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return model, losses, norms


def _torch_clip(algorithm: str, value: float) -> Callable[[nn.Module], float]:
    """Single-process clipping with torch's own utilities; returns the pre-clip total norm."""

    def clip(model: nn.Module) -> float:
        norm = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(model.parameters(), value)
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), value)
        return norm

    return clip


# ---------------------------------------------------------------------- equivalence


def _fit_validate_test_predict(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = MLP()
    x, y = _regression_data(BATCH * world_size * STEPS, seed=1)
    vx, vy = _regression_data(2 * world_size, seed=2)
    px, _ = _regression_data(2 * world_size, seed=3)
    collectives = _Collectives()
    trainer = _trainer(world_size, _strategy(auto_wrap_policy={Block}), callbacks=[collectives])
    val_loader = DataLoader(TensorDataset(vx, vy), batch_size=1)
    # With a val loader: a sanity check before training and a validation after the epoch.
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH), val_loader)
    result: dict[str, Any] = {
        "losses": model.step_losses,
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "fit_val_mse": float(trainer.callback_metrics["val_mse"]),
        "shards": _shards(model),
        "units": sorted(n for n, m in model.named_modules() if isinstance(m, FsdpModule)),
        "mesh": tuple(model.device_mesh.shape),
    }
    (validated,) = trainer.validate(model, DataLoader(TensorDataset(vx, vy), batch_size=1))
    (tested,) = trainer.test(model, DataLoader(TensorDataset(vx, vy), batch_size=2))
    index = torch.arange(len(px))
    predictions = trainer.predict(model, DataLoader(TensorDataset(index, px), batch_size=1))
    # A new Trainer (and strategy) adopts the sharded model's mesh, re-bound to new groups.
    (revalidated,) = _trainer(world_size, _strategy()).validate(
        model, DataLoader(TensorDataset(vx, vy), batch_size=1)
    )
    result["revalidated"] = revalidated["val_mse"]
    result["val_mse"] = validated["val_mse"]
    result["test_loss"] = tested["test_loss"]
    result["predictions"] = [(int(i), out.numpy().copy()) for i, out in predictions]
    result["collectives"] = collectives.seen
    # teardown keeps the group: like DDP, it lives until the process ends.
    result["group_after_teardown"] = torch.distributed.is_initialized()
    return result


class _Collectives(Callback):
    """Exercises the strategy's collectives while the process group is up."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy, rank, world_size = trainer.strategy, trainer.global_rank, trainer.world_size
        strategy.barrier("collectives")
        self.seen = {
            "broadcast": strategy.broadcast({"from": rank}, src=world_size - 1),
            "all_gather": strategy.all_gather(torch.tensor([rank])).flatten().tolist(),
            "reduce_sum": float(strategy.reduce(torch.tensor(float(rank)), reduce_op="sum")),
            "decision": strategy.reduce_boolean_decision(rank == 0, all=False),
        }


@pytest.mark.both_versions
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fit_matches_single_process_and_eval_loops_sync(world_size: int) -> None:
    """Losses/weights match plain torch; later validate/test/predict and collectives sync."""
    results = run_distributed(
        _fit_validate_test_predict, world_size, init_process_group=False, timeout=120
    )
    data = _regression_data(BATCH * world_size * STEPS, seed=1)
    batches = _global_batches(len(data[0]), world_size, BATCH, STEPS)
    reference, ref_losses, _ = _reference_mlp(batches, data)

    for result in results:
        # The LightningModule owns `scale` (a unit), the blocks are policy units, and the
        # top-level `head` is a unit of its own, so it can be called anywhere.
        assert result["units"] == ["", "b1", "b2", "head"]
        assert result["mesh"] == (world_size,)
        np.testing.assert_allclose(result["losses"], ref_losses, rtol=0, atol=ATOL)
        assert result["train_loss"] == pytest.approx(ref_losses[-1], abs=ATOL)
    _assert_params_close(_assemble([r["shards"] for r in results]), reference)
    # Some rank must own no row of a unit's tensors at 3 ranks (the uneven case): the
    # ``head`` unit packs 18 + 3 elements into 3 x 12, so one rank holds only padding.
    if world_size == 3:
        assert any(r["shards"]["head.bias"][1].shape[0] == 0 for r in results)
        assert any(r["shards"]["head.weight"][1].shape[0] == 0 for r in results)

    vx, vy = _regression_data(2 * world_size, seed=2)
    px, _ = _regression_data(2 * world_size, seed=3)
    with torch.no_grad():
        val_mse = float(nn.functional.mse_loss(reference(vx), vy))
        expected_predictions = reference(px)
    seen = []
    for result in results:
        assert result["val_mse"] == pytest.approx(val_mse, abs=ATOL)
        assert result["revalidated"] == result["val_mse"] == result["fit_val_mse"]
        assert result["test_loss"] == pytest.approx(val_mse, abs=ATOL)
        for index, output in result["predictions"]:
            seen.append(index)
            np.testing.assert_allclose(output[0], expected_predictions[index], atol=ATOL, rtol=0)
        assert result["collectives"] == {
            "broadcast": {"from": world_size - 1},
            "all_gather": list(range(world_size)),
            "reduce_sum": sum(range(world_size)),
            "decision": True,
        }
        assert result["group_after_teardown"] is True  # lives until the process ends
    assert sorted(seen) == list(range(len(px)))


# ---------------------------------------------------------------------- two optimizers


class TwoOptimizers(pl.LightningModule):
    """Manual optimization: an encoder and a decoder unit, each with its own optimizer and
    LR scheduler; the root owns no parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = Block(5, 7)
        self.decoder = Block(7, 3)
        self.step_losses: list[float] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.encoder(x))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        x, y = batch
        optimizers = self.optimizers()
        loss = nn.functional.mse_loss(self(x), y)
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for scheduler in self.lr_schedulers():
            scheduler.step()
        self.step_losses.append(float(self.trainer.strategy.reduce(loss.detach())))

    def configure_optimizers(self) -> Any:
        return _two_optimizers(self)


def _two_optimizers(model: TwoOptimizers) -> tuple[list[Any], list[Any]]:
    sgd = torch.optim.SGD(model.encoder.parameters(), lr=0.3, momentum=0.9)
    adam = torch.optim.Adam(model.decoder.parameters(), lr=0.05)
    schedulers = [
        torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5),
        torch.optim.lr_scheduler.StepLR(adam, step_size=1, gamma=0.7),
    ]
    return [sgd, adam], schedulers


def _fit_two_optimizers(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = TwoOptimizers()
    x, y = _regression_data(BATCH * world_size * STEPS, seed=10)
    # global_step counts optimizer steps: two per training step here.
    trainer = _trainer(world_size, _strategy(auto_wrap_policy={Block}), max_steps=2 * STEPS)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {"losses": model.step_losses, "shards": _shards(model)}


def test_two_optimizers_with_schedulers_manual_optimization() -> None:
    """Several optimizers and LR schedulers (manual optimization) match plain torch."""
    world_size = 2
    results = run_distributed(
        _fit_two_optimizers, world_size, init_process_group=False, timeout=120
    )
    x, y = _regression_data(BATCH * world_size * STEPS, seed=10)
    pl.seed_everything(0, verbose=False)
    reference = TwoOptimizers()
    optimizers, schedulers = _two_optimizers(reference)
    ref_losses = []
    for indices in _global_batches(len(x), world_size, BATCH, STEPS):
        loss = nn.functional.mse_loss(reference(x[indices]), y[indices])
        ref_losses.append(loss.item())
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        for scheduler in schedulers:
            scheduler.step()
    for result in results:
        np.testing.assert_allclose(result["losses"], ref_losses, rtol=0, atol=ATOL)
    _assert_params_close(_assemble([r["shards"] for r in results]), reference)


# ---------------------------------------------------------------------- nested + tied


class TiedLM(pl.LightningModule):
    """``PackedLM`` (embedding, packed blocks, head tied to the embedding), sharded by hand.

    ``configure_model`` shards block 0 with ``strategy.shard`` and block 1 with
    ``shard_module`` directly; the strategy then shards what is left (the root: the tied
    embedding/head and the head bias).
    """

    def __init__(self) -> None:
        super().__init__()
        self.step_losses: list[float] = []

    def configure_model(self) -> None:
        if hasattr(self, "lm"):
            return
        self.lm = build_packed_lm(seed=0)
        strategy = self.trainer.strategy
        assert isinstance(strategy, MegatronFSDPStrategy)
        strategy.shard(self.lm.blocks[0])
        shard_module(self.lm.blocks[1], self.device_mesh, strategy.placements)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = lm_loss(self.lm, batch)
        self.step_losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def _token_data(rows: int) -> tuple[Tensor, Tensor]:
    return make_batch(7, batch_size=rows, seq_len=5)


def _fit_tied_lm(rank: int, world_size: int) -> dict[str, Any]:
    model = TiedLM()
    tokens, targets = _token_data(BATCH * world_size * STEPS)
    trainer = _trainer(world_size, _strategy())
    trainer.fit(model, DataLoader(TensorDataset(tokens, targets), batch_size=BATCH))
    lm = model.lm
    return {
        "losses": model.step_losses,
        "shards": _shards(lm),
        "tied": lm.head.weight is lm.embed.weight,
        "units": [isinstance(m, FsdpModule) for m in (model, lm, *lm.blocks)],
    }


@pytest.mark.both_versions
@pytest.mark.parametrize("world_size", [2, 3])
def test_user_sharded_tied_transformer_matches_single_process(world_size: int) -> None:
    """configure_model sharding + strategy root: tie kept, training equals one process."""
    results = run_distributed(_fit_tied_lm, world_size, init_process_group=False, timeout=120)
    tokens, targets = _token_data(BATCH * world_size * STEPS)
    reference = build_packed_lm(seed=0)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    ref_losses = []
    for indices in _global_batches(len(tokens), world_size, BATCH, STEPS):
        loss = lm_loss(reference, (tokens[indices], targets[indices]))
        ref_losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for result in results:
        assert result["tied"]
        # ``lm`` (which holds the tie) is the top-level unit over the blocks the user
        # sharded; the LightningModule owns no parameter, so it is not a unit.
        assert result["units"] == [False, True, True, True]
        np.testing.assert_allclose(result["losses"], ref_losses, rtol=0, atol=ATOL)
    full = _assemble([r["shards"] for r in results])
    torch.testing.assert_close(full["head.weight"], full["embed.weight"], rtol=0, atol=0)
    _assert_params_close(full, reference)
    assert isinstance(reference, PackedLM) and isinstance(reference.blocks[0], PackedBlock)


# ---------------------------------------------------------------------- accumulation


def _fit_accumulating(rank: int, world_size: int, mesh: tuple[int, int] | None) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = MLP()
    x, y = _regression_data(4 * 2 * world_size, seed=4)
    strategy = _strategy(auto_wrap_policy={Block}, device_mesh=mesh)
    trainer = _trainer(
        world_size, strategy, max_steps=2, accumulate_grad_batches=4, gradient_clip_val=0.05
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=1))
    return {"shards": _shards(model), "placements": model.grad_placements, "norms": model.norms}


@pytest.mark.both_versions
@pytest.mark.parametrize(("world_size", "mesh"), [(2, None), (4, (2, 2))])
def test_accumulating_four_micro_batches_equals_one_big_step(
    world_size: int, mesh: tuple[int, int] | None
) -> None:
    """4 micro-batches of 1 per rank == one step on the concatenated batch, clipped by norm.

    Under HSDP the gradient norm must count each element once although every replica row
    holds a copy of it, and only the last micro-batch may all-reduce across replicas.
    """
    results = run_distributed(
        _fit_accumulating, world_size, mesh, init_process_group=False, timeout=150
    )
    data = _regression_data(4 * 2 * world_size, seed=4)
    batches = _global_batches(len(data[0]), world_size, 1, 2, micro_batches=4)
    reference, _, ref_norms = _reference_mlp(batches, data, clip=_torch_clip("norm", 0.05))
    assert min(ref_norms) > 0.1  # clipping is active
    for result in results:
        np.testing.assert_allclose(result["norms"], ref_norms, rtol=1e-5, atol=0)
    replicas, shards_per_replica = mesh or (1, world_size)
    rows = [results[i : i + shards_per_replica] for i in range(0, world_size, shards_per_replica)]
    assert len(rows) == replicas
    for row in rows[1:]:  # HSDP replicas hold bit-identical shards
        for mine, first in zip(row, rows[0], strict=True):
            for name, (offset, values) in mine["shards"].items():
                assert offset == first["shards"][name][0]
                np.testing.assert_array_equal(values, first["shards"][name][1])
    _assert_params_close(_assemble([r["shards"] for r in rows[0]]), reference)
    for result in results:
        placements = result["placements"]
        assert len(placements) == 8
        if mesh is None:
            assert set(placements) == {"(Shard(dim=0),)"}
        else:
            # Micro-batches 1-3 of each window leave gradients unreduced across replicas
            # (Partial); only the 4th all-reduces them (microbatch(is_last=False) works).
            partial, final = "(Partial(avg), Shard(dim=0))", "(Replicate(), Shard(dim=0))"
            assert placements == [partial] * 3 + [final] + [partial] * 3 + [final]


# ---------------------------------------------------------------------- clipping


def _fit_clipping(rank: int, world_size: int, algorithm: str, value: float) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    model = MLP(optimizer="sgd", lr=0.5)
    x, y = _regression_data(BATCH * world_size * STEPS, seed=5)
    trainer = _trainer(
        world_size,
        _strategy(auto_wrap_policy={Block}),
        gradient_clip_val=value,
        gradient_clip_algorithm=algorithm,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    return {"shards": _shards(model), "norms": model.norms}


@pytest.mark.parametrize(("algorithm", "value"), [("norm", 0.05), ("value", 0.02)])
def test_gradient_clipping_matches_single_process(algorithm: str, value: float) -> None:
    """Clipping over uneven shards: same total norm and update as torch's single-process clip."""
    world_size = 3
    results = run_distributed(
        _fit_clipping, world_size, algorithm, value, init_process_group=False, timeout=120
    )
    data = _regression_data(BATCH * world_size * STEPS, seed=5)
    batches = _global_batches(len(data[0]), world_size, BATCH, STEPS)
    clip = _torch_clip(algorithm, value)
    reference, _, ref_norms = _reference_mlp(batches, data, optimizer="sgd", lr=0.5, clip=clip)
    assert min(ref_norms) > 2 * value  # clipping is active in every step
    for result in results:
        np.testing.assert_allclose(result["norms"], ref_norms, rtol=1e-5, atol=0)
    _assert_params_close(_assemble([r["shards"] for r in results]), reference)


# ---------------------------------------------------------------------- precision


class _Bf16Probe(Callback):
    """Checks, on each rank, what bf16-true must mean right after setup and after training."""

    def __init__(self, initial: dict[str, Tensor]) -> None:
        self.initial = initial
        self.report: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        chunks = chunk_metadata_by_fqn(pl_module)
        exact = True
        for name, parameter in pl_module.named_parameters():
            offset, rows = int(chunks[name].offsets[0]), int(chunks[name].sizes[0])
            expected = self.initial[name][offset : offset + rows]
            exact &= torch.equal(parameter._local_tensor, expected.reshape(-1, *expected.shape[1:]))
        self.report["main_weights_exact_fp32_init"] = exact
        self.report["start"] = _precision_state(pl_module)


def _precision_state(model: nn.Module) -> dict[str, Any]:
    main, compute, synced = set(), set(), True
    for module in model.modules():
        if not isinstance(module, FsdpModule):
            continue
        for group in module.parameter_groups:
            main.add(str(group.main_weight.dtype))
            compute.add(str(group.model_weight.dtype))
            # Per parameter, not the whole local buffer: the buffers' padding is
            # torch.empty memory that nothing writes, so comparing it fails at random.
            for entry in _megatron.entries(group):
                main_rows = group.main_weight.get_local_tensor(entry.index)
                model_rows = group.model_weight.get_local_tensor(entry.index)
                synced &= torch.equal(main_rows.to(model_rows.dtype), model_rows)
    return {"main": sorted(main), "compute": sorted(compute), "synced": synced}


PRECISION_STEPS = 2
TRUE_PRECISIONS = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def _fit_precisions(rank: int, world_size: int) -> dict[str, Any]:
    report: dict[str, Any] = {}
    x, y = _regression_data(BATCH * world_size * PRECISION_STEPS, seed=6)
    for precision in TRUE_PRECISIONS:
        pl.seed_everything(0, verbose=False)
        model = MLP()
        probe = _Bf16Probe({n: p.detach().clone() for n, p in model.named_parameters()})
        trainer = _trainer(
            world_size,
            _strategy(auto_wrap_policy={Block}),
            precision=precision,
            max_steps=PRECISION_STEPS,
            callbacks=[probe],
        )
        trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
        (optimizer,) = trainer.optimizers
        report[precision] = {
            **probe.report,
            "end": _precision_state(model),
            "plugin": type(trainer.precision_plugin).__name__,
            "outputs": sorted(set(model.output_dtypes)),
            "params": sorted({str(p.dtype) for p in model.parameters()}),
            "optimizer_state": sorted(
                {f"{k}:{v.dtype}" for s in optimizer.state.values() for k, v in s.items()}
            ),
            "losses": model.step_losses,
            "shards": _shards(model),
        }
    pl.seed_everything(0, verbose=False)
    model = MLP()
    trainer = _trainer(
        world_size, _strategy(auto_wrap_policy={Block}), precision="bf16-mixed", max_steps=1
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    report["bf16-mixed"] = {
        **_precision_state(model),
        "outputs": sorted(set(model.output_dtypes)),
        "shared_buffer": all(
            g.model_weight is g.main_weight
            for m in model.modules()
            if isinstance(m, FsdpModule)
            for g in m.parameter_groups
        ),
    }
    return report


def _reference_true_precision(
    data: tuple[Tensor, Tensor], world_size: int, dtype: torch.dtype, steps: int
) -> tuple[MLP, list[float]]:
    """``MLP`` trained in one plain process the way a ``-true`` flag promises to train it.

    fp32 master weights and Adam state; a ``dtype`` copy of the masters computes each
    rank's forward and backward on that rank's rows (inputs and targets cast to ``dtype``,
    as the precision plugin casts a batch); the ranks' ``dtype`` gradients are averaged in
    ``dtype`` (where Megatron-FSDP reduces them) and the optimizer steps the masters.
    Independent of the code under test: no sharding, no Megatron-FSDP.
    """
    pl.seed_everything(0, verbose=False)
    master = MLP()
    compute = copy.deepcopy(master).to(dtype)
    optimizer = torch.optim.Adam(master.parameters(), lr=master.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    x, y = (t.to(dtype) for t in data)
    losses = []
    for rows in _global_batches(len(x), world_size, BATCH, steps):
        rank_losses, rank_grads = [], []
        for rank in range(world_size):
            mine = rows[rank * BATCH : (rank + 1) * BATCH]
            compute.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(compute(x[mine]).float(), y[mine].float())
            loss.backward()
            rank_losses.append(loss.detach())
            rank_grads.append([p.grad for p in compute.parameters()])
        per_parameter = zip(*rank_grads, strict=True)
        for parameter, grads in zip(master.parameters(), per_parameter, strict=True):
            parameter.grad = (torch.stack(grads).sum(0) / world_size).float()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for low, high in zip(compute.parameters(), master.parameters(), strict=True):
                low.copy_(high)
        losses.append(float(torch.stack(rank_losses).mean()))
    return master, losses


@pytest.mark.both_versions
def test_true_precisions_train_like_one_process_and_keep_fp32_state() -> None:
    """bf16-true and 16-true: half-precision compute, exact fp32 masters and Adam state,
    and the same training as one process at that precision; bf16-mixed: fp32 + autocast."""
    world_size = 2
    reports = run_distributed(_fit_precisions, world_size, init_process_group=False, timeout=150)
    data = _regression_data(BATCH * world_size * PRECISION_STEPS, seed=6)
    for precision, dtype in TRUE_PRECISIONS.items():
        for report in reports:
            true = report[precision]
            assert true["plugin"] == "MegatronFSDPPrecision"
            assert true["main_weights_exact_fp32_init"] is True
            for state in (true["start"], true["end"]):
                assert state == {
                    "main": ["torch.float32"],
                    "compute": [str(dtype)],
                    "synced": True,
                }
            assert true["outputs"] == [str(dtype)]
            assert true["params"] == ["torch.float32"]
            assert true["optimizer_state"] == [
                "exp_avg:torch.float32",
                "exp_avg_sq:torch.float32",
                "step:torch.float32",
            ]
        # Bit for bit: each rank computes exactly what the reference computes for its rows,
        # and a 2-rank average in the compute dtype rounds once, as the reference's does.
        reference, losses = _reference_true_precision(data, world_size, dtype, PRECISION_STEPS)
        for report in reports:
            assert report[precision]["losses"] == losses, precision
        full = _assemble([r[precision]["shards"] for r in reports])
        _assert_params_close(full, reference, atol=0)
        # Not vacuous: an fp32 run ends elsewhere, so the comparison tells precisions apart.
        batches = _global_batches(len(data[0]), world_size, BATCH, PRECISION_STEPS)
        fp32, _, _ = _reference_mlp(batches, data)
        with pytest.raises(AssertionError):
            _assert_params_close(full, fp32, atol=0)
    for report in reports:
        mixed = report["bf16-mixed"]
        assert mixed["main"] == mixed["compute"] == ["torch.float32"]
        assert mixed["shared_buffer"] and mixed["outputs"] == ["torch.bfloat16"]


# ---------------------------------------------------------------------- meta-device init


class Deep(pl.LightningModule):
    """16 equal blocks: the whole model is 16 units' worth of parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(256, 256) for _ in range(16))
        self.head = nn.Linear(256, 1)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (x,) = batch
        return self(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _SetupMemory(Callback):
    """Every CPU allocation and free from ``setup`` (before configure_model and the
    strategy's sharding) to ``on_fit_start``, via the torch profiler's memory events."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.profiler.__enter__()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profiler.__exit__(None, None, None)
        events = [
            e for e in self.profiler.profiler.kineto_results.events() if e.name() == "[memory]"
        ]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        self.peak, self.retained = peak, live
        self.shards = _shards(pl_module)  # as materialised, before any optimizer step


def _fit_meta(rank: int, world_size: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    memory = _SetupMemory()
    trainer = _trainer(
        world_size, _strategy(auto_wrap_policy={Block}), max_steps=1, callbacks=[memory]
    )
    with trainer.init_module(empty_init=True):
        model = Deep()
    on_meta = all(p.is_meta for p in model.parameters())
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(2 * world_size, 256)), batch_size=2))
    return {
        "on_meta": on_meta,
        "peak": memory.peak,
        "retained": memory.retained,
        "shards": memory.shards,
    }


@pytest.mark.both_versions
def test_meta_init_materialises_unit_by_unit() -> None:
    """empty_init: setup's transient memory is ~a unit or two, never the whole model."""
    world_size = 2
    results = run_distributed(_fit_meta, world_size, init_process_group=False, timeout=120)
    unit_bytes = (256 * 256 + 256) * 4
    model_bytes = 16 * unit_bytes + (256 + 1) * 4
    for result in results:
        assert result["on_meta"]
        transient = result["peak"] - result["retained"]
        # Shards: fp32 main weights + main grads = 2 x model / world_size (+ padding).
        assert result["retained"] == pytest.approx(2 * model_bytes / world_size, rel=0.05)
        assert transient <= 3 * unit_bytes
    # Materialised by reset_parameters() in the same RNG order as an eager build.
    pl.seed_everything(0, verbose=False)
    eager = Deep()
    _assert_params_close(_assemble([r["shards"] for r in results]), eager, atol=0)


# ---------------------------------------------------------------------- CUDA / NCCL


class _CudaSetupMemory(Callback):
    """Peak and retained CUDA memory from ``setup`` to ``on_fit_start`` (the sharding)."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.start = torch.cuda.memory_allocated()

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated() - self.start
        self.retained = torch.cuda.memory_allocated() - self.start


def _fit_cuda(rank: int, world_size: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    pl.seed_everything(0, verbose=False)
    model = MLP()
    x, y = _regression_data(BATCH * world_size * STEPS, seed=1)
    vx, vy = _regression_data(2 * world_size, seed=2)
    trainer = _trainer(world_size, _strategy(auto_wrap_policy={Block}), accelerator="gpu")
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    # Evaluation runs under torch.inference_mode on NCCL (no_grad only on gloo).
    (validated,) = trainer.validate(model, DataLoader(TensorDataset(vx, vy), batch_size=1))
    result.update(
        losses=model.step_losses,
        shards=_shards(model),
        val_mse=validated["val_mse"],
        backend=trainer.strategy.process_group_backend,
        devices=sorted({str(p.device.type) for p in model.parameters()}),
    )
    pl.seed_everything(0, verbose=False)
    bf16 = MLP()
    trainer = _trainer(
        world_size,
        _strategy(auto_wrap_policy={Block}),
        accelerator="gpu",
        precision="bf16-true",
        max_steps=2,
    )
    trainer.fit(bf16, DataLoader(TensorDataset(x, y), batch_size=BATCH))
    result["bf16"] = _precision_state(bf16)
    memory = _CudaSetupMemory()
    trainer = _trainer(
        world_size,
        _strategy(auto_wrap_policy={Block}),
        accelerator="gpu",
        max_steps=1,
        callbacks=[memory],
    )
    with trainer.init_module(empty_init=True):
        deep = Deep()
    trainer.fit(deep, DataLoader(TensorDataset(torch.randn(2 * world_size, 256)), batch_size=2))
    result["peak"], result["retained"] = memory.peak, memory.retained
    return result


@pytest.mark.gpu
def test_cuda_nccl_training_matches_cpu_reference() -> None:
    """Unchanged on CUDA/NCCL: same training, inference-mode eval, bf16-true, meta peak."""
    world_size = cuda_world_size()
    results = run_distributed(_fit_cuda, world_size, init_process_group=False, timeout=240)
    assert_ran_on_cuda([r["devices"][0] for r in results], world_size)
    data = _regression_data(BATCH * world_size * STEPS, seed=1)
    batches = _global_batches(len(data[0]), world_size, BATCH, STEPS)
    reference, ref_losses, _ = _reference_mlp(batches, data)
    unit_bytes = (256 * 256 + 256) * 4
    for result in results:
        assert result["backend"] == "nccl" and result["devices"] == ["cuda"]
        np.testing.assert_allclose(result["losses"], ref_losses, rtol=0, atol=1e-4)
        assert result["bf16"] == {
            "main": ["torch.float32"],
            "compute": ["torch.bfloat16"],
            "synced": True,
        }
        assert result["peak"] - result["retained"] <= 3 * unit_bytes
    _assert_params_close(_assemble([r["shards"] for r in results]), reference, atol=1e-4)
    vx, vy = _regression_data(2 * world_size, seed=2)
    with torch.no_grad():
        val_mse = float(nn.functional.mse_loss(reference(vx), vy))
    assert all(r["val_mse"] == pytest.approx(val_mse, abs=1e-4) for r in results)


# ---------------------------------------------------------------------- bad input


class _LBFGSModel(MLP):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.LBFGS(self.parameters())


class _TorchFSDP2Model(MLP):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.b2, mesh=self.device_mesh)


class _StaleOptimizerModel(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.early = torch.optim.SGD(self.parameters(), lr=0.1)  # unsharded parameters

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.early


def _bad_inputs(rank: int, world_size: int) -> dict[str, str]:
    x, y = _regression_data(BATCH * world_size, seed=8)
    cases: dict[str, tuple[type[MLP], dict[str, Any]]] = {
        "mesh": (MLP, {"device_mesh": (2, world_size)}),
        "lbfgs": (_LBFGSModel, {}),
        "fsdp2": (_TorchFSDP2Model, {}),
        "stale": (_StaleOptimizerModel, {}),
    }
    messages = {}
    for case, (cls, kwargs) in cases.items():
        trainer = _trainer(world_size, _strategy(**kwargs), max_steps=1)
        try:
            trainer.fit(cls(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
        except (TypeError, ValueError) as err:
            messages[case] = f"{type(err).__name__}: {err}"
        else:
            messages[case] = "no error"
    # The user's own split gives rank r r+1 training batches (uneven evaluation is joined,
    # see test_uneven_evaluation.py; training is refused).
    trainer = _trainer(world_size, _strategy(), use_distributed_sampler=False, max_steps=1)
    x, y = _regression_data(BATCH * (rank + 1), seed=9)
    try:
        trainer.fit(MLP(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    except ValueError as err:
        messages["uneven training"] = f"ValueError: {err}"
    return messages


def test_bad_input_raises_one_clear_error_on_every_rank() -> None:
    """FSDP2 modules, a mesh larger than the world, LBFGS, stale params, uneven training."""
    expected = {
        "mesh": r"ValueError: .*device_mesh=\(2, 2\) spans 4 processes, but the world has 2",
        "lbfgs": r"TypeError: .*LBFGS re-evaluates its closure",
        "fsdp2": r"TypeError: .*module 'b2' .* already wrapped by torch FSDP2",
        "stale": r"ValueError: .*optimizer 0 holds parameter .*not one of the model's",
        "uneven training": r"ValueError: .*training dataloaders give ranks different numbers of "
        r"batches \(rank 0: \[1.0\], rank 1: \[2.0\]\), and a training step cannot be joined",
    }
    for messages in run_distributed(_bad_inputs, 2, init_process_group=False, timeout=120):
        for case, pattern in expected.items():
            assert re.match(pattern, messages[case], flags=re.DOTALL), (case, messages[case])


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"auto_wrap_policy": "Block"}, TypeError, r"auto_wrap_policy must be a non-empty set"),
        ({"auto_wrap_policy": {Block, "x"}}, TypeError, r"nn.Module subclasses only; got 'x'"),
        ({"auto_wrap_policy": Block}, TypeError, r"auto_wrap_policy must be a non-empty set"),
        ({"device_mesh": (2,)}, TypeError, r"device_mesh must be None, a \(replicate, shard\)"),
        ({"device_mesh": (0, 2)}, ValueError, r"device_mesh sizes must be >= 1"),
        ({"timeout": 30}, TypeError, r"timeout must be a datetime.timedelta"),
    ],
)
def test_invalid_options_are_rejected_at_construction(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        MegatronFSDPStrategy(**kwargs)


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(4, 4), Block(4, 40)])  # 20 and 200 parameters
        self.norm = nn.LayerNorm(40)


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ({Block}, ["0.blocks.0", "0.blocks.1"]),
        (lambda module: isinstance(module, nn.LayerNorm), ["0.norm"]),
        # 200 parameters in blocks.1.lin, then the 100 left in the tower; never the root.
        (
            functools.partial(size_based_auto_wrap_policy, min_num_params=100),
            ["0.blocks.1.lin", "0"],
        ),
        (ModuleWrapPolicy({Block, _Tower, nn.Sequential}), ["0.blocks.0", "0.blocks.1", "0"]),
        (None, []),
    ],
)
def test_auto_wrap_policy_selects_units_bottom_up(policy: Any, expected: list[str]) -> None:
    """Sets, one-argument callables and torch FSDP policies choose units, children first."""
    from lightning_megatron_fsdp.megatron.sharding import _policy_units, validate_auto_wrap_policy

    root = nn.Sequential(_Tower())
    names = {id(m): n for n, m in root.named_modules()}
    units = _policy_units(root, validate_auto_wrap_policy(policy, "test"))
    assert [names[id(u)] for u in units] == expected


def test_lightning_async_checkpoint_io_is_refused() -> None:
    """Lightning's thread-based AsyncCheckpointIO would interleave collectives: one error."""
    with pytest.raises(TypeError, match=r"MegatronFSDPCheckpointIO\(async_save=True\)"):
        MegatronFSDPStrategy(checkpoint_io=AsyncCheckpointIO())
    with pytest.raises(TypeError, match=r"AsyncCheckpointIO saves from a background thread"):
        pl.Trainer(strategy="megatron_fsdp", accelerator="cpu", plugins=[AsyncCheckpointIO()])


def test_registry_and_precision_flags() -> None:
    """``strategy="megatron_fsdp"`` resolves; precision flags map or fail clearly."""
    trainer = pl.Trainer(
        strategy="megatron_fsdp", accelerator="cpu", devices=1, precision="bf16-true", logger=False
    )
    assert isinstance(trainer.strategy, MegatronFSDPStrategy)
    plugin = trainer.precision_plugin
    assert isinstance(plugin, MegatronFSDPPrecision) and plugin.precision == "bf16-true"
    policy = trainer.strategy.mixed_precision_policy
    assert (policy.main_params_dtype, policy.main_grads_dtype) == (torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"precision='64-true' is not supported"):
        pl.Trainer(strategy="megatron_fsdp", accelerator="cpu", devices=1, precision="64-true")
    with pytest.raises(ValueError, match=r"'16-mixed' is not supported.*use 'bf16-mixed'"):
        MegatronFSDPPrecision("16-mixed")
