"""Benchmark: what replica agreement costs, beside a training step of the example GPT.

At setup the strategies give every replica group its first rank's replicated tensors
(``replicas.sync_replicas``: one coalesced broadcast per replica group) and, with
``check_replicas=True`` (the default), compare a checksum of every replicated tensor across
its group (``replicas.check_replicas``: one all-gather of checksums per group, one round for
the outcome). The check runs after setup and after each load; the decision to run it by
default rests on its cost being under 1% of one training step.

Setup: ``examples/train_gpt.py``'s ``GPT`` (its defaults: vocab 32, width 64, 2 blocks,
per-rank batch 16 of 32 tokens; ``--width``/``--depth`` for a larger one), every block a
unit, AdamW, fp32, through the real Fabric strategy on 2 real ranks (gloo, CPU), each rank
seeded differently. Per mode: the replicated bytes per rank (main weights of the replicated
modes, buffers), the median time of ``sync_replicas`` and of ``check_replicas`` (each called
``--repeats`` times on the set-up model), and the median time of a training step (forward,
backward, optimizer step, after 3 warm-up steps), all as the slowest rank saw them.

Run: ``python -m benchmarks.bench_replicas [--width 64] [--depth 2] [--repeats 20]`` from
the repo root (megatron-fsdp 0.7 adds ``NO_SHARD`` and ZeRO-1/2).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_megatron_fsdp.fabric import MegatronFSDPStrategy
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron.replicas import check_replicas, sync_replicas
from tests.harness import PROCESS_GROUP_TIMEOUT, run_distributed

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
WARMUP = 3
STEPS = 10

MODES: list[tuple[str, str, tuple[int, int] | None]] = [
    ("FULL_SHARD", "FULL_SHARD", None),
    ("HYBRID_SHARD (2,1)", "HYBRID_SHARD", (2, 1)),
]
if _megatron.REPLICATED_PARAMETERS:
    MODES += [
        ("SHARD_OPTIMIZER", "SHARD_OPTIMIZER", None),
        ("NO_SHARD", "NO_SHARD", None),
    ]


def train_gpt_example() -> Any:
    """``examples/train_gpt.py``, imported as a module (it is not in a package)."""
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launched_fabric(
    example: Any, mode: str, mesh: tuple[int, int] | None, world_size: int
) -> Fabric:
    """A CPU ``Fabric`` of ``world_size`` processes, launched, whose strategy shards in
    ``mode`` on ``mesh`` with each of the example's blocks a unit."""
    strategy = MegatronFSDPStrategy(
        timeout=PROCESS_GROUP_TIMEOUT,
        auto_wrap_policy={example.Block},
        sharding_strategy=mode,
        device_mesh=mesh,
    )
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy)
    fabric.launch()
    return fabric


def _timed(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` (a collective: every rank calls it alike)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _replicated_bytes(model: torch.nn.Module) -> int:
    from lightning_megatron_fsdp.megatron.replicas import _replica_sets

    return sum(
        t.numel() * t.element_size()
        for s in _replica_sets(model, parameters=True)
        for t in (*s.main_weights, *s.buffers)
    )


def _rank(rank: int, world_size: int, width: int, depth: int, repeats: int) -> list[Any]:
    example = train_gpt_example()
    rows = []
    for name, mode, mesh in MODES:
        fabric = launched_fabric(example, mode, mesh, world_size)
        fabric.seed_everything(1234 + rank)
        model = fabric.setup_module(example.GPT(width=width, depth=depth))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
        module = model.module
        sync = _timed(functools.partial(sync_replicas, module), repeats)
        check = _timed(functools.partial(check_replicas, module, "bench"), repeats)
        data = example.RepeatedPatterns(16 * (WARMUP + STEPS), 32, 32, seed=rank)
        batches = [
            torch.stack([data[16 * i + j] for j in range(16)]) for i in range(WARMUP + STEPS)
        ]
        times = []
        for batch in batches:
            start = time.perf_counter()
            logits = model(batch[:, :-1])
            fabric.backward(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
        step = statistics.median(times[WARMUP:])
        parameters = sum(p.numel() for p in model.parameters())
        rows.append((name, parameters, _replicated_bytes(model.module), sync, check, step))
    return rows


def gpt_arguments(
    description: str, argv: list[str] | None, *, width: int, depth: int, repeats: int
) -> argparse.Namespace:
    """The command line of a benchmark of the example GPT: its ``--width`` and ``--depth``,
    and how many ``--repeats`` of each measurement (defaults as given)."""
    parser = argparse.ArgumentParser(description=description.split("\n")[0])
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--depth", type=int, default=depth)
    parser.add_argument("--repeats", type=int, default=repeats)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = gpt_arguments(__doc__, argv, width=64, depth=2, repeats=20)
    ranks = run_distributed(
        _rank,
        2,
        args.width,
        args.depth,
        args.repeats,
        init_process_group=False,
        timeout=1200,
    )
    print(
        f"GPT width {args.width}, depth {args.depth}, 2 ranks (gloo, CPU), "
        f"torch {torch.__version__}, megatron-fsdp {_megatron.VERSION}; medians, slowest rank"
    )
    print(
        "| mode | parameters | replicated bytes/rank | sync (setup) ms | check ms | step ms "
        "| check / step | sync / step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for index, (name, parameters, replicated, *_) in enumerate(ranks[0]):
        sync, check, step = (max(r[index][k] for r in ranks) for k in (3, 4, 5))
        print(
            f"| {name} | {parameters:,} | {replicated:,} | {sync * 1e3:.2f} | "
            f"{check * 1e3:.2f} | {step * 1e3:.1f} | {check / step:.2%} | {sync / step:.2%} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
