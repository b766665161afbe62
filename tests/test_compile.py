"""``torch.compile`` of Megatron-FSDP units: one graph for identical layers, and exact resume.

Real ranks, the real ``Trainer`` and ``MegatronFSDPStrategy``, real checkpoints. The
LightningModule shards each of the 4 identical ``PackedBlock`` layers of a
``tests.models.PackedLM`` in ``configure_model`` and compiles it right after
(``block.compile()``, the per-layer pattern), with dynamo's ``CompileCounterWithBackend``
around the ``aot_eager`` backend (forward and backward traced by AOTAutograd, eager
kernels: fast to compile on CPU) counting every frame dynamo compiles.

* Four identical layers compile one frame, over a fit and a resumed fit (and one more
  for forwards under ``no_grad``, a guard on grad mode). Megatron-FSDP
  gives each unit its own class and its hooks read the unit's name, either of which makes
  dynamo compile every layer again (the control below shows the counter sees that).
* A run resumed from a mid-epoch checkpoint computes the same losses and final logits as
  the uninterrupted run, bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import MegatronFSDPStrategy
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import (
    build_packed_lm,
    dp_mesh,
    lm_loss,
    make_batch,
    make_trainer,
    sequence_loader,
    shard_packed_lm,
)

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

BLOCKS = 4
STEPS = 6
RESUME = 3  # mid-epoch 1 (2 batches per epoch per rank)
PROBE = make_batch(99, batch_size=2, seq_len=5)[0]


class CompiledLM(pl.LightningModule):
    """PackedLM whose blocks are sharded and compiled one by one in ``configure_model``."""

    def __init__(self, backend: Any) -> None:
        super().__init__()
        self.model = build_packed_lm(0, num_blocks=BLOCKS)
        self.backend = backend
        self.losses: dict[int, Tensor] = {}

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        assert isinstance(strategy, MegatronFSDPStrategy)
        for block in self.model.blocks:
            strategy.shard(block)
            block.compile(backend=self.backend)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (sequences,) = batch
        loss = lm_loss(self.model, (sequences[:, :-1], sequences[:, 1:]))
        self.losses[self.global_step] = loss.detach().clone()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def _loader() -> StatefulDataLoader:
    return sequence_loader(4, rows=8)


def _trainer(world_size: int, root: Path, **kwargs: Any) -> pl.Trainer:
    strategy = MegatronFSDPStrategy(timeout=PROCESS_GROUP_TIMEOUT)
    return make_trainer(world_size, strategy, max_steps=STEPS, default_root_dir=root, **kwargs)


def _probe(model: CompiledLM) -> Tensor:
    with torch.no_grad():
        return model.model(PROBE).clone()


def _compile_fit_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    saver = ModelCheckpoint(
        dirpath=Path(root), filename="{step}", every_n_train_steps=RESUME, save_top_k=-1
    )
    full = CompiledLM(counter)
    _trainer(world_size, Path(root), callbacks=[saver]).fit(full, _loader())
    frames_after_fit = counter.frame_count
    resumed = CompiledLM(counter)
    _trainer(world_size, Path(root)).fit(
        resumed, _loader(), ckpt_path=Path(root, f"step={RESUME}.ckpt")
    )
    facts = {
        "frames_after_fit": frames_after_fit,
        "frames_after_resume": counter.frame_count,
        "full": full.losses,
        "full_probe": _probe(full),
        "resumed": resumed.losses,
        "resumed_probe": _probe(resumed),
        "frames_with_no_grad": counter.frame_count,
        "classes": sorted({type(b).__name__ for b in full.model.blocks}),
    }
    # Control: the counter sees a recompile per layer when each layer has its own class,
    # as megatron-fsdp builds them.
    torch._dynamo.reset()
    control = build_packed_lm(0, num_blocks=BLOCKS)
    shard_packed_lm(control, dp_mesh(world_size))
    eager_counter = CompileCounter()
    for index, block in enumerate(control.blocks):
        block.__class__ = type(f"ExperimentalFsdpPackedBlock{index}", (type(block),), {})
        block.compile(backend=eager_counter)
    lm_loss(control, make_batch(1)).backward()
    facts["control_frames"] = eager_counter.frame_count
    return facts


def test_identical_compiled_layers_share_one_graph_and_resume_exactly(tmp_path: Path) -> None:
    """4 identical compiled layers: 1 frame over two fits; resumed losses are bit-exact."""
    results = run_distributed(
        _compile_fit_resume, 2, str(tmp_path), init_process_group=False, timeout=240
    )
    for rank, facts in enumerate(results):
        assert facts["classes"] == ["PackedBlock"], rank
        assert facts["frames_after_fit"] == 1, facts
        assert facts["frames_after_resume"] == 1, facts  # the resumed model reuses it
        assert facts["frames_with_no_grad"] == 2, facts  # + one no_grad graph for all 4
        assert facts["control_frames"] == BLOCKS, facts
        assert sorted(facts["full"]) == list(range(STEPS))
        assert sorted(facts["resumed"]) == list(range(RESUME, STEPS))
        for step, loss in facts["resumed"].items():
            torch.testing.assert_close(
                loss, facts["full"][step], rtol=0, atol=0, msg=f"rank {rank}, step {step}"
            )
        torch.testing.assert_close(facts["resumed_probe"], facts["full_probe"], rtol=0, atol=0)
