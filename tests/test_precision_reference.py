"""Low-precision training computes what a same-precision single process computes.

``bf16-true`` and ``16-true`` mean: compute weights in bf16/fp16 rounded from fp32 main
weights, forward and backward in that dtype, gradients averaged across ranks in that dtype
(megatron-fsdp reduce-scatters the compute-dtype gradients), the optimizer stepping the
fp32 main weights. The reference below does exactly that in one process with plain torch:
fp32 masters, a compute copy cast from them each step, one backward per rank's batch, the
ranks' gradients averaged in the compute dtype, AdamW on the masters. Two ranks (so the
average is one rounding, as in the reduce-scatter), ``tests.models.PackedLM`` (packed
uneven shards, a tied embedding), the real ``Trainer``. Every step's loss on every rank and
the final logits must agree bit for bit; a reference whose main weights are kept in the
compute dtype, or that computes in fp32, is off by more than 1e-3 (checked).

``bf16-mixed`` (fp32 weights, bf16 autocast): the first loss equals a plain autocast
forward's, and a run resumed from a mid-epoch checkpoint reproduces the uninterrupted
run's losses and weights bit for bit. ``16-mixed`` on CPU is turned into ``bf16-mixed`` by
Lightning before any strategy sees it; the CUDA plugin it becomes on a GPU is refused.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import Tensor, nn
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import MegatronFSDPStrategy
from tests.harness import run_distributed
from tests.models import build_packed_lm, lm_loss, make_batch, make_trainer, sequence_loader

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

WORLD_SIZE = 2
STEPS = 4
LR = 0.01
PROBE = make_batch(99, batch_size=2, seq_len=5)[0]
DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


class LitPacked(pl.LightningModule):
    """PackedLM as ``self.model``; records each step's batch and loss."""

    def __init__(self) -> None:
        super().__init__()
        self.model = build_packed_lm(0)
        self.records: dict[int, dict[str, Tensor]] = {}

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (sequences,) = batch
        loss = lm_loss(self.model, (sequences[:, :-1], sequences[:, 1:]))
        self.records[self.global_step] = {"batch": sequences.clone(), "loss": loss.detach()}
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _loader() -> StatefulDataLoader:
    return sequence_loader(8, rows=2 * WORLD_SIZE * 2)


def _trainer(precision: str, root: Path, **kwargs: Any) -> pl.Trainer:
    options = {"precision": precision, "max_steps": STEPS, "default_root_dir": root}
    return make_trainer(WORLD_SIZE, **{**options, **kwargs})


def _probe(model: LitPacked, dtype: torch.dtype = torch.float32) -> Tensor:
    with torch.no_grad(), _default_dtype(dtype):
        return model.model(PROBE).float().clone()


def _fit_precisions(rank: int, world_size: int, root: str) -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for precision, dtype in DTYPES.items():
        pl.seed_everything(0, verbose=False)
        model = LitPacked()
        _trainer(precision, Path(root)).fit(model, _loader())
        facts[precision] = {"records": model.records, "logits": _probe(model, dtype)}
    # bf16-mixed: uninterrupted, then resumed from the mid-epoch step-3 checkpoint.
    pl.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(
        dirpath=Path(root), filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    full = LitPacked()
    trainer = _trainer("bf16-mixed", Path(root), max_steps=6, callbacks=[saver])
    trainer.fit(full, _loader())
    resumed = LitPacked()
    trainer = _trainer("bf16-mixed", Path(root), max_steps=6)
    trainer.fit(resumed, _loader(), ckpt_path=Path(root, "step=3.ckpt"))
    facts["bf16-mixed"] = {
        "full": full.records,
        "resumed": resumed.records,
        "full_logits": _probe(full),
        "resumed_logits": _probe(resumed),
    }
    return facts


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def reference_run(
    batches: list[list[Tensor]], dtype: torch.dtype, *, masters_dtype: torch.dtype = torch.float32
) -> tuple[list[list[Tensor]], nn.Module]:
    """Single-process ``-true`` training: per-rank backward in ``dtype``, averaged, AdamW.

    Args:
        batches: ``batches[step][rank]``, the sequences each rank trained on.
        dtype: Compute dtype.
        masters_dtype: Dtype of the weights the optimizer steps (fp32 is what the
            strategy promises; another value builds the counterexample).

    Returns:
        Each step's per-rank losses, and the final compute model.
    """
    masters = build_packed_lm(0).to(masters_dtype)
    optimizer = torch.optim.AdamW(masters.parameters(), lr=LR)
    compute = copy.deepcopy(masters).to(dtype)
    losses = []
    for step_batches in batches:
        with torch.no_grad():
            for copy_, master in zip(compute.parameters(), masters.parameters(), strict=True):
                copy_.copy_(master)
        grads: list[list[Tensor]] = []
        step_losses = []
        for sequences in step_batches:
            compute.zero_grad()
            with _default_dtype(dtype):
                loss = lm_loss(compute, (sequences[:, :-1], sequences[:, 1:]))
            loss.backward()
            step_losses.append(loss.detach())
            grads.append([p.grad.clone() for p in compute.parameters()])
        for master, *rank_grads in zip(masters.parameters(), *grads, strict=True):
            total = rank_grads[0]
            for grad in rank_grads[1:]:
                total = total + grad  # in the compute dtype, as the reduce-scatter sums
            master.grad = (total / len(rank_grads)).to(masters_dtype)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_losses)
    with torch.no_grad():
        for copy_, master in zip(compute.parameters(), masters.parameters(), strict=True):
            copy_.copy_(master)
    return losses, compute


