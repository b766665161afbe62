"""Hugging Face ``transformers`` models, as a new user would train them.

Real ranks (``tests.harness``), the real ``Trainer`` and ``MegatronFSDPStrategy`` with
``auto_wrap_policy`` set to the model's decoder-layer class, models built from tiny
configs (no hub access): a Llama (untied head) and a GPT-2 (``lm_head`` tied to ``wte``,
dropout 0.1 everywhere, as GPT-2's defaults). The LightningModule holds the model as
``self.model``, so the strategy shards it as its own root unit and ``self.model(...)`` and
``self.model.generate(...)`` work from any hook.

* Llama, 3 ranks (odd sizes split unevenly), activation checkpointing on: every step's
  loss on every rank and the final logits equal a single-process fp32 reference (plain
  torch, no checkpointing, the same per-rank batches, gradients averaged) within 1e-5.
* GPT-2, 2 ranks, dropout on, activation checkpointing on, a ``StatefulDataLoader``, a
  callback that samples text with ``generate()`` at each validation: an uninterrupted run
  and a run resumed mid-epoch 1 from its checkpoint agree bit for bit on every later
  batch and loss, on the final logits, and on the text sampled after the resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.megatron._megatron import FsdpModule
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import make_trainer

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

VOCAB = 64
SEQ_LEN = 8
BATCH = 2  # per rank
LR = 0.01
PROBE = torch.arange(2 * SEQ_LEN).remainder(VOCAB).view(2, SEQ_LEN)
DECODER_LAYERS = (LlamaDecoderLayer, GPT2Block)


def llama_config() -> LlamaConfig:
    """2 layers, hidden 32, grouped-query attention (4 heads, 2 key/value heads)."""
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN,
        tie_word_embeddings=False,
    )


def gpt2_config() -> GPT2Config:
    """2 layers, hidden 32, GPT-2's default dropout (0.1) and tied ``wte``/``lm_head``."""
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=2 * SEQ_LEN,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )


def build(name: str) -> nn.Module:
    """The model ``name`` with seeded initial weights (bit-identical on every rank)."""
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(llama_config())
    return GPT2LMHeadModel(gpt2_config())


def token_data(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(2, VOCAB, (samples, SEQ_LEN), generator=generator))


class LitCausalLM(pl.LightningModule):
    """A Hugging Face causal LM as ``self.model``; records each step's batch and loss."""

    def __init__(self, name: str, checkpointing: bool) -> None:
        super().__init__()
        self.model = build(name)
        if checkpointing:
            # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias).
            enable = getattr(self.model, "activation_checkpointing_enable", None)
            (enable or self.model.gradient_checkpointing_enable)()
        self.records: dict[int, dict[str, Tensor]] = {}
        self.samples: list[Tensor] = []
        # Calls of a module inside the first decoder layer during training: two per step
        # (the forward and its recompute in backward) when activation checkpointing really
        # runs. (transformers checkpoints the layer's forward, not its hooks.)
        self.layer_calls = 0
        self.layer_calls_in_training = 0
        first_layer = next(m for m in self.model.modules() if isinstance(m, DECODER_LAYERS))
        next(first_layer.children()).register_forward_pre_hook(self._count_layer_call)

    def _count_layer_call(self, module: nn.Module, args: Any) -> None:
        self.layer_calls += 1

    def on_train_end(self) -> None:
        self.layer_calls_in_training = self.layer_calls

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.records[self.global_step] = {"batch": tokens.clone(), "loss": loss.detach().clone()}
        return loss

    def validation_step(self, batch: list[Tensor], batch_idx: int) -> None:
        (tokens,) = batch
        self.log("val_loss", self.model(input_ids=tokens, labels=tokens).loss, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


class SampleText(Callback):
    """Samples from the model with ``generate()`` at the end of every validation run."""

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            # synced_gpus: every rank runs max_new_tokens forwards (each is a collective),
            # whatever any rank sampled.
            tokens = pl_module.model.generate(  # type: ignore[union-attr,operator]
                PROBE[:1, :3], max_new_tokens=4, do_sample=True, synced_gpus=True
            )
        pl_module.samples.append(tokens)  # type: ignore[union-attr,operator]


def _trainer(world_size: int, root: Path, policy: type[nn.Module], **kwargs: Any) -> pl.Trainer:
    strategy = MegatronFSDPStrategy(auto_wrap_policy={policy}, timeout=PROCESS_GROUP_TIMEOUT)
    options = {"num_sanity_val_steps": 0, "default_root_dir": root}
    return make_trainer(world_size, strategy, **{**options, **kwargs})


def _logits(model: nn.Module) -> Tensor:
    """Logits for ``PROBE`` in eval mode (no dropout)."""
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits.clone()


# ---------------------------------------------------------------------- Llama vs reference

LLAMA_STEPS = 4


def _fit_llama(rank: int, world_size: int, root: str) -> dict[str, Any]:
    model = LitCausalLM("llama", checkpointing=True)
    data = StatefulDataLoader(
        token_data(BATCH * world_size * LLAMA_STEPS, seed=1), batch_size=BATCH
    )
    trainer = _trainer(world_size, Path(root), LlamaDecoderLayer, max_steps=LLAMA_STEPS)
    trainer.fit(model, data)
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FsdpModule))
    return {
        "records": model.records,
        "logits": _logits(model.model),
        "units": units,
        "layer_calls": model.layer_calls_in_training,
    }


