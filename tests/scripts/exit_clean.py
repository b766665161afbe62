"""Fit with periodic async checkpoints, use the model after fit, save again, and exit.

Run by ``tests/test_exit.py`` many times over: every process must exit 0, with no
"terminate called without an active exception" at interpreter exit::

    python tests/scripts/exit_clean.py OUT_DIR

Lightning's launcher (``devices=2``) re-runs this script for rank 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_megatron_fsdp import MegatronFSDPCheckpointIO, MegatronFSDPStrategy


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 5), torch.randn(32, 3))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=MegatronFSDPStrategy(checkpoint_io=MegatronFSDPCheckpointIO(async_save=True)),
        max_steps=4,
        callbacks=[ModelCheckpoint(dirpath=out, every_n_train_steps=2, save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    trainer.fit(model, DataLoader(data, batch_size=4))
    with torch.no_grad():
        model.net(torch.zeros(1, 5))  # the model is usable after fit
    trainer.save_checkpoint(out / "after_fit.ckpt")
    print(f"finished rank {trainer.global_rank}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
