"""Train a tiny model with ``MegatronFSDPStrategy`` on 2 CPU processes; each rank reports.

Launched two ways by ``tests/test_strategy_launch.py``, which compares the reports::

    python tests/scripts/strategy_fit.py OUT_DIR                              # Lightning
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/scripts/strategy_fit.py OUT_DIR                                 # torchrun

With ``devices=2`` Lightning's launcher re-runs this script for rank 1; under torchrun
Lightning detects the external launcher (``TorchElasticEnvironment``). Each rank writes
``OUT_DIR/rank<r>.json``: its cluster environment, the globally averaged losses, and its
local shard of every parameter with the shard's first row. The test trains the same
``Model`` on the same :func:`dataset` in one plain process and compares.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import MegatronFSDPStrategy, chunk_metadata_by_fqn

LR = 0.05
BATCH = 2  # per rank
STEPS = 3


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.lin(x))


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block(5, 7)
        self.head = nn.Linear(7, 3)
        self.losses: list[float] = []

    def loss(self, batch: list[Tensor]) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.b1(x)), y)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        loss = self.loss(batch)
        self.losses.append(float(self.trainer.strategy.reduce(loss.detach())))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=LR)


def dataset() -> TensorDataset:
    """12 rows: 3 steps of 2 rows on each of 2 ranks."""
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(12, 5, generator=generator), torch.randn(12, 3, generator=generator)
    )


def main(out_dir: Path) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    model = Model()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MegatronFSDPStrategy(auto_wrap_policy={Block}, timeout=timedelta(seconds=60)),
        max_steps=STEPS,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=BATCH))
    rank = trainer.global_rank
    report = {
        "rank": rank,
        "world_size": trainer.world_size,
        "environment": type(trainer.strategy.cluster_environment).__name__,
        "losses": model.losses,
        "shards": {
            name: parameter._local_tensor.tolist() for name, parameter in model.named_parameters()
        },
        "first_rows": {name: int(c.offsets[0]) for name, c in chunk_metadata_by_fqn(model).items()},
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