def test_low_precision_training_matches_same_precision_reference(tmp_path: Path) -> None:
    """bf16-true / 16-true vs a single-process reference; bf16-mixed resumes bit-exactly."""
    results = run_distributed(
        _fit_precisions, WORLD_SIZE, str(tmp_path), init_process_group=False, timeout=240
    )
    for precision, dtype in DTYPES.items():
        batches = [
            [results[r][precision]["records"][s]["batch"] for r in range(WORLD_SIZE)]
            for s in range(STEPS)
        ]
        reference_losses, reference = reference_run(batches, dtype)
        with torch.no_grad(), _default_dtype(dtype):
            expected = reference(PROBE).float()
        # The same arithmetic in the same order: equal to the bit.
        for rank in range(WORLD_SIZE):
            facts = results[rank][precision]
            for step in range(STEPS):
                torch.testing.assert_close(
                    facts["records"][step]["loss"],
                    reference_losses[step][rank],
                    rtol=0,
                    atol=0,
                    msg=f"{precision}, rank {rank}, step {step}",
                )
            torch.testing.assert_close(facts["logits"], expected, rtol=0, atol=0, msg=precision)
        # What the comparison rules out: main weights kept in the compute dtype (small
        # AdamW updates rounded away), or computing in fp32 instead.
        for masters_dtype, compute_dtype in ((dtype, dtype), (torch.float32, torch.float32)):
            _, wrong = reference_run(batches, compute_dtype, masters_dtype=masters_dtype)
            with torch.no_grad(), _default_dtype(compute_dtype):
                off = (wrong(PROBE).float() - expected).abs().max()
            # (fp16 masters even turn NaN: AdamW's eps underflows in fp16.)
            assert not bool(off <= 1e-3), (precision, masters_dtype, compute_dtype, off)

    for rank in range(WORLD_SIZE):
        mixed = results[rank]["bf16-mixed"]
        assert sorted(mixed["resumed"]) == [3, 4, 5]
        for step, record in mixed["resumed"].items():
            torch.testing.assert_close(
                record["loss"], mixed["full"][step]["loss"], rtol=0, atol=0, msg=f"step {step}"
            )
        torch.testing.assert_close(mixed["resumed_logits"], mixed["full_logits"], rtol=0, atol=0)
        # bf16 autocast really ran: the first loss (initial weights) is the autocast
        # forward's, which differs from the fp32 forward's.
        sequences = mixed["full"][0]["batch"]
        batch = (sequences[:, :-1], sequences[:, 1:])
        initial = build_packed_lm(0)
        with torch.no_grad():
            fp32 = lm_loss(initial, batch)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                autocast = lm_loss(initial, batch)
        torch.testing.assert_close(mixed["full"][0]["loss"], autocast, rtol=0, atol=0)
        assert not torch.equal(autocast, fp32)


def test_16_mixed_runs_as_bf16_mixed_on_cpu_and_is_refused_for_cuda() -> None:
    """The README's 16-mixed row: Lightning converts it on CPU; the CUDA plugin is refused."""
    with pytest.warns(UserWarning, match=r"precision='16-mixed'.*Using `precision='bf16-mixed'`"):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            precision="16-mixed",
            strategy=MegatronFSDPStrategy(),
            logger=False,
        )
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
    # On a GPU, Trainer(precision="16-mixed") hands the strategy this plugin (its scaler
    # disabled here: built enabled on a machine without CUDA, it warns that it disables itself).
    plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", enabled=False))
    with pytest.raises(ValueError, match=r"'16-mixed' is not supported.*loss scaler"):
        MegatronFSDPStrategy(precision_plugin=plugin)
