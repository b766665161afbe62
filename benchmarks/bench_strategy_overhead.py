"""Benchmark 5: steps/s of ``Trainer.fit`` with ``MegatronFSDPStrategy`` vs a hand-written loop.

The strategy adds Lightning's loop machinery (hooks, closure, progress tracking) and its
own per-step work (``training_step`` run as the root unit's forward, the optimizer adapter,
the precision plugin) on top of what Megatron-FSDP itself costs. The reference is the
loop a user would write by hand over the very same sharded model and data: shard the
same units bottom-up with ``shard_module``, then ``loss = model(x, y)``, ``backward``,
``step``, ``zero_grad`` over a ``DistributedSampler`` loader.

Setup: :class:`OverheadModel`, a residual MLP regression model whose blocks are FSDP units
(``auto_wrap_policy={Block}`` for the strategy), Adam, 2 real ranks (gloo, CPU), per-rank
batch 32. Two sizes: "medium" (4.2 M parameters) and "small" (66 k parameters; compute is
negligible and the step is mostly Megatron-FSDP's per-unit collectives and Python, so it
shows the fixed per-step cost the strategy adds). Each run is a fresh process tree; the
two sides alternate A B A B, repeated. Steps/s is measured in steady state: from the end
of warm-up step ``WARMUP`` to the end of the last step (``on_train_batch_end`` for
Lightning, the same point in the hand loop), so data loading, hooks and everything between
steps is counted, and setup is not. Each run also reports its first losses, so both sides
provably train the same model on the same data.

Target (issue 6): the strategy's steps/s within 10% of the hand loop's.

Run: ``python -m benchmarks.bench_strategy_overhead [--quick] [--json PATH]`` from the repo
root.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from benchmarks.bench_save_load import bench_main, median
from lightning_megatron_fsdp import (
    MegatronFSDPStrategy,
    enable_cpu_execution,
    fsdp_placements,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.megatron._megatron import fully_shard_optimizer
from tests.harness import run_distributed

__all__ = ["Block", "OverheadModel", "format_table", "main", "run"]

BATCH = 32  # per rank
WARMUP = 5
LR = 1e-3
TIMEOUT = timedelta(seconds=60)
# name -> (width, depth, steps); steps include WARMUP.
SIZES: dict[str, tuple[int, int, int]] = {"medium": (512, 4, 45), "small": (64, 4, 125)}
QUICK_SIZES: dict[str, tuple[int, int, int]] = {"medium": (256, 2, 25)}
LOSSES_KEPT = 3


class Block(nn.Module):
    """One FSDP unit: ``x + W2 gelu(W1 x)``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        """Residual MLP update of ``x`` (batch, width)."""
        return x + self.down(nn.functional.gelu(self.up(x)))


