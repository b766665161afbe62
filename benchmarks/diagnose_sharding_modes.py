"""Diagnosis (issue 26): where each sharding mode's training step spends its time, beside DDP.

Not a benchmark with a target: a reproducible breakdown that benchmarks/RESULTS.md ("Sharding
modes") quotes. Same GPT, data, optimizer and ranks as ``bench_sharding_modes`` (2 gloo CPU
ranks, the real Trainer, no ``mallopt``: the allocator as users get it). Per step, the wall
time of the forward (``on_train_batch_start`` to ``on_before_backward``: the step's
``training_step`` and ``zero_grad``), the backward (to ``on_after_backward``) and the
optimizer step (``on_before_optimizer_step`` to ``on_train_batch_end``), and the wall time
spent inside megatron-fsdp's per-step pieces, taken by wrapping them with a clock (no
profiler, whose per-call overhead would favour DDP's few Python calls): the gloo
collectives ``DBuffer`` issues on the compute thread (on CPU the adapter's streams are
synchronous), ``GlobalLayout.__post_init__`` (run for every ``DBuffer`` built: a reduction's
input and output buffers, every step), the gradient packing and reduction of
``FsdpParameterGroup``, parameter gathering, and ``torch.optim.AdamW.step`` on the
DTensor main weights. Medians over the steps after warm-up, per rank.

Run: ``python -m benchmarks.diagnose_sharding_modes [--steps N] [--repeats R] [SIDE ...]``
from the repository root with megatron-fsdp 0.7 (``.venv-07``).
"""

from __future__ import annotations

import argparse
import collections
import functools
import logging
import statistics
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from benchmarks.bench_sharding_modes import BATCH, GPT, SIDES, WARMUP, WORLD, _data, _strategy
from tests.harness import run_distributed

_SPENT: collections.Counter[str] = collections.Counter()


def _clock(owner: Any, name: str, key: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall time to ``_SPENT[key]``."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def clocked(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _SPENT[key] += time.perf_counter() - start

    setattr(owner, name, clocked)


def _clock_upstream() -> None:
    from megatron_fsdp.experimental import layout, module, parameter_group

    group = parameter_group.FsdpParameterGroup
    for collective in ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor"):
        _clock(dist, collective, collective)
    _clock(layout.GlobalLayout, "__post_init__", "GlobalLayout.__post_init__")
    _clock(group, "allocate_partial_grad_buffer", "allocate_partial_grad_buffer")
    _clock(group, "copy_gradients_to_partial_buffer", "copy_gradients_to_partial_buffer")
    _clock(group, "reduce_partial_gradients", "reduce_partial_gradients")
    _clock(module.FsdpModule, "post_backward", "post_backward")
    _clock(module.FsdpModule, "_unshard_parameter_groups", "unshard")


class _Phases(Callback):
    """Per step: forward, backward, optimizer and total wall time, and ``_SPENT``'s growth."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._marks: dict[str, float] = {}
        self._spent: dict[str, float] = {}

    def _mark(self, name: str) -> None:
        self._marks[name] = time.perf_counter()

    def on_train_batch_start(self, *args: Any, **kwargs: Any) -> None:
        self._spent = dict(_SPENT)
        self._marks = {}
        self._mark("start")

    def on_before_backward(self, *args: Any, **kwargs: Any) -> None:
        self._mark("forward")

    def on_after_backward(self, *args: Any, **kwargs: Any) -> None:
        self._mark("backward")

    def on_before_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._mark("before_step")

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self._mark("end")
        m = self._marks
        step = {
            "forward": m["forward"] - m["start"],
            "backward": m["backward"] - m["forward"],
            "optimizer": m["end"] - m["before_step"],
            "step": m["end"] - m["start"],
        }
        step.update({k: v - self._spent.get(k, 0.0) for k, v in _SPENT.items()})
        self.steps.append(step)


def _fit(rank: int, world_size: int, side: str, steps: int) -> dict[str, float]:
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if side not in ("DDP", "FSDP2"):
        _clock_upstream()
    phases = _Phases()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=_strategy(side),
        max_steps=steps,
        callbacks=[phases],
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(GPT(fsdp2=side == "FSDP2"), DataLoader(_data(steps), batch_size=BATCH))
    measured = phases.steps[WARMUP:]
    keys = sorted(set().union(*measured))
    return {k: statistics.median(s.get(k, 0.0) for s in measured) for k in keys}


def main(argv: list[str] | None = None) -> int:
    """Run each side ``--repeats`` times, interleaved; print each rank's medians in ms."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("sides", nargs="*", default=list(SIDES))
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for repeat in range(args.repeats):
        for side in args.sides:
            ranks = run_distributed(
                _fit, WORLD, side, args.steps, init_process_group=False, timeout=600
            )
            for rank, medians in enumerate(ranks):
                shown = " ".join(f"{k}={1000 * v:.0f}" for k, v in medians.items())
                print(f"repeat {repeat} {side} rank {rank} (ms): {shown}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
