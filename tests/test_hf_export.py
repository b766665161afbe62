"""Hugging Face round trip: ``from_pretrained`` weights in, train sharded, export, load back.

A real ``transformers`` GPT-2 built from a tiny config (no hub access), whose ``wte`` and
``lm_head`` are tied, is saved with ``save_pretrained``. Two ranks (``tests.harness``,
gloo) fine-tune it with the real ``Trainer`` and ``MegatronFSDPStrategy``
(``auto_wrap_policy={GPT2Block}``), starting from that file through
``init_weights_from=PretrainedWeights(..., add_prefix="model.")``; ``ModelCheckpoint``
saves. The pytest process then runs the README's commands: ``lightning-megatron-fsdp
consolidate CKPT hf/model.safetensors --strip-prefix model.`` and
``config.save_pretrained("hf")``, and ``GPT2LMHeadModel.from_pretrained("hf")`` must
report no missing, unexpected or mismatched key, keep the tie, and reproduce the sharded
model's logits bit for bit (``rtol=0, atol=0``), as must a plain ``load_state_dict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import safetensors.torch
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from lightning_megatron_fsdp import MegatronFSDPStrategy, PretrainedWeights
from lightning_megatron_fsdp.tools.cli import main
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed
from tests.models import make_trainer
from tests.test_export import _one_thread

TIMEOUT = 240.0
VOCAB = 64
# Dropout off, so the logits recorded in training mode are the inference logits.
CONFIG: dict[str, Any] = {
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": VOCAB,
    "n_positions": 32,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "attn_pdrop": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


class GPT2Lit(pl.LightningModule):
    """A LightningModule that holds a Hugging Face model as ``self.model``."""

    def __init__(self, config: dict[str, Any], lr: float = 0.01) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT2LMHeadModel(GPT2Config(**config))

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self.model(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def probe_ids() -> Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))


class Logits(Callback):
    """The sharded model's logits on the probe batch when training starts and ends."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            self.start = pl_module(probe_ids()).numpy().copy()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            self.end = pl_module(probe_ids()).numpy().copy()


def _fine_tune(rank: int, world_size: int, pretrained: str, run: str) -> dict[str, np.ndarray]:
    pl.seed_everything(0, verbose=False)
    tokens = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    logits = Logits()
    strategy = MegatronFSDPStrategy(
        auto_wrap_policy={GPT2Block},
        init_weights_from=PretrainedWeights(pretrained, add_prefix="model."),
        timeout=PROCESS_GROUP_TIMEOUT,
    )
    callbacks = [logits, ModelCheckpoint(dirpath=run, filename="gpt2")]
    trainer = make_trainer(world_size, strategy, max_epochs=1, callbacks=callbacks)
    trainer.fit(GPT2Lit(CONFIG), DataLoader(TensorDataset(tokens), batch_size=2))
    return {"start": logits.start, "end": logits.end}


def _logits(model: GPT2LMHeadModel) -> np.ndarray:
    with _one_thread(), torch.no_grad():
        return model.eval()(input_ids=probe_ids()).logits.numpy()


def test_gpt2_round_trip_through_from_pretrained(tmp_path: Path) -> None:
    """save_pretrained -> init_weights_from(add_prefix) -> 2-rank fit -> consolidate
    --strip-prefix model. -> from_pretrained: same logits as the sharded model, exactly."""
    config = GPT2Config(**CONFIG)
    torch.manual_seed(0)
    pretrained = GPT2LMHeadModel(config)
    pretrained.save_pretrained(tmp_path / "pretrained")
    saved_keys = set(safetensors.torch.load_file(tmp_path / "pretrained" / "model.safetensors"))
    assert "lm_head.weight" not in saved_keys  # Hugging Face writes the tie once
    reference = _logits(pretrained)

    results = run_distributed(
        _fine_tune,
        2,
        str(tmp_path / "pretrained" / "model.safetensors"),
        str(tmp_path / "run"),
        init_process_group=False,
        timeout=TIMEOUT,
    )
    for result in results:  # init_weights_from with add_prefix loaded the pretrained model
        np.testing.assert_array_equal(result["start"], reference, strict=True)
    trained = results[0]["end"]
    assert not np.array_equal(trained, reference), "training did not change the model"

    export = tmp_path / "hf"
    export.mkdir()
    weights = export / "model.safetensors"
    checkpoint = tmp_path / "run" / "gpt2.ckpt"
    assert main(["consolidate", str(checkpoint), str(weights), "--strip-prefix", "model."]) == 0
    config.save_pretrained(export)

    loaded, info = GPT2LMHeadModel.from_pretrained(export, output_loading_info=True)
    assert info == {
        "missing_keys": set(),
        "unexpected_keys": set(),
        "mismatched_keys": set(),
        "error_msgs": [],
    }
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    np.testing.assert_array_equal(_logits(loaded), trained, strict=True)

    # The file is the inner model's own state dict: the tie under both FQNs.
    state = safetensors.torch.load_file(weights)
    plain = GPT2LMHeadModel(config)
    assert set(state) == set(plain.state_dict()) == saved_keys | {"lm_head.weight"}
    plain.load_state_dict(state, strict=True)
    np.testing.assert_array_equal(_logits(plain), trained, strict=True)