class OverheadModel(pl.LightningModule):
    """Residual MLP regression: ``depth`` :class:`Block` units and a root-owned head.

    ``forward(x, y)`` returns the loss, so the hand loop calls the root unit exactly as
    the strategy runs ``training_step`` (as the root's forward).

    Args:
        width: Hidden and input size.
        depth: Number of blocks.
    """

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.losses: list[float] = []

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """Mean squared error of the prediction for ``x`` against ``y``."""
        for block in self.blocks:
            x = block(x)
        loss = nn.functional.mse_loss(self.head(x).squeeze(-1), y)
        if len(self.losses) < LOSSES_KEPT:
            self.losses.append(loss.item())
        return loss

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """The loss (see the class docstring)."""
        return self.loss(x, y)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        """The loss of one batch; no logging, as in the hand loop."""
        return self.loss(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """Adam, as in the hand loop."""
        return torch.optim.Adam(self.parameters(), lr=LR)


def _dataset(width: int, steps: int, world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    rows = BATCH * world_size * steps
    return TensorDataset(
        torch.randn(rows, width, generator=generator), torch.randn(rows, generator=generator)
    )


def _model(width: int, depth: int) -> OverheadModel:
    torch.manual_seed(0)
    return OverheadModel(width, depth)


class _StepClock(Callback):
    """Records ``time.perf_counter()`` at the end of every training batch."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        """Stamp the end of a step: after the optimizer step and every hook before this."""
        self.ends.append(time.perf_counter())


def _fit(rank: int, world_size: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    for name in ("lightning.pytorch", "lightning.fabric"):  # rank banners, tips
        logging.getLogger(name).setLevel(logging.ERROR)
    model = _model(width, depth)
    clock = _StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=MegatronFSDPStrategy(auto_wrap_policy={Block}, timeout=TIMEOUT),
        max_steps=steps,
        callbacks=[clock],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(_dataset(width, steps, world_size), batch_size=BATCH))
    return {"ends": clock.ends, "losses": model.losses}


def _hand_loop(rank: int, world_size: int, width: int, depth: int, steps: int) -> dict[str, Any]:
    enable_cpu_execution()
    model = _model(width, depth)
    mesh = init_device_mesh("cpu", (world_size,))
    placements = fsdp_placements()
    with sharding_scope():  # megatron-fsdp 0.7: a parent and its units share one context
        for block in model.blocks:
            shard_module(block, mesh, placements)
        shard_module(model, mesh, placements)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    fully_shard_optimizer(optimizer)
    dataset = _dataset(width, steps, world_size)
    # The sampler Lightning injects for training: shuffled, seed 0, epoch 0.
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    ends = []
    for x, y in DataLoader(dataset, batch_size=BATCH, sampler=sampler):
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
        if len(ends) == steps:
            break
    return {"ends": ends, "losses": model.losses}


def _steps_per_second(ranks: list[dict[str, Any]], steps: int) -> float:
    """Steady-state steps/s of the slowest rank."""
    rates = []
    for r in ranks:
        ends = r["ends"]
        if len(ends) != steps:
            raise RuntimeError(f"expected {steps} steps, a rank ran {len(ends)}")
        rates.append((steps - WARMUP) / (ends[-1] - ends[WARMUP - 1]))
    return min(rates)


def run(*, quick: bool = False, repeats: int = 5) -> dict[str, Any]:
    """Alternate fit and hand loop at world size 2; return steps/s medians and verdicts."""
    sizes = QUICK_SIZES if quick else SIZES
    result: dict[str, Any] = {"quick": quick, "repeats": repeats, "rows": []}
    for name, (width, depth, steps) in sizes.items():
        rates: dict[str, list[float]] = {"fit": [], "loop": []}
        losses: dict[str, list[float]] = {}
        for _ in range(repeats):
            for side, fn, init in (("loop", _hand_loop, True), ("fit", _fit, False)):
                ranks = run_distributed(
                    fn, 2, width, depth, steps, init_process_group=init, timeout=600
                )
                rates[side].append(_steps_per_second(ranks, steps))
                losses[side] = ranks[0]["losses"]
        fit, loop = median(rates["fit"]), median(rates["loop"])
        same = torch.allclose(
            torch.tensor(losses["fit"]), torch.tensor(losses["loop"]), rtol=1e-5, atol=1e-6
        )
        parameters = sum(p.numel() for p in OverheadModel(width, depth).parameters())
        result["rows"].append(
            {
                "size": name,
                "parameters": parameters,
                "steps": steps,
                "fit_steps_s": fit,
                "loop_steps_s": loop,
                "fit_over_loop": fit / loop,
                "overhead_ms": (1 / fit - 1 / loop) * 1e3,
                "met": fit / loop >= 0.9,
                "same_losses": bool(same),
                "losses": losses,
                "rates": rates,
            }
        )
    return result


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s result."""
    lines = [
        f"World size 2, per-rank batch {BATCH}, Adam; steady-state steps/s (after {WARMUP} "
        f"warm-up steps), median of {result['repeats']} alternating runs per side.",
        "",
        "| model | parameters | steps | hand loop steps/s | Trainer.fit steps/s | fit / loop "
        "| added per step (ms) | same losses | target (>= 0.90) |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['size']} | {row['parameters'] / 1e6:.3f} M | {row['steps']} "
            f"| {row['loop_steps_s']:.1f} | {row['fit_steps_s']:.1f} "
            f"| {row['fit_over_loop']:.3f} | {row['overhead_ms']:+.2f} "
            f"| {'yes' if row['same_losses'] else 'NO'} | {'met' if row['met'] else 'NOT met'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the result as JSON."""
    return bench_main(__doc__, run, format_table, "one small model, few steps", argv)


if __name__ == "__main__":
    sys.exit(main())
