"""Fit (or resume) a tiny model under an external launcher; each rank reports as JSON.

Launched by ``tests/test_multinode.py`` as two single-process "nodes" (torchrun-style or
SLURM-style environment variables, so ``LOCAL_RANK`` differs from ``RANK`` and each node
has its own local rank 0), then resumed on one node with two processes (torchrun) or on
the same two nodes (SLURM)::

    python tests/scripts/multinode_fit.py OUT_DIR NUM_NODES DEVICES MAX_STEPS [last]

Each rank writes ``OUT_DIR/<tag>-rank<r>.json``: the ranks Lightning saw, the probe output
at the start and end of training, and the global step. The same script, run for all the
steps at once, is the uninterrupted run a resume is compared with.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import MegatronFSDPStrategy

PROBE = torch.linspace(-1, 1, 10).reshape(2, 5)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
        self.probes: dict[str, list[list[float]]] = {}

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def _probe(self, name: str) -> None:
        with torch.no_grad():
            self.probes[name] = self.net(PROBE).tolist()

    def on_train_start(self) -> None:
        self._probe("start")

    def on_train_end(self) -> None:
        self._probe("end")


def main(out: Path, num_nodes: int, devices: int, max_steps: int, ckpt_path: str | None) -> None:
    torch.manual_seed(0)  # every rank starts from the same weights
    data = TensorDataset(torch.randn(64, 5), torch.randn(64, 3))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=num_nodes,
        strategy=MegatronFSDPStrategy(),
        max_steps=max_steps,
        callbacks=[
            ModelCheckpoint(dirpath=out / "checkpoints", every_n_train_steps=2, save_last=True)
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Model()
    # Resumable: a resume continues mid-epoch, as the uninterrupted run does.
    trainer.fit(model, StatefulDataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    strategy = trainer.strategy
    tag = "resume" if ckpt_path else "fit"
    report = {
        "environment": type(strategy.cluster_environment).__name__,
        "global_rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "probes": model.probes,
    }
    (out / f"{tag}-rank{trainer.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(
        Path(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        int(sys.argv[4]),
        sys.argv[5] if len(sys.argv) > 5 else None,
    )
