"""Train a small GPT with Megatron-FSDP through Lightning, checkpoint it, and resume it.

Runs on CPU with 2 processes by default (nothing to download: the data is generated
deterministically), and unchanged on GPUs::

    python examples/train_gpt.py                                   # 2 CPU processes
    python examples/train_gpt.py --max-steps 300 --ckpt-path last  # resume, train on
    python examples/train_gpt.py --accelerator gpu --devices 8 --precision bf16-true

The task: each sequence repeats a random pattern of 2-6 tokens. Once a model has seen one
period it can predict the rest, so next-token accuracy climbs from chance (1/32) towards
~80% within a couple of CPU minutes, and the loss falls visibly.

Outputs under ``--out`` (default ``runs/gpt``): ``checkpoints/`` (periodic + ``last.ckpt``,
each a Megatron-FSDP DCP directory), ``logs/`` (CSV metrics per run) and ``loss.png``: the
runs so far as one loss curve (a resumed run continues it), each resume point marked. A run
without ``--ckpt-path`` starts fresh: it deletes the checkpoints an earlier run left in
``checkpoints/`` (else Lightning would save beside them as ``last-v1.ckpt``).
"""

from __future__ import annotations

import argparse
import math
import shutil
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_only
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import MegatronFSDPStrategy


class RepeatedPatterns(Dataset):
    """Deterministic sequences that repeat a random 2-6 token pattern (seeded per index)."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        period = int(torch.randint(2, 7, (1,), generator=generator))
        pattern = torch.randint(0, self.vocab, (period,), generator=generator)
        return pattern.repeat(math.ceil((self.seq_len + 1) / period))[: self.seq_len + 1]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class GPT(pl.LightningModule):
    """Embedding, N blocks, and an output head tied to the embedding."""

    def __init__(
        self,
        vocab: int = 32,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        seq_len: int = 32,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(vocab, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(vocab, average="micro")
        self.embedding = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq_len, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embedding.weight  # tied: one parameter under two FQNs
        nn.init.normal_(self.embedding.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def _step(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return loss, logits.argmax(-1).flatten(), targets.flatten()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss, predictions, targets = self._step(batch)
        self.train_acc(predictions, targets)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.log("train_acc", self.train_acc, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        loss, predictions, targets = self._step(batch)
        self.val_acc(predictions, targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / 20)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class RecordStartStep(Callback):
    """Write the global step a run starts from (0, or the resumed checkpoint's step)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        log_dir = trainer.log_dir  # a collective (broadcast from rank 0): call it on every rank
        if trainer.is_global_zero and log_dir is not None:
            Path(log_dir, "start_step.txt").write_text(str(trainer.global_step))


def loss_curve(log_dir: Path) -> tuple[list[int], list[float], list[int]]:
    """One train-loss curve over every run under ``log_dir``, and where each resume began.

    Runs are read in version order. A run that started at step ``s`` (``start_step.txt``)
    continues the history from there, so it replaces the earlier runs' points at steps
    ``>= s`` (a resume from an older checkpoint re-trains those steps; a fresh run from 0
    starts the history over). What is left is one run of training, as an uninterrupted run
    would have logged it.

    Returns:
        ``(steps, losses, resumes)``: the curve in step order, and the steps at which a
        resumed run took over.
    """
    import csv

    points: dict[int, float] = {}
    resumes: list[int] = []
    versions = sorted(log_dir.glob("version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))
    for metrics in versions:
        with metrics.open() as handle:
            rows = [r for r in csv.DictReader(handle) if r.get("train_loss")]
        if not rows:
            continue
        start_file = metrics.parent / "start_step.txt"
        start = int(start_file.read_text()) if start_file.exists() else 0
        points = {step: loss for step, loss in points.items() if step < start}
        resumes = [step for step in resumes if step < start] + ([start] if start else [])
        points.update((int(r["step"]), float(r["train_loss"])) for r in rows)
    steps = sorted(points)
    return steps, [points[step] for step in steps], resumes


def plot_losses(log_dir: Path, output: Path) -> None:
    """Plot :func:`loss_curve` as one line, with a dashed marker where each resume began."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses, resumes = loss_curve(log_dir)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, losses, color="tab:blue", label="train loss")
    for start in resumes:
        axis.axvline(start, color="gray", linestyle="--", linewidth=1)
        axis.annotate(f" resumed @ step {start}", (start, max(losses)), fontsize=8)
    axis.set(xlabel="global step", ylabel="train loss", title="GPT on repeated patterns")
    axis.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=120)


@rank_zero_only
def clear_checkpoints(directory: Path) -> None:
    """Delete an earlier run's checkpoints before a fresh run (rank 0, before the others
    start), so that ``last.ckpt`` is this run's."""
    if directory.is_dir() and any(directory.iterdir()):
        print(f"starting fresh: deleting the earlier run's checkpoints in {directory}")
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="train steps")
    parser.add_argument(
        "--ckpt-path",
        default=None,
        help='"last" or a checkpoint directory: resume; none: start fresh (deletes checkpoints/)',
    )
    parser.add_argument("--out", type=Path, default=Path("runs/gpt"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=5, help="train steps")
    args = parser.parse_args()

    if args.ckpt_path is None:
        clear_checkpoints(args.out / "checkpoints")
    pl.seed_everything(args.seed, workers=True)
    model = GPT()
    # A resumable loader: Lightning saves its position in every checkpoint, so a resume in the
    # middle of an epoch continues with the next batch instead of replaying the epoch (a plain
    # DataLoader restarts it). With the RNG states the strategy checkpoints, the resumed run
    # trains exactly as an uninterrupted one would.
    with warnings.catch_warnings():  # torchdata calls torch's deprecated set_vital
        warnings.filterwarnings("ignore", "'set_vital' is deprecated", UserWarning, "torchdata")
        train = StatefulDataLoader(
            RepeatedPatterns(20_000, 32, 32, seed=1), batch_size=args.batch_size, shuffle=True
        )
    val = DataLoader(RepeatedPatterns(256, 32, 32, seed=2), batch_size=args.batch_size)
    checkpoints = ModelCheckpoint(
        dirpath=args.out / "checkpoints",
        filename="step={step}",
        auto_insert_metric_name=False,
        every_n_train_steps=args.checkpoint_every,
        save_top_k=-1,
        save_last=True,
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision,
        strategy=MegatronFSDPStrategy(auto_wrap_policy={Block}),
        max_steps=args.max_steps,
        val_check_interval=args.checkpoint_every,
        limit_val_batches=4,
        log_every_n_steps=args.log_every,
        callbacks=[checkpoints, TQDMProgressBar(refresh_rate=10), RecordStartStep()],
        logger=CSVLogger(args.out, name="logs"),
    )
    trainer.fit(model, train, val, ckpt_path=args.ckpt_path)
    if trainer.is_global_zero:
        plot_losses(args.out / "logs", args.out / "loss.png")
        print(f"checkpoints: {args.out / 'checkpoints'}   loss curve: {args.out / 'loss.png'}")


if __name__ == "__main__":
    main()
