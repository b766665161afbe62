"""Benchmark: steps/s and per-rank peak memory of every sharding mode, beside DDP and FSDP2.

One GPT (:class:`GPT`, 11.2 M parameters: a 1024-token embedding tied to the head, 6
pre-norm blocks of width 384), AdamW, fp32, per-rank batch 4 of 64 tokens, on 2 real ranks
(gloo, CPU), trained through the real Trainer with: ``MegatronFSDPStrategy`` in
``FULL_SHARD`` (ZeRO-3), ``SHARD_GRAD_OP`` (ZeRO-2), ``SHARD_OPTIMIZER`` (ZeRO-1) and
``NO_SHARD``, each block a unit; Lightning's ``DDPStrategy``; and Lightning's
``ModelParallelStrategy`` with torch FSDP2 (``fully_shard`` per block, then the root). Same
model, same seed, same data. Each run is a fresh process tree; the sides alternate
A B C D E F, repeated, so they share the machine's load.

Steps/s is the slowest rank's steady state, from the end of warm-up step ``WARMUP`` to the
end of the last step (``on_train_batch_end``). Peak memory is the rank's resident-set
high-water mark during training (``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``
in ``on_train_start``, after sharding and after freed heap is returned to the OS with
``malloc_trim``, so setup, where every rank briefly holds the whole model, is not
counted); ``interpreter`` is the resident set when the rank starts, before the model is
built (Python, torch, Lightning, megatron-fsdp imported), and ``code`` the shared-library
pages the run faults in after that (``RssFile`` at the end minus at the start: the kernels,
autograd and gloo code a training step executes; measured per side), which the
high-water mark counts too. The theory per rank, for P parameters in fp32 on W ranks,
Adam's two moments included, with one micro-batch per step (``THEORY``):

=============== ============================================== ============ =====
mode            persistent buffers                              elements     units
=============== ============================================== ============ =====
FULL_SHARD      main weights, gradients, 2 moments: all 1/W    4 P / W      4
SHARD_GRAD_OP   + the compute weights, whole                   P + 4 P / W  2
SHARD_OPTIMIZER as SHARD_GRAD_OP (see below)                   P + 4 P / W  3
NO_SHARD        everything whole (weights alias main weights)  4 P          3
DDP             weights, gradients, 2 moments, gradient buckets 5 P         0
FSDP2           as FULL_SHARD                                  4 P / W      4
=============== ============================================== ============ =====

SHARD_OPTIMIZER keeps a unit's gradient whole only until that unit's last micro-batch,
where it is reduce-scattered into the optimizer's shard; with one micro-batch per step that
is within the unit's own backward, so between units it holds what SHARD_GRAD_OP holds (its
whole gradients persist only across the micro-batches of gradient accumulation).

Plus the larger of two transients. The backward's: the activations (measured once as the
peak growth of a second forward and backward of the plain model, less its gradients) and
``units`` times the largest unit in flight: the unit's
gradients and its reduction buffer (every megatron-fsdp mode and FSDP2), its gathered
weights and the next unit's prefetched gather (FULL_SHARD, FSDP2), the unit's fresh main
gradient beside the old one (NO_SHARD: the all-reduce writes a new buffer; SHARD_OPTIMIZER:
the whole main gradient before its reduce-scatter). DDP's gradients and buckets are
persistent. The optimizer step's: torch's default CPU AdamW (``foreach`` off, one tensor
at a time) holds two temporaries of one parameter, so 2 x the largest parameter. The
glibc heap is set to map every block of 64 KiB or more on its own (``mallopt``), on every
side, so the resident set follows the live tensors instead of keeping what a step freed.

Targets (issue 26): ``NO_SHARD`` within 5% of DDP's steps/s; ``SHARD_GRAD_OP`` and
``SHARD_OPTIMIZER`` between ``FULL_SHARD`` and DDP; every mode's peak within 10% of its
theory plus the interpreter (with its code pages, and ``workspaces``: the anonymous memory
a first forward and backward of the plain model leaves behind, the math library's buffers
and threads, measured once).

Run: ``python -m benchmarks.bench_sharding_modes [--quick] [--json PATH]`` from the repo
root, in an environment with megatron-fsdp 0.7 (0.6.1 runs ``FULL_SHARD`` only).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.bench_save_load import bench_main, median
from lightning_megatron_fsdp import MegatronFSDPStrategy
from lightning_megatron_fsdp.megatron import _megatron
from tests.harness import run_distributed

__all__ = ["GPT", "format_table", "main", "run"]

VOCAB, WIDTH, DEPTH, HEADS, SEQ = 1024, 384, 6, 6, 64
BATCH = 4  # per rank
WARMUP = 3
WORLD = 2
TIMEOUT = timedelta(seconds=120)
MODES = ("FULL_SHARD", "SHARD_GRAD_OP", "SHARD_OPTIMIZER", "NO_SHARD")
SIDES = (*MODES, "DDP", "FSDP2")
# Per rank: fp32 state as multiples of (P, P / W), and the largest units in flight in
# backward; see the module docstring.
THEORY = {
    "FULL_SHARD": (0, 4, 4),
    "SHARD_GRAD_OP": (1, 4, 2),
    "SHARD_OPTIMIZER": (1, 4, 3),
    "NO_SHARD": (4, 0, 3),
    "DDP": (5, 0, 0),
    "FSDP2": (0, 4, 4),
}


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP (one unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        """One residual attention and MLP update of ``x`` (batch, length, width)."""
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(WIDTH, dim=-1)
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, length, WIDTH))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(pl.LightningModule):
    """Embedding (tied to the head), :data:`DEPTH` blocks, final norm."""

    def __init__(self, fsdp2: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fsdp2 = fsdp2
        self.embedding = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embedding.weight
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        """FSDP2 only: each block, then the root (``ModelParallelStrategy``'s contract)."""
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits for every position."""
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        """Next-token cross-entropy."""
        (tokens,) = batch
        loss = F.cross_entropy(self(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        if len(self.losses) < 3:
            self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW."""
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def _release_free_heap() -> None:
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def _heap_tracks_tensors() -> None:
    """Serve every allocation of 64 KiB or more with its own mapping, returned when freed.

    glibc otherwise raises its mmap threshold (up to 32 MiB) each time a mapped block is
    freed, after which tensors of that size come from the heap and their memory stays
    resident when freed: the resident set then counts what a step freed long ago, and
    more so for modes that allocate per step (gathers, reduction buffers). Fixed low, the
    high-water mark is the live tensors' peak, on every side alike.
    """
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)


