"""Uneven validation, test and prediction data work as under DDP: ranks that run out join.

Every test runs the same script under Lightning's own ``strategy="ddp"`` and under
``MegatronFSDPStrategy`` on 2 real gloo ranks, with the real ``Trainer``, and compares
what a user sees: each rank's predictions (content and order), ``validate``/``test``
results with ``sync_dist`` logging and torchmetrics, callback metrics of a ``fit`` whose
validation is uneven. Batch counts differ between ranks in every stage, one rank has no
batch at all in some dataloaders (it joins with a batch received from its peer), and
iterable datasets exercise Lightning's prefetching fetcher.

Anti-vacuity: DDP's per-rank forward counts differ (the data really is uneven), while
under our strategy every rank runs the same number of forwards (the joins happened), and
batch hooks still see only real batches.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch import Tensor, nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from tests.harness import run_distributed
from tests.models import HIDDEN, PackedBlock, make_trainer, route_strategy

WORLD_SIZE = 2


class Tower(pl.LightningModule):
    """Policy units ``blocks.*``, top-level units ``inp``/``head``, maybe a root parameter.

    Counts step calls (real or joined) and real batch ends per (stage, dataloader), so
    tests can tell joins from real steps.
    """

    def __init__(self, *, own_parameter: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(5, HIDDEN)
        self.blocks = nn.ModuleList([PackedBlock(), PackedBlock()])
        self.head = nn.Linear(HIDDEN, 3)
        if own_parameter:  # the LightningModule becomes a unit of its own
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))
        generator = torch.Generator().manual_seed(0)  # PackedBlock leaves its own uninitialised
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
        self.val_mse = nn.ModuleList([torchmetrics.MeanSquaredError() for _ in range(2)])
        self.allow_zero_length_dataloader_with_multiple_devices = True
        self.joined: list[bool] = []  # per real validation batch: was a join installed?
        self.steps: dict[str, int] = {}
        self.batch_ends: dict[str, int] = {}
        self.metric_updates: list[int] = []

    def _count(self, counts: dict[str, int], dataloader_idx: int = 0) -> None:
        key = f"{self.trainer.state.stage}/{dataloader_idx}"
        counts[key] = counts.get(key, 0) + 1

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.inp(x)
        for block in self.blocks:
            hidden = block(hidden)
        out = self.head(hidden)
        return out * self.scale if hasattr(self, "scale") else out

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: list[Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._count(self.steps, dataloader_idx)
        x, y = batch
        out = self(x)
        self.log("val_loss", nn.functional.mse_loss(out, y), sync_dist=True)
        self.val_mse[dataloader_idx](out, y)
        self.log("val_mse", self.val_mse[dataloader_idx])

    def test_step(self, batch: list[Tensor], batch_idx: int) -> None:
        self._count(self.steps)
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: list[Tensor], batch_idx: int, dataloader_idx: int = 0) -> Any:
        self._count(self.steps, dataloader_idx)
        index, x = batch
        return index, self(x)

    def on_validation_batch_start(self, *args: Any) -> None:
        self.joined.append(getattr(self.trainer.strategy, "_join", None) is not None)

    def on_validation_batch_end(self, *args: Any) -> None:
        self._count(self.batch_ends, args[-1] if len(args) == 4 else 0)

    def on_validation_epoch_end(self) -> None:
        self.metric_updates.append([int(m._update_count) for m in self.val_mse])

    def on_test_batch_end(self, *args: Any) -> None:
        self._count(self.batch_ends)

    def on_predict_batch_end(self, *args: Any) -> None:
        self._count(self.batch_ends, args[-1] if len(args) == 4 else 0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # lr=0: fit's validation sees the initial weights under both strategies.
        return torch.optim.SGD(self.parameters(), lr=0.0)


class RankRows(IterableDataset):
    """Yields ``rows`` (index, x) items; no ``__len__``, so Lightning prefetches."""

    def __init__(self, rows: int, seed: int, *, with_targets: bool = False) -> None:
        self.rows, self.seed, self.with_targets = rows, seed, with_targets

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        x, y = _data(max(self.rows, 1), self.seed)
        for i in range(self.rows):
            yield (x[i], y[i]) if self.with_targets else (torch.tensor(i), x[i])


def _data(rows: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 5, generator=generator), torch.randn(rows, 3, generator=generator)


def _indexed(rows: int, seed: int) -> TensorDataset:
    return TensorDataset(torch.arange(rows), _data(rows, seed)[0])


def _rank_rows(rows_by_rank: list[int], rank: int, seed: int) -> TensorDataset:
    """This rank's part of a split the user made: ``rows_by_rank[rank]`` rows."""
    x, y = _data(sum(rows_by_rank), seed)
    start = sum(rows_by_rank[:rank])
    return TensorDataset(
        x[start : start + rows_by_rank[rank]], y[start : start + rows_by_rank[rank]]
    )


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    return make_trainer(WORLD_SIZE, strategy, **kwargs)


