"""Benchmark 3: how long an async save blocks training, and how much it slows the steps.

``MegatronFSDPCheckpointIO(async_save=True)`` returns from ``save_checkpoint`` once every
rank has copied its shards to CPU memory; ``dcp.async_save`` then writes them on a
background thread and a second thread hashes and commits. Two questions:

* Blocked time: the wall time of the async ``save_checkpoint`` call (state dicts and chunk
  hooks included, as the strategy would run them), against the same synchronous save.
* Slowdown: training steps that run while the background write is in flight, against
  steps with nothing in flight. The background threads compete with training for the
  CPU, memory bandwidth and the disk.

Setup: the ~50 M parameter :class:`~benchmarks.bench_save_load.BenchLM` with Adam, sharded
on 2 real ranks (gloo, CPU), one training step = forward, cross-entropy, backward, Adam step
on a batch of 4 x 32 tokens. Per repeat, in rotating order: (A) a synchronous save, (B) an
async save followed by ``N`` steps, each step flagged "in flight" if the save had not
committed on any rank when it started (``poll()``, which is rank-local, gathered at the
end), (C) ``N`` steps with nothing in flight. ``N`` is picked after warm-up to outlast the
write (1.5 times the synchronous save time, in steps, plus one; at least 3). Blocked and
synchronous times are barrier to barrier (the slowest rank's); step times are rank 0's
(every step all-gathers, so ranks run in lockstep).

Targets (issues 6 and 13): blocked <= 10% of the synchronous save; steps during the write
slowed by <= 10% at world size 1 (issue 13; world size 2, where 2 ranks fill both cores and
leave the writer none, is reported too).

Where the slowdown comes from (``--diagnose``, world size 1): the same measurement with
the async save replaced, one at a time, by what it does in the background --

* ``default``: the async save as shipped (CRC32C while writing, lowered thread priority);
* ``no checksums``: the same with ``write_checksums=False`` (the hashing's share);
* ``not niced``: the same with the background thread at normal priority;
* ``memory copy only``: a thread that only copies the rank's state bytes from one buffer to
  another (GIL released, like the kernel's copy into the page cache), for as long as a
  synchronous save takes: memory bandwidth;
* ``Python only``: a thread that only runs Python bytecode for as long as a synchronous
  save takes: the GIL.
* ``bytes only``: a thread at the save's priority that does once what any safe writer of
  these bytes must: CRC-32 (the zip's), CRC32C and write the rank's state to a file in
  1 MiB blocks, then fsync it. No DCP, no planning, no Python per record: the floor a
  background save can reach on this machine.

Run: ``python -m benchmarks.bench_async_save [--quick] [--json PATH]`` from the repo root.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import crc32c
import torch
import torch.distributed as dist
from torch import Tensor, nn

import lightning_megatron_fsdp.checkpoint.io as checkpoint_parts
from benchmarks.bench_save_load import (
    QUICK_WIDTH,
    WIDTH,
    BenchLM,
    bench_main,
    build_sharded,
    local_tensors,
    median,
    resident_bytes,
    save_state,
    timed,
)
from lightning_megatron_fsdp import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.storage import records as tensor_records
from tests.harness import run_distributed

__all__ = ["VARIANTS", "format_table", "main", "run"]

BATCH, SEQ = 4, 32
# Background activities of --diagnose (see the module docstring); the first is the product.
VARIANTS = (
    "default",
    "no checksums",
    "not niced",
    "memory copy only",
    "Python only",
    "bytes only",
)
_THREAD_VARIANTS = ("memory copy only", "Python only", "bytes only")


def _background_load(
    variant: str, seconds: float, nbytes: int, tensors: list[Tensor], path: Path
) -> threading.Thread:
    """Start a thread doing only one of the async save's kinds of work: for ``seconds``
    (memory copy, Python), or once over ``tensors`` into ``path`` (bytes only)."""

    def copy_only() -> None:
        source = torch.empty(nbytes // 4)
        target = torch.empty_like(source)
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            target.copy_(source)

    def python_only() -> None:
        end, count = time.perf_counter() + seconds, 0
        while time.perf_counter() < end:
            count += 1

    def bytes_only() -> None:
        checkpoint_parts._lower_thread_priority()
        with open(path, "wb") as file:
            for tensor in tensors:
                view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
                crc = value = 0
                for start in range(0, view.nbytes, 1 << 20):
                    block = view[start : start + (1 << 20)]
                    crc = tensor_records._payload_crc32(block, crc)
                    value = crc32c.crc32c(block, value)
                    file.write(block)
            file.flush()
            os.fsync(file.fileno())
        path.unlink()

    target = {"memory copy only": copy_only, "Python only": python_only}.get(variant, bytes_only)
    thread = threading.Thread(target=target)
    thread.start()
    return thread


def _batch(vocab: int, step: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    return tokens, torch.roll(tokens, -1, dims=1)


def _train_step(
    model: BenchLM, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor]
) -> float:
    """One step through the FSDP root; returns its wall time on this rank."""
    start = time.perf_counter()
    tokens, targets = batch
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def _save(
    model: BenchLM, optimizer: torch.optim.Optimizer, io: MegatronFSDPCheckpointIO, path: Path
) -> None:
    io.save_checkpoint(save_state(model, optimizer), path)


def _during(
    flags: list[bool], times: list[float], world_size: int, during: list[float], counts: list[int]
) -> tuple[list[float], list[int]]:
    """Add the step times that ran while the background work was in flight on any rank."""
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, flags)
    in_flight = [any(rank_flags) for rank_flags in zip(*gathered, strict=True)]
    return (
        during + [t for t, f in zip(times, in_flight, strict=True) if f],
        [*counts, sum(in_flight)],
    )


def _measure(
    rank: int, world_size: int, width: int, directory: str, repeats: int, variant: str = "default"
) -> dict[str, Any]:
    if variant == "not niced":
        checkpoint_parts._BACKGROUND_NICE = 0  # read by _lower_thread_priority
    model, optimizer = build_sharded(width, world_size)
    vocab = model.vocab
    step_index = 0

    def next_batch() -> tuple[Tensor, Tensor]:
        nonlocal step_index
        step_index += 1
        return _batch(vocab, step_index)

    for _ in range(3):  # warm-up: allocator, lazy FSDP context
        _train_step(model, optimizer, next_batch())
    root = Path(directory)
    sync_io = MegatronFSDPCheckpointIO()
    async_io = MegatronFSDPCheckpointIO(async_save=True, write_checksums=variant != "no checksums")
    state_bytes = resident_bytes(model, optimizer)
    state_tensors = [t.contiguous() for t in local_tensors(save_state(model, optimizer)).values()]
    # Warm-up saves: the async plugin creates its background process group on first use.
    for io, name in ((sync_io, "warm-sync"), (async_io, "warm-async")):
        _save(model, optimizer, io, root / name)
        io.wait()
    step_probe = [_train_step(model, optimizer, next_batch()) for _ in range(3)]
    sync_probe = timed(functools.partial(_save, model, optimizer, sync_io, root / "probe"))
    estimate = torch.tensor([1.5 * sync_probe / median(step_probe)], dtype=torch.float64)
    dist.all_reduce(estimate, op=dist.ReduceOp.MAX)
    steps = max(3, math.ceil(estimate.item()) + 1)

    sync_s: list[float] = []
    blocked_s: list[float] = []
    write_steps: list[int] = []
    during: list[float] = []
    idle: list[float] = []
    overran = 0
    sides = ["sync", "async", "idle"]
    for repeat in range(repeats):
        order = sides[repeat % 3 :] + sides[: repeat % 3]
        for side in order:
            if side == "sync":
                path = root / f"sync-{repeat}"
                sync_s.append(timed(functools.partial(_save, model, optimizer, sync_io, path)))
            elif side == "idle":
                dist.barrier()
                idle += [_train_step(model, optimizer, next_batch()) for _ in range(steps)]
            elif variant in _THREAD_VARIANTS:  # --diagnose: one kind of work, no save
                dist.barrier()
                load = _background_load(
                    variant, sync_probe, state_bytes, state_tensors, root / "bytes-only.bin"
                )
                flags, times = [], []
                for _ in range(steps):
                    flags.append(load.is_alive())
                    times.append(_train_step(model, optimizer, next_batch()))
                overran += int(load.is_alive())
                load.join()
                blocked_s.append(0.0)
                during, write_steps = _during(flags, times, world_size, during, write_steps)
            else:
                path = root / f"async-{repeat}"
                blocked_s.append(timed(functools.partial(_save, model, optimizer, async_io, path)))
                flags, times = [], []
                for _ in range(steps):
                    flags.append(not async_io.poll())
                    times.append(_train_step(model, optimizer, next_batch()))
                overran += int(not async_io.poll())
                async_io.wait()
                during, write_steps = _during(flags, times, world_size, during, write_steps)
        dist.barrier()
        if rank == 0:
            for name in (f"sync-{repeat}", f"async-{repeat}"):
                shutil.rmtree(root / name, ignore_errors=True)
    async_io.teardown()
    counts = torch.tensor([overran], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    return {
        "world_size": world_size,
        "parameters": sum(p.numel() for p in BenchLM(width).parameters()),
        "steps_per_repeat": steps,
        "sync_s": sync_s,
        "blocked_s": blocked_s,
        "write_steps": write_steps,
        "step_during_write_s": during,
        "step_idle_s": idle,
        "repeats_write_outlasted_steps": counts.item(),
    }


def _range(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if values else "-"


def _summarize(raw: dict[str, Any]) -> dict[str, Any]:
    sync = median(raw["sync_s"])
    blocked = median(raw["blocked_s"])
    idle = median(raw["step_idle_s"])
    during = median(raw["step_during_write_s"]) if raw["step_during_write_s"] else math.nan
    slowdown = during / idle - 1
    return {
        "raw": raw,
        "world_size": raw["world_size"],
        "sync_s": sync,
        "blocked_s": blocked,
        "blocked_share": blocked / sync,
        "step_idle_s": idle,
        "step_during_s": during,
        "step_idle_range": _range(raw["step_idle_s"]),
        "step_during_range": _range(raw["step_during_write_s"]),
        "slowdown": slowdown,
        "blocked_met": blocked / sync <= 0.10,
        "slowdown_met": slowdown <= 0.10,
    }


def run(*, quick: bool = False, diagnose: bool = False) -> dict[str, Any]:
    """Measure at world size 1 (the slowdown target) and 2 (unless quick); with
    ``diagnose``, also each of :data:`VARIANTS` at world size 1.

    World size 1 leaves a core for the background writer, as a GPU training job leaves the
    host CPU mostly free; at world size 2 the two ranks fill both cores.

    Returns:
        ``{"runs": [world 1 summary, world 2 summary?], "diagnosis": [...], ...}``; the
        slowdown verdict is world 1's, the blocked verdict every run's.
    """
    width = QUICK_WIDTH if quick else WIDTH
    repeats = 3 if quick else 5
    runs = []
    for world_size in (1, *(() if quick else (2,))):
        with tempfile.TemporaryDirectory(prefix="bench_async_save-") as directory:
            raw = run_distributed(_measure, world_size, width, directory, repeats, timeout=1800)
        runs.append({**_summarize(raw[0]), "repeats": repeats})
    diagnosis = []
    for variant in VARIANTS if diagnose else ():
        with tempfile.TemporaryDirectory(prefix="bench_async_save-") as directory:
            raw = run_distributed(_measure, 1, width, directory, 3, variant, timeout=1800)
        diagnosis.append({**_summarize(raw[0]), "repeats": 3, "variant": variant})
    return {
        "quick": quick,
        "runs": runs,
        "diagnosis": diagnosis,
        "blocked_share": max(r["blocked_share"] for r in runs),
        "slowdown": runs[0]["slowdown"],
        "blocked_met": all(r["blocked_met"] for r in runs),
        "slowdown_met": runs[0]["slowdown_met"],
    }


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s result: one column per world size."""
    runs = result["runs"]
    first = runs[0]["raw"]
    lines = [
        f"{first['parameters'] / 1e6:.1f} M parameters (fp32) + Adam, batch {BATCH} x {SEQ} "
        "tokens; medians (min-max) of interleaved repeats. The slowdown target applies to "
        "world size 1 (a core left for the writer, as on a GPU node); at world size 2 the two "
        "ranks fill both cores.",
        "",
        "| measure | " + " | ".join(f"world {r['world_size']}" for r in runs) + " | target |",
        "|---|" + "---:|" * len(runs) + "---|",
    ]

    def row(name: str, cells: list[str], target: str = "") -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {target} |")

    def verdict(met: bool) -> str:
        return "met" if met else "NOT met"

    row(
        "repeats x steps after each async save",
        [f"{r['repeats']} x {r['raw']['steps_per_repeat']}" for r in runs],
    )
    row("steps that ran during a write (per repeat)", [str(r["raw"]["write_steps"]) for r in runs])
    row("synchronous save (s)", [f"{r['sync_s']:.3f}" for r in runs])
    row("async save, training blocked (s)", [f"{r['blocked_s']:.3f}" for r in runs])
    row(
        "blocked / synchronous",
        [f"{r['blocked_share']:.1%}" for r in runs],
        f"<= 10%: {verdict(result['blocked_met'])}",
    )
    row(
        "step, nothing in flight (s)",
        [f"{r['step_idle_s']:.3f} ({r['step_idle_range']})" for r in runs],
    )
    row(
        "step, during the write (s)",
        [f"{r['step_during_s']:.3f} ({r['step_during_range']})" for r in runs],
    )
    row(
        "slowdown during the write",
        [f"{r['slowdown']:+.1%}" for r in runs],
        f"<= 10% at world size 1: {verdict(result['slowdown_met'])}",
    )
    if any(r["raw"]["repeats_write_outlasted_steps"] for r in runs):
        lines.append(
            "\nNote: in some repeats the write outlasted the steps after it; the rest was "
            "waited for (not counted as blocked)."
        )
    if result.get("diagnosis"):
        lines += [
            "",
            "Where the slowdown goes (world size 1, 3 repeats each; see the module docstring):",
            "",
            "| background activity | step idle s (min-max) | step during s (min-max) "
            "| steps during | slowdown |",
            "|---|---:|---:|---:|---:|",
        ]
        for d in result["diagnosis"]:
            lines.append(
                f"| {d['variant']} | {d['step_idle_s']:.3f} ({d['step_idle_range']}) "
                f"| {d['step_during_s']:.3f} ({d['step_during_range']}) "
                f"| {sum(d['raw']['write_steps'])} | {d['slowdown']:+.1%} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the result as JSON.

    ``--diagnose`` also runs the background activities of :data:`VARIANTS`.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    diagnose = "--diagnose" in argv
    argv = [a for a in argv if a != "--diagnose"]
    measure = functools.partial(run, diagnose=diagnose)
    return bench_main(__doc__, measure, format_table, "3.2 M parameters, 3 repeats", argv)


if __name__ == "__main__":
    sys.exit(main())