class _StepClock(Callback):
    """Step end times; the resident set when training starts, the high-water mark reset."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _release_free_heap()
        Path("/proc/self/clear_refs").write_text("5")
        self.at_start = _status_bytes("VmRSS")

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())


def _strategy(side: str) -> Any:
    if side == "DDP":
        return DDPStrategy(process_group_backend="gloo", timeout=TIMEOUT)
    if side == "FSDP2":
        return ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1)
    return MegatronFSDPStrategy(auto_wrap_policy={Block}, sharding_strategy=side, timeout=TIMEOUT)


def _data(steps: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randint(0, VOCAB, (BATCH * WORLD * steps, SEQ + 1), generator=generator)
    )


def _fit(rank: int, world_size: int, side: str, steps: int) -> dict[str, Any]:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    _heap_tracks_tensors()
    _release_free_heap()
    interpreter = _status_bytes("VmRSS")
    code_at_start = _status_bytes("RssFile")
    model = GPT(fsdp2=side == "FSDP2")
    clock = _StepClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=_strategy(side),
        max_steps=steps,
        callbacks=[clock],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(_data(steps), batch_size=BATCH))
    return {
        "ends": clock.ends,
        "losses": model.losses,
        "interpreter": interpreter,
        "code": _status_bytes("RssFile") - code_at_start,
        "at_start": clock.at_start,
        "peak": _status_bytes("VmHWM"),
    }


def _activations(rank: int, world_size: int) -> dict[str, int]:
    """Of forwards and backwards of the plain model (no optimizer), on one process:
    ``activations``, the second one's peak RSS growth (the larger of the forward's and the
    backward's less its gradients), and ``workspaces``, the anonymous memory the first one
    left behind (the math library's buffers and threads: a one-time cost of the process,
    which the library code it pages in, counted on each side as ``code``, is not part of)."""
    _heap_tracks_tensors()
    model = GPT()
    (tokens,) = _data(1)[:BATCH]

    def forward() -> Tensor:
        return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    _release_free_heap()
    start, code_start = _status_bytes("VmRSS"), _status_bytes("RssFile")
    forward().backward()
    model.zero_grad(set_to_none=True)
    _release_free_heap()
    before = _status_bytes("VmRSS")
    workspaces = before - start - (_status_bytes("RssFile") - code_start)
    Path("/proc/self/clear_refs").write_text("5")
    loss = forward()
    forward_peak = _status_bytes("VmHWM") - before
    loss.backward()
    grads = sum(p.grad.numel() * 4 for p in model.parameters() if p.grad is not None)
    backward_peak = _status_bytes("VmHWM") - before - grads
    return {"activations": max(forward_peak, backward_peak), "workspaces": workspaces}


def _launch(side: str, steps: int) -> list[dict[str, Any]]:
    """One run of ``side``; once more if its rendezvous port was taken meanwhile."""
    try:
        return run_distributed(_fit, WORLD, side, steps, init_process_group=False, timeout=600)
    except AssertionError as err:
        if "EADDRINUSE" not in str(err):
            raise
        return run_distributed(_fit, WORLD, side, steps, init_process_group=False, timeout=600)


def _steps_per_second(ranks: list[dict[str, Any]], steps: int) -> float:
    rates = []
    for r in ranks:
        ends = r["ends"]
        if len(ends) != steps:
            raise RuntimeError(f"expected {steps} steps, a rank ran {len(ends)}")
        rates.append((steps - WARMUP) / (ends[-1] - ends[WARMUP - 1]))
    return min(rates)


def run(*, quick: bool = False, repeats: int = 3) -> dict[str, Any]:
    """Every side, interleaved, ``repeats`` times; steps/s and memory medians."""
    steps = 8 if quick else 12
    repeats = 1 if quick else repeats
    sides = [
        s
        for s in SIDES
        if s not in MODES
        or _megatron.placements_problem(_megatron.sharding_placements(**_shards(s))) is None
    ]
    model = GPT()
    parameters = sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    largest_parameter = max(p.numel() for p in model.parameters())
    plain = run_distributed(_activations, 1, init_process_group=False)[0]
    activations, workspaces = plain["activations"], plain["workspaces"]
    rates: dict[str, list[float]] = {s: [] for s in sides}
    peaks: dict[str, list[int]] = {s: [] for s in sides}
    interpreters: dict[str, list[int]] = {s: [] for s in sides}
    codes: dict[str, list[int]] = {s: [] for s in sides}
    at_start: dict[str, list[int]] = {s: [] for s in sides}
    losses: dict[str, list[float]] = {}
    for _ in range(repeats):
        for side in sides:
            ranks = _launch(side, steps)
            rates[side].append(_steps_per_second(ranks, steps))
            peaks[side].append(max(r["peak"] for r in ranks))
            interpreters[side].append(max(r["interpreter"] for r in ranks))
            codes[side].append(max(r["code"] for r in ranks))
            at_start[side].append(max(r["at_start"] for r in ranks))
            losses[side] = ranks[0]["losses"]
    rows = []
    for side in sides:
        whole, sharded, units = THEORY[side]
        state = 4 * (whole * parameters + sharded * parameters / WORLD)
        theory = state + max(4 * units * unit + activations, 4 * 2 * largest_parameter)
        peak, interpreter = median(peaks[side]), median(interpreters[side])
        code = median(codes[side])
        rows.append(
            {
                "side": side,
                "steps_s": median(rates[side]),
                "rates": rates[side],
                "peak_mb": peak / 1e6,
                "interpreter_mb": interpreter / 1e6,
                "code_mb": code / 1e6,
                "at_start_mb": median(at_start[side]) / 1e6,
                "theory_state_mb": state / 1e6,
                "theory_mb": theory / 1e6,
                "peak_over_theory": peak / (theory + interpreter + code + workspaces),
                "peak_over_theory_bare": peak / (theory + interpreter),
                "losses": losses[side],
            }
        )
    return {
        "quick": quick,
        "repeats": repeats,
        "steps": steps,
        "parameters": parameters,
        "unit": unit,
        "activations_mb": activations / 1e6,
        "workspaces_mb": workspaces / 1e6,
        "megatron_fsdp": _megatron.VERSION,
        "rows": rows,
        "verdicts": _verdicts(rows),
    }


def _shards(mode: str) -> dict[str, bool]:
    from lightning_megatron_fsdp.megatron.sharding_modes import MODES as NAMED

    shards = NAMED[mode]
    return {
        "parameters": shards.parameters,
        "gradients": shards.gradients,
        "optimizer": shards.optimizer,
        "hybrid": shards.hybrid,
    }


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, bool]:
    by = {r["side"]: r for r in rows}
    verdicts: dict[str, bool] = {}
    if "NO_SHARD" in by:
        verdicts["NO_SHARD within 5% of DDP"] = (
            by["NO_SHARD"]["steps_s"] >= 0.95 * by["DDP"]["steps_s"]
        )
    for mode in ("SHARD_GRAD_OP", "SHARD_OPTIMIZER"):
        if mode in by:
            low, high = by["FULL_SHARD"]["steps_s"], by["DDP"]["steps_s"]
            verdicts[f"{mode} between FULL_SHARD and DDP"] = low <= by[mode]["steps_s"] <= high
    for row in rows:
        verdicts[f"{row['side']} peak within 10% of theory + interpreter + code + workspaces"] = (
            abs(row["peak_over_theory"] - 1) <= 0.10
        )
    return verdicts


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s result."""
    lines = [
        f"megatron-fsdp {result['megatron_fsdp']}; GPT of {result['parameters'] / 1e6:.1f} M "
        f"parameters (largest unit {result['unit'] / 1e6:.2f} M), AdamW fp32, W={WORLD} gloo "
        f"CPU ranks, per-rank batch {BATCH}x{SEQ}; {result['steps']} steps, steady state after "
        f"{WARMUP}; median of {result['repeats']} interleaved runs per side. Theory = state "
        "+ max(activations + units in flight x largest unit, Adam's 2 temporaries of the "
        f"largest parameter); activations {result['activations_mb']:.1f} MB, math-library "
        f"workspaces {result['workspaces_mb']:.1f} MB (both measured on the plain model).",
        "",
        "| side | steps/s | runs | peak MB (worst rank) | interpreter MB | code MB "
        "| at train start MB | theory state MB | theory MB "
        "| peak / (theory + interpreter) | peak / (theory + interpreter + code + workspaces) "
        "| first losses |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['side']} | {row['steps_s']:.2f} | "
            f"{', '.join(f'{r:.2f}' for r in row['rates'])} | {row['peak_mb']:.0f} "
            f"| {row['interpreter_mb']:.0f} | {row['code_mb']:.0f} | {row['at_start_mb']:.0f} "
            f"| {row['theory_state_mb']:.0f} "
            f"| {row['theory_mb']:.0f} | {row['peak_over_theory_bare']:.3f} "
            f"| {row['peak_over_theory']:.3f} "
            f"| {', '.join(f'{x:.4f}' for x in row['losses'])} |"
        )
    lines += ["", "| target | met |", "|---|---|"]
    lines += [f"| {k} | {'met' if v else 'NOT met'} |" for k, v in result["verdicts"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the result as JSON."""
    return bench_main(__doc__, run, format_table, "8 steps, one run per side", argv)


if __name__ == "__main__":
    sys.exit(main())