def _model(own_parameter: bool) -> Tower:
    pl.seed_everything(0, verbose=False)
    return Tower(own_parameter=own_parameter)


def _predictions(outputs: Any) -> list[list[tuple[list[int], Tensor]]]:
    """Per dataloader, each batch's (indices, outputs), in this rank's order."""
    return [[(index.tolist(), out.clone()) for index, out in loader] for loader in outputs]


def _run(rank: int, world_size: int, own_parameter: bool, stages: tuple[str, ...]) -> dict:
    """Every stage under DDP, then under our strategy, on fresh models with equal weights."""
    results: dict[str, dict[str, Any]] = {}
    for name in ("ddp", "megatron_fsdp"):
        result: dict[str, Any] = {}
        if "predict" in stages:
            # Lightning's predict sampler (no padding): 3 vs 2 batches, then 4 vs 3.
            model = _model(own_parameter)
            loaders = [
                DataLoader(_indexed(5, seed=1), batch_size=1),
                DataLoader(_indexed(7, seed=2), batch_size=1),
            ]
            result["predict"] = _predictions(_trainer(route_strategy(name)).predict(model, loaders))
            result["predict_counts"] = (model.steps, model.batch_ends)
        if "predict_iterable" in stages:
            # No length: Lightning's fetcher prefetches; rank 1 has no batch at all.
            model = _model(own_parameter)
            loader = DataLoader(RankRows([3, 0][rank], seed=3), batch_size=2)
            trainer = _trainer(route_strategy(name), use_distributed_sampler=False)
            result["predict_iterable"] = _predictions([trainer.predict(model, loader)])
            result["predict_iterable_counts"] = (model.steps, model.batch_ends)
        if "validate" in stages:
            # The user's own split: dataloader 0 has 3 vs 1 batches, dataloader 1 has 1 vs 2.
            model = _model(own_parameter)
            loaders = [
                DataLoader(_rank_rows([3, 1], rank, seed=4), batch_size=1),
                DataLoader(_rank_rows([2, 4], rank, seed=5), batch_size=2),
            ]
            trainer = _trainer(route_strategy(name), use_distributed_sampler=False)
            result["validate"] = trainer.validate(model, loaders, verbose=False)
            result["validate_counts"] = (model.steps, model.batch_ends)
            result["metric_updates"] = model.metric_updates
            result["joined"] = set(model.joined)
        if "validate_even" in stages:
            # Equal batch counts: no join, so no collective beyond the model's own.
            model = _model(own_parameter)
            loader = DataLoader(_rank_rows([2, 2], rank, seed=9), batch_size=1)
            trainer = _trainer(route_strategy(name), use_distributed_sampler=False)
            result["validate_even"] = trainer.validate(model, loader, verbose=False)
            result["joined_even"] = set(model.joined)
        if "test_iterable" in stages:
            model = _model(own_parameter)
            loader = DataLoader(RankRows([1, 3][rank], seed=6, with_targets=True), batch_size=1)
            trainer = _trainer(route_strategy(name), use_distributed_sampler=False)
            result["test"] = trainer.test(model, loader, verbose=False)
            result["test_counts"] = (model.steps, model.batch_ends)
        if "fit" in stages:
            # Sanity check (2 batches at most) and the epoch-end validation are both uneven.
            model = _model(own_parameter)
            x, y = _data(4, seed=7)
            train = DataLoader(TensorDataset(x[rank::2], y[rank::2]), batch_size=1)
            val = DataLoader(_rank_rows([1, 4], rank, seed=8), batch_size=1)
            trainer = _trainer(route_strategy(name), use_distributed_sampler=False, max_epochs=1)
            trainer.fit(model, train, val)
            result["fit"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
            result["fit_counts"] = (model.steps, model.batch_ends)
            result["metric_updates_fit"] = model.metric_updates
        results[name] = result
    return results


def _assert_same_predictions(ours: list, ddp: list) -> None:
    assert len(ours) == len(ddp)
    for our_loader, ddp_loader in zip(ours, ddp, strict=True):
        assert [index for index, _ in our_loader] == [index for index, _ in ddp_loader]
        for (_, our_out), (_, ddp_out) in zip(our_loader, ddp_loader, strict=True):
            torch.testing.assert_close(our_out, ddp_out, rtol=0, atol=0)


@pytest.mark.both_versions
@pytest.mark.parametrize("own_parameter", [True, False], ids=["module-is-unit", "module-owns-none"])
def test_uneven_stages_match_ddp(own_parameter: bool) -> None:
    """Predictions, validate/test results and fit's metrics equal DDP's on uneven data."""
    stages = (
        ("predict", "predict_iterable", "validate", "test_iterable", "fit")
        if own_parameter
        else ("predict", "predict_iterable", "validate", "validate_even")
    )
    results = run_distributed(
        _run, WORLD_SIZE, own_parameter, stages, init_process_group=False, timeout=300
    )
    ddp = [r["ddp"] for r in results]
    ours = [r["megatron_fsdp"] for r in results]
    checked = []
    for rank in range(WORLD_SIZE):
        for key in ("predict", "predict_iterable"):
            if key in ours[rank]:
                _assert_same_predictions(ours[rank][key], ddp[rank][key])
                checked.append(key)
        for key in ("validate", "validate_even", "test", "fit"):
            if key in ours[rank]:
                assert ours[rank][key] == ddp[rank][key], (rank, key)
                checked.append(key)
        for key in ("metric_updates", "metric_updates_fit"):
            if key in ours[rank]:
                assert ours[rank][key] == ddp[rank][key], (rank, key)
    for key in (
        "predict_counts",
        "predict_iterable_counts",
        "validate_counts",
        "test_counts",
        "fit_counts",
    ):
        if key not in ours[0]:
            continue
        ddp_steps = [ddp[rank][key][0] for rank in range(WORLD_SIZE)]
        # The data is uneven: DDP's ranks ran different numbers of steps.
        assert ddp_steps[0] != ddp_steps[1], key
        for rank in range(WORLD_SIZE):
            our_steps, our_batch_ends = ours[rank][key]
            # Every rank ran the most steps any DDP rank ran, per dataloader (the joins) ...
            loaders = set(ddp_steps[0]) | set(ddp_steps[1])
            most = {k: max(steps.get(k, 0) for steps in ddp_steps) for k in loaders}
            assert our_steps == most, (key, rank, our_steps, ddp_steps)
            # ... while batch hooks ran for its real batches only, as under DDP.
            assert our_batch_ends == ddp[rank][key][1], (key, rank)
    # Our strategy joins uneven stages only (the DDP runs record nothing: no such attribute).
    assert all(ours[r]["joined"] == {True} for r in range(WORLD_SIZE))
    if "validate_even" in stages:
        assert all(ours[r]["joined_even"] == {False} for r in range(WORLD_SIZE))
    # Anti-vacuity: a rank with no batch of a dataloader, and real numbers compared.
    assert ddp[1]["predict_iterable"] == [[]] and len(ddp[0]["predict_iterable"][0]) == 2
    assert all(ours[r]["validate"][0]["val_loss/dataloader_idx_0"] > 0 for r in range(WORLD_SIZE))
    assert set(checked) >= {"predict", "validate"}


class IterStep(Tower):
    """Pulls its own batches (``dataloader_iter``): cannot be joined."""

    def validation_step(self, dataloader_iter: Iterator[Any]) -> None:  # type: ignore[override]
        batch, _, _ = next(dataloader_iter)
        self(batch[0])


class StepSync(Tower):
    """Syncs a logged value on every step: a joining rank cannot stand in for it."""

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:  # type: ignore[override]
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("val_loss", loss, on_step=True, on_epoch=False, sync_dist=True)


def _refused(rank: int, world_size: int, cls: type[Tower]) -> str:
    model = cls(own_parameter=False)
    loader = DataLoader(_rank_rows([3, 1], rank, seed=4), batch_size=1)
    trainer = _trainer(route_strategy("megatron_fsdp"), use_distributed_sampler=False)
    try:
        trainer.validate(model, loader, verbose=False)
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_uneven_batches_that_cannot_be_joined_raise_clear_errors() -> None:
    """``dataloader_iter`` steps: refused on every rank; a per-step sync: the joiner says why."""
    for message in run_distributed(_refused, WORLD_SIZE, IterStep, init_process_group=False):
        assert re.match(
            r"ValueError: MegatronFSDPStrategy: the validation dataloaders give ranks different "
            r"numbers of batches \(rank 0: \[3.0\], rank 1: \[1.0\]\), and a step that takes "
            r"`dataloader_iter` pulls its own batches and cannot be joined",
            message,
        ), message
    real, joiner = run_distributed(_refused, WORLD_SIZE, StepSync, init_process_group=False)
    assert re.match(
        r"RuntimeError: MegatronFSDPStrategy: self.log\(..., sync_dist=True, on_step=True\) in "
        r"validation_step syncs every step, but the ranks have different numbers of batches",
        joiner,
    ), joiner
    # Rank 0 waited in that sync; it learns that its peer stopped instead of hanging.
    assert re.match(r"RuntimeError: .*failed in a collective with the other ranks", real), real