def test_llama_trains_like_a_single_process_reference(tmp_path: Path) -> None:
    """3 ranks, activation checkpointing: losses and final logits match plain torch (1e-5)."""
    world_size = 3
    results = run_distributed(_fit_llama, world_size, str(tmp_path), init_process_group=False)
    assert results[0]["units"] == ["model", "model.model.layers.0", "model.model.layers.1"]
    for facts in results:  # activation checkpointing recomputed every layer in backward
        assert facts["layer_calls"] == 2 * LLAMA_STEPS, facts["layer_calls"]
    reference = build("llama")
    optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    for step in range(LLAMA_STEPS):
        optimizer.zero_grad()
        losses = []
        for rank in range(world_size):
            batch = results[rank]["records"][step]["batch"]
            losses.append(reference(input_ids=batch, labels=batch).loss)
        (sum(losses) / world_size).backward()  # what averaging gradients over ranks computes
        optimizer.step()
        for rank, loss in enumerate(losses):
            got = results[rank]["records"][step]["loss"]
            torch.testing.assert_close(got, loss.detach(), rtol=0, atol=1e-5, msg=f"step {step}")
    expected = _logits(reference)
    for rank, facts in enumerate(results):
        torch.testing.assert_close(facts["logits"], expected, rtol=0, atol=1e-5, msg=f"rank {rank}")
    # Training moved the weights well beyond the tolerance: the comparison is not vacuous.
    assert (expected - _logits(build("llama"))).abs().max() > 1e-2


# ---------------------------------------------------------------------- GPT-2 resume

GPT2_STEPS = 9  # 4 batches per epoch: step 6 is mid-epoch 1; validation after steps 3, 6, 9
GPT2_RESUME = 6


def _gpt2_trainer(world_size: int, root: Path, **kwargs: Any) -> pl.Trainer:
    return _trainer(
        world_size,
        root,
        GPT2Block,
        max_steps=GPT2_STEPS,
        val_check_interval=3,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        callbacks=[SampleText(), *kwargs.pop("callbacks", [])],
        **kwargs,
    )


def _gpt2_loaders(world_size: int) -> tuple[StatefulDataLoader, StatefulDataLoader]:
    train = StatefulDataLoader(
        token_data(BATCH * world_size * 4, 2), batch_size=BATCH, shuffle=True
    )
    return train, StatefulDataLoader(token_data(BATCH * world_size, 3), batch_size=BATCH)


def _fit_and_resume_gpt2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    saver = ModelCheckpoint(
        dirpath=Path(root, "checkpoints"), filename="{step}", every_n_train_steps=3, save_top_k=-1
    )
    full = LitCausalLM("gpt2", checkpointing=True)
    trainer = _gpt2_trainer(world_size, Path(root), callbacks=[saver])
    trainer.fit(full, *_gpt2_loaders(world_size))
    resumed = LitCausalLM("gpt2", checkpointing=True)
    with torch.no_grad():
        for parameter in resumed.parameters():
            parameter.zero_()  # the checkpoint must restore every weight
    path = Path(root, "checkpoints", f"step={GPT2_RESUME}.ckpt")
    trainer = _gpt2_trainer(world_size, Path(root))
    trainer.fit(resumed, *_gpt2_loaders(world_size), ckpt_path=path)
    return {
        "full": full.records,
        "full_logits": _logits(full.model),
        "full_samples": full.samples,
        "resumed": resumed.records,
        "resumed_logits": _logits(resumed.model),
        "resumed_samples": resumed.samples,
        "tied": full.model.lm_head.weight is full.model.transformer.wte.weight,
    }


def test_gpt2_with_dropout_resumes_mid_epoch_bit_exactly(tmp_path: Path) -> None:
    """Dropout 0.1, checkpointing, generate() in validation: resumed steps equal the original."""
    reference = build("gpt2").train()
    batch = token_data(2, 2).tensors[0]
    # Dropout is active in training mode: two forwards differ, so random streams matter.
    assert not torch.equal(reference(input_ids=batch).logits, reference(input_ids=batch).logits)

    results = run_distributed(
        _fit_and_resume_gpt2, 2, str(tmp_path), init_process_group=False, timeout=240
    )
    for rank, facts in enumerate(results):
        full, resumed = facts["full"], facts["resumed"]
        assert facts["tied"], rank
        assert sorted(full) == list(range(GPT2_STEPS))
        assert sorted(resumed) == list(range(GPT2_RESUME, GPT2_STEPS))
        for step in resumed:
            where = f"rank {rank}, step {step}"
            assert torch.equal(resumed[step]["batch"], full[step]["batch"]), where
            torch.testing.assert_close(
                resumed[step]["loss"], full[step]["loss"], rtol=0, atol=0, msg=where
            )
        torch.testing.assert_close(facts["resumed_logits"], facts["full_logits"], rtol=0, atol=0)
        # generate() sampled the prompt plus 4 new tokens at each validation: after steps 3,
        # 6 and 9, and in the resumed run after step 9 (Lightning does not repeat the
        # step-6 validation that followed the save), drawing the same tokens.
        full_samples, resumed_samples = facts["full_samples"], facts["resumed_samples"]
        assert len(full_samples) == 3 and len(resumed_samples) == 1
        for tokens in full_samples + resumed_samples:
            assert tokens.shape == (1, 7) and torch.equal(tokens[0, :3], PROBE[0, :3])
        assert torch.equal(resumed_samples[0], full_samples[2])
