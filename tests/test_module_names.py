"""Model summaries and profiler traces name sharded modules by the user's classes, as DDP does.

Upstream ``fully_shard`` gives every sharded module a generated ``ExperimentalFsdp<Name>``
class; the strategy gives each user class one shared FSDP class with the user's name and
module. Checked on a real ``Trainer.fit`` on 2 gloo ranks under ``strategy="ddp"`` and
under ``MegatronFSDPStrategy``: the ``ModelSummary`` callback's table and the module names
of Lightning's ``PyTorchProfiler`` (``[pl][module]<module>.<class>: <name>`` records in the
torch profiler's trace) are identical.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.profilers import PyTorchProfiler
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp.megatron._megatron import FsdpModule
from tests.harness import run_distributed
from tests.models import build_packed_lm, lm_loss, make_batch, make_trainer, route_strategy

WORLD_SIZE = 2


class NamedLM(pl.LightningModule):
    """A packed LM (policy units ``PackedBlock``) and a parameter of its own (a unit too)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_packed_lm(seed=0)
        self.temperature = nn.Parameter(torch.ones(1))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return lm_loss(lambda tokens: self.model(tokens) * self.temperature, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _fit(rank: int, world_size: int, route: str) -> dict[str, Any]:
    records = _Records()
    summary_log = logging.getLogger("lightning.pytorch.callbacks.model_summary")
    summary_log.addHandler(records)
    summary_log.setLevel(logging.INFO)
    pl.seed_everything(0, verbose=False)
    model = NamedLM()
    tokens, targets = zip(*(make_batch(seed, batch_size=1) for seed in range(8)), strict=True)
    profiler = PyTorchProfiler(record_module_names=True, export_to_chrome=False)
    trainer = make_trainer(
        world_size,
        route_strategy(route),
        max_steps=2,
        callbacks=[ModelSummary(max_depth=-1)],
        profiler=profiler,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.cat(tokens), torch.cat(targets)), 2))
    summary_log.removeHandler(records)
    events = profiler.function_events or []
    return {
        "summary": [m for m in records.messages if "Type" in m],
        "profiled_modules": sorted({e.name for e in events if e.name.startswith("[pl][module]")}),
        "classes": {
            name: (type(m).__module__, type(m).__qualname__, isinstance(m, FsdpModule))
            for name, m in model.named_modules()
        },
    }


def _both(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {route: _fit(rank, world_size, route) for route in ("ddp", "megatron_fsdp")}


def test_model_summary_and_profiler_show_user_class_names() -> None:
    results = run_distributed(_both, WORLD_SIZE, init_process_group=False, timeout=240)
    for rank, result in enumerate(results):
        ddp, ours = result["ddp"], result["megatron_fsdp"]
        # Sharded, with the user's class names and modules.
        assert ours["classes"][""] == ("tests.test_module_names", "NamedLM", True)
        assert ours["classes"]["model.blocks.0"] == ("tests.models", "PackedBlock", True)
        assert {name: c[:2] for name, c in ours["classes"].items()} == {
            name: c[:2] for name, c in ddp["classes"].items()
        }
        assert ours["profiled_modules"] == ddp["profiled_modules"]
        assert "[pl][module]tests.models.PackedBlock: model.blocks.1" in ours["profiled_modules"]
        if rank == 0:  # the summary is printed on rank 0 only
            (table,) = ours["summary"]
            assert table == ddp["summary"][0]
            assert "PackedBlock" in table and "ExperimentalFsdp" not in table
        else:
            assert ours["summary"] == ddp["summary"] == []
