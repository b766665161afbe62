"""The first machine with a GPU answers, in one run, what the CPU suite cannot.

``python -m pytest -m gpu tests/test_gpu_end_to_end.py`` (one GPU: 1 rank; two or more:
2 ranks over NCCL; a few minutes) runs one scenario through the real ``Trainer`` on CUDA
with ``precision="bf16-true"`` and a model with dropout (so the CUDA random stream
matters):

* run A trains 8 steps uninterrupted and saves ``last.ckpt`` at the end;
* run B trains 4 steps saving ``last.ckpt`` every 2 with ``async_save=True``: steps 3 and 4
  run while step 2's checkpoint is written in the background (counted: on a GPU at least
  one step must start while a write is in flight, which the model is sized for);
* run C resumes from B's ``last.ckpt`` (``fit(ckpt_path=...)``, loading into the
  CUDA-resident shards, restoring the CUDA random stream) and trains to step 8.

Steps 1-4 of B and 5-8 of C must give run A's losses bit for bit, C's final checkpoint
must consolidate to exactly A's, and ``export-lightning`` of it must load into the
unsharded module with ``load_from_checkpoint`` on CPU holding those same weights. On CUDA
the CPU adapter must have stayed off (megatron-fsdp on its real streams), though the
module is built on CPU.

The same scenario runs on CPU in the default suite (gloo, a narrower model), so the script
itself is checked where there is no GPU; only the overlap count is not asserted there.
Record a GPU result in the README ("GPU check").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import (
    MegatronFSDPStrategy,
    consolidate_checkpoint,
    cpu_execution_enabled,
    export_lightning_checkpoint,
    read_manifest,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from tests.gpu import assert_ran_on_cuda, cuda_world_size
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed

VOCAB = 32
SEQ = 64
BATCH = 8
STEPS = 8  # run A; B stops at STEPS // 2, C resumes there
TIMEOUT = 420.0  # the ranks; then consolidation and export in this process


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.drop = nn.Dropout(0.1)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(self.drop(F.gelu(self.up(self.norm(x)))))


class _GPT(pl.LightningModule):
    def __init__(self, width: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Tokens(Dataset):
    def __init__(self, rows: int) -> None:
        self.data = torch.randint(
            0, VOCAB, (rows, SEQ + 1), generator=torch.Generator().manual_seed(7)
        )

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index]


class _Record(Callback):
    """Each step's loss, and how many steps started while an async save was in flight."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}
        self.overlapped = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, MegatronFSDPCheckpointIO) and not io.poll():
            self.overlapped += 1

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, *a: Any) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])


def _fit(
    root: Path, accelerator: str, world_size: int, width: int, *, max_steps: int, every: int,
    async_save: bool = False, ckpt_path: str | None = None,
) -> tuple[_GPT, pl.Trainer, _Record]:  # fmt: skip
    pl.seed_everything(0, verbose=False)
    record = _Record()
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=world_size,
        strategy=MegatronFSDPStrategy(
            auto_wrap_policy={_Block},
            checkpoint_io=MegatronFSDPCheckpointIO(async_save=async_save),
            timeout=PROCESS_GROUP_TIMEOUT,  # a hung collective fails, NCCL's too
        ),
        precision="bf16-true",
        deterministic=True,
        max_steps=max_steps,
        callbacks=[
            ModelCheckpoint(root, save_last=True, save_top_k=0, every_n_train_steps=every),
            record,
        ],
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
    )
    model = _GPT(width, depth=4 if width > 64 else 2)
    rows = BATCH * world_size * STEPS
    data = StatefulDataLoader(_Tokens(rows), batch_size=BATCH, shuffle=True)
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, trainer, record


def _scenario(rank: int, world_size: int, root: str, accelerator: str, width: int) -> dict:
    base = Path(root)
    _, _, a = _fit(base / "a", accelerator, world_size, width, max_steps=STEPS, every=STEPS)
    half = STEPS // 2
    _, _, b = _fit(
        base / "b", accelerator, world_size, width, max_steps=half, every=2, async_save=True
    )
    resume_from = str(base / "b" / "last.ckpt")  # C saves under c/: no "last-v1.ckpt" beside it
    model, trainer, c = _fit(
        base / "c",
        accelerator,
        world_size,
        width,
        max_steps=STEPS,
        every=half,
        ckpt_path=resume_from,
    )
    shards = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    devices = sorted({shard.device.type for shard in shards})
    return {
        "a": a.losses,
        "b": b.losses,
        "c": c.losses,
        "overlapped": b.overlapped,
        "devices": devices,
        "device": str(trainer.strategy.root_device),
        "backend": torch.distributed.get_backend(),
        "cpu_adapter": cpu_execution_enabled(),
    }


def _check(tmp_path: Path, accelerator: str, world_size: int, width: int) -> list[dict]:
    results = run_distributed(
        _scenario, world_size, str(tmp_path), accelerator, width,
        timeout=TIMEOUT, init_process_group=False,
    )  # fmt: skip
    half = STEPS // 2
    for result in results:
        a, b, c = result["a"], result["b"], result["c"]
        assert sorted(a) == list(range(1, STEPS + 1)), a
        assert b == {s: a[s] for s in range(1, half + 1)}, (b, a)
        assert c == {s: a[s] for s in range(half + 1, STEPS + 1)}, (c, a)  # bit-exact resume
        assert result["devices"] == [accelerator], result  # loaded into the device's shards
        # The CPU adapter is for CPU only: on CUDA megatron-fsdp keeps its real streams.
        assert result["cpu_adapter"] == (accelerator == "cpu"), result
    # C ended exactly where A did: every saved tensor, consolidated offline.
    final_a = consolidate_checkpoint(tmp_path / "a" / "last.ckpt", tmp_path / "a.pt")
    final_c = consolidate_checkpoint(tmp_path / "c" / "last.ckpt", tmp_path / "c.pt")
    weights_a = torch.load(final_a, weights_only=True)
    weights_c = torch.load(final_c, weights_only=True)
    assert weights_a.keys() == weights_c.keys() and len(weights_a) > 10
    for key, value in weights_a.items():
        torch.testing.assert_close(weights_c[key], value, rtol=0, atol=0, msg=key)
    # Exported, the checkpoint loads into the unsharded module on CPU with those weights.
    assert read_manifest(tmp_path / "c" / "last.ckpt").global_step == STEPS
    exported = export_lightning_checkpoint(tmp_path / "c" / "last.ckpt", tmp_path / "m.ckpt")
    loaded = _GPT.load_from_checkpoint(exported, map_location="cpu")
    assert loaded.hparams["width"] == width
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, weights_c[key].to(value.dtype), rtol=0, atol=0, msg=key)
    return results


def test_fit_async_save_resume_and_export_on_cpu(tmp_path: Path) -> None:
    """The GPU scenario on CPU (gloo, 2 ranks, a narrow model): the script's own check."""
    results = _check(tmp_path, "cpu", 2, width=32)
    assert all(r["backend"] == "gloo" for r in results)


@pytest.mark.gpu
@pytest.mark.timeout(540)  # the suite's 300 s would cut the run short
def test_fit_async_save_resume_and_export_on_cuda(tmp_path: Path) -> None:
    world_size = cuda_world_size()
    results = _check(tmp_path, "cuda", world_size, width=1024)
    assert_ran_on_cuda([r["device"] for r in results], world_size)
    for result in results:
        assert result["backend"] == "nccl"
        # Steps 3 and 4 of run B started while step 2's checkpoint was being written.
        assert result["overlapped"] >= 1, result["overlapped"]
