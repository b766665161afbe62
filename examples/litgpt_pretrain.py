"""Pretrain litgpt's ``GPT`` with Megatron-FSDP in a Lightning Fabric loop; resume; export.

Nothing to download: the model is built from a tiny ``litgpt.Config`` and the data is
generated (sequences that repeat a random 2-6 token pattern). Runs on 2 CPU processes by
default, and unchanged on GPUs (``--accelerator gpu --devices 8 --precision bf16-true``)::

    python examples/litgpt_pretrain.py --max-steps 20                      # train, checkpoint
    python examples/litgpt_pretrain.py --max-steps 40 --resume --export   # resume, export

Outputs under ``--out`` (default ``runs/litgpt``): ``checkpoints/last`` (our sharded
checkpoint, written every ``--save-every`` steps and at the end), ``losses.jsonl`` (one
line per step, appended by every run) and, with ``--export``, ``final/lit_model.pth`` plus
``final/model_config.yaml``: the files litgpt's own tools load
(``litgpt.utils.load_checkpoint``, ``GPT.load_state_dict``), and ``final/probe.pt``, the
sharded model's logits on a fixed input, for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from litgpt import GPT, Config
from litgpt.model import Block
from litgpt.utils import save_config
from torch import nn
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_megatron_fsdp import consolidate_checkpoint
from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy

SEQ_LEN = 32
PROBE = torch.arange(SEQ_LEN).remainder(7).unsqueeze(0)


def tiny_config() -> Config:
    """A 2-layer litgpt GPT (about 70 k parameters), built from its config alone."""
    return Config(
        name="tiny-gpt",
        block_size=SEQ_LEN,
        vocab_size=32,
        padded_vocab_size=32,
        n_layer=2,
        n_head=4,
        n_embd=64,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=True,
    )


class RepeatedPatterns(Dataset):
    """Deterministic sequences that repeat a random 2-6 token pattern (seeded per index)."""

    def __init__(self, size: int, vocab: int) -> None:
        self.size, self.vocab = size, vocab

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        period = int(torch.randint(2, 7, (1,), generator=generator))
        pattern = torch.randint(0, self.vocab, (period,), generator=generator)
        return pattern.repeat(math.ceil((SEQ_LEN + 1) / period))[: SEQ_LEN + 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/litgpt"))
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--resume", action="store_true", help="continue from checkpoints/last")
    parser.add_argument("--export", action="store_true", help="write final/lit_model.pth")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    config = tiny_config()
    # Units: every Block, and the modules GPT.forward calls itself (the embedding and the
    # final norm; lm_head is a top-level unit anyway). Norms inside a Block become nested
    # units of their own, which is correct, merely finer-grained.
    strategy = MegatronFSDPStrategy(auto_wrap_policy={Block, nn.Embedding, config.norm_class})
    fabric = Fabric(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        precision=args.precision,
    )
    fabric.launch()
    args.out.mkdir(parents=True, exist_ok=True)
    fabric.seed_everything(1234 + fabric.global_rank)

    with fabric.init_module(empty_init=True):  # meta device; materialised unit by unit
        model = GPT(config)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = fabric.setup_dataloaders(
        StatefulDataLoader(RepeatedPatterns(4096, config.vocab_size), batch_size=8)
    )

    state = {"model": model, "optimizer": optimizer, "step": 0, "loader": loader}
    last = args.out / "checkpoints" / "last"
    if args.resume:
        fabric.load(last, state)  # model, optimizer, step, loader position, random streams
        fabric.print(f"Resumed from {last} at step {state['step']}")

    iterator = iter(loader)
    while state["step"] < args.max_steps:
        batch = next(iterator)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        state["step"] += 1
        mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
        if fabric.is_global_zero:
            with open(args.out / "losses.jsonl", "a") as log:
                log.write(json.dumps({"step": state["step"], "loss": mean_loss}) + "\n")
        if state["step"] % args.save_every == 0 or state["step"] == args.max_steps:
            fabric.save(last, state)
            fabric.print(f"step {state['step']}: loss {mean_loss:.4f}, saved {last}")

    if args.export:
        final = args.out / "final"
        model.eval()
        with torch.no_grad():
            probe = model(PROBE.to(fabric.device)).float().cpu()
        if fabric.is_global_zero:
            final.mkdir(parents=True, exist_ok=True)
            consolidate_checkpoint(last, final / "lit_model.pth", overwrite=True)
            save_config(config, final)
            torch.save(probe, final / "probe.pt")
            fabric.print(f"Exported {final / 'lit_model.pth'} (litgpt's format)")
        fabric.barrier()


if __name__ == "__main__":
    main()
