"""The README's unit rules for tied parameters, and the ``sync_batchnorm`` refusal.

* Two top-level submodules of the LightningModule that share a tied parameter stay
  together in the LightningModule's unit (neither becomes a unit of its own, which would
  split the tie); an untied sibling still becomes its own unit.
* A tie split across units by the ``auto_wrap_policy`` raises on every rank, naming the
  parameter and the fix, before anything trains.
* ``Trainer(sync_batchnorm=True)`` is refused with a clear error on every rank.

The unit choice is checked twice: by :func:`plan_units` alone (no process group), and in a
real 2-rank ``Trainer.fit``, where the tie must also survive training (one parameter under
both names, equal to an unsharded model trained on the same batches).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.megatron._megatron import FsdpModule
from lightning_megatron_fsdp.megatron.sharding import plan_units
from tests.harness import run_distributed
from tests.models import VOCAB, PackedBlock, make_batch, make_trainer

TIMEOUT = 180.0
STEPS = 2
BATCH = 2


class _TopLevelTie(pl.LightningModule):
    """``embed`` and ``head`` (top-level, tied) and an untied ``body``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 6)
        self.body = PackedBlock()
        nn.init.normal_(self.body.mix)
        nn.init.normal_(self.body.gain)
        self.head = nn.Linear(6, VOCAB)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.body(self.embed(tokens)))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        tokens, targets = batch
        return nn.functional.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _SplitTie(_TopLevelTie):
    """Two policy units (``PackedBlock``\\ s) that share ``fc.weight``."""

    def __init__(self) -> None:
        super().__init__()
        self.other = PackedBlock()
        self.other.fc.weight = self.body.fc.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.other(self.body(self.embed(tokens))))


def test_plan_keeps_a_top_level_tie_in_the_root_unit() -> None:
    model = _TopLevelTie()
    assert list(plan_units(model, None)) == [model.body, model]


def _data(world_size: int) -> DataLoader:
    tokens, targets = make_batch(5, batch_size=BATCH * world_size * STEPS, seq_len=5)
    return DataLoader(TensorDataset(tokens, targets), batch_size=BATCH)


def _trainer(world_size: int, policy: Any = None, **kwargs: Any) -> pl.Trainer:
    strategy = MegatronFSDPStrategy(auto_wrap_policy=policy)
    return make_trainer(world_size, strategy, max_steps=STEPS, **kwargs)


def _outcome(action: Any) -> str:
    try:
        action()
    except ValueError as err:
        return f"ValueError: {err}"
    return "no error"


def _rules(rank: int, world_size: int) -> dict[str, Any]:
    model = _TopLevelTie()
    _trainer(world_size).fit(model, _data(world_size))
    result: dict[str, Any] = {
        "units": {n: isinstance(m, FsdpModule) for n, m in model.named_children()},
        "root_unit": isinstance(model, FsdpModule),
        "tied": model.head.weight is model.embed.weight,
        "embed": model.embed.weight.full_tensor().detach().clone(),
    }
    split = _SplitTie()
    result["split"] = _outcome(
        lambda: _trainer(world_size, {PackedBlock}).fit(split, _data(world_size))
    )
    result["sync_batchnorm"] = _outcome(
        lambda: _trainer(world_size, sync_batchnorm=True).fit(_TopLevelTie(), _data(world_size))
    )
    return result


def test_tie_rules_and_the_sync_batchnorm_refusal_in_a_real_fit() -> None:
    results = run_distributed(_rules, 2, timeout=TIMEOUT, init_process_group=False)
    # The unsharded reference: the same model and batches, in one process.
    reference = _TopLevelTie()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens, targets = make_batch(5, batch_size=BATCH * 2 * STEPS, seq_len=5)
    # Each rank's rows, as Lightning's DistributedSampler deals them (shuffled, seed 0).
    per_rank = [list(DistributedSampler(range(len(tokens)), 2, r, seed=0)) for r in range(2)]
    for step in range(STEPS):
        rows = [i for dealt in per_rank for i in dealt[step * BATCH : (step + 1) * BATCH]]
        loss = reference.training_step([tokens[rows], targets[rows]], step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for result in results:
        # body is its own unit; embed and head (tied) are not: the root unit holds them.
        assert result["root_unit"]
        assert result["units"] == {"embed": False, "body": True, "head": False}
        assert result["tied"]
        torch.testing.assert_close(
            result["embed"], reference.embed.weight.detach(), rtol=0, atol=1e-6
        )
        assert result["split"].startswith("ValueError: shard_module: parameter 'fc.weight'"), result
        assert "is tied to a parameter already sharded in another FSDP unit" in result["split"]
        assert "A tie must live in one unit" in result["split"]
        assert "does not support Trainer(sync_batchnorm=True)" in result["sync_batchnorm"], result
