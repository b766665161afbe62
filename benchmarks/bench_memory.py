"""Benchmark 4: peak resident memory per rank while saving and loading a checkpoint.

A sharded checkpoint should never gather: while a rank saves or loads, its memory should
grow by a fraction of what it already holds (its model shards and optimizer state, the
"resident state"), not by the model. Targets (issues 6 and 13): peak during a save at most
1.25x and during a load at most 1.3x the resident state, i.e. peak minus the pre-operation
baseline <= 0.25x (0.3x) resident state (the state itself is already in the baseline). The
``consolidate`` half is :mod:`benchmarks.bench_consolidate_memory`.

Setup: both models of :mod:`benchmarks.bench_save_load` (``bench``: 50 M parameters in few
large tensors; ``gpt``: 98 M parameters in a GPT's tensor-size mix) with Adam, sharded on 2
real ranks (gloo, CPU). Each rank measures its own process, for: a synchronous save and a
load through ``MegatronFSDPCheckpointIO`` with default options (CRC32C written and verified
as the bytes pass; records read straight into the targets), a save with
``write_checksums=False``, a load with ``atomic_load=True`` (reads into a CPU copy of the
targets by design), an async save (the call plus the background write and commit, until
``wait()`` returns; it holds a CPU copy by design): first with the plugin's staging copy
dropped (the first async save allocates it), then again (it reuses the copy it holds
between saves, so that copy is in the baseline), and, for scale,
``torch.save``/``torch.load`` of the same local tensors. State dicts, chunk hooks and (on
load) applying the optimizer state and refreshing the model weights are inside the
measured window, as the strategy does them.

How the peak is measured: Linux keeps each process's resident-set high-water mark
(``VmHWM`` in ``/proc/self/status``) and resets it to the current RSS when ``5`` is written
to ``/proc/self/clear_refs``. Before each operation the rank collects garbage, returns freed
heap to the OS (glibc ``malloc_trim``, so memory kept from an earlier operation cannot hide
this one's allocations), resets the mark and reads ``VmRSS`` as the baseline; afterwards it
reads ``VmHWM``. Exact, with no sampling interval to miss a short spike, and it covers
every thread of the process (DCP's writer and the async commit thread). Alternatives
rejected: a sampling thread reading ``VmRSS`` (misses peaks shorter than its period and
competes for the 2 cores); ``ru_maxrss`` (cannot be reset, so only the first operation
of a process would be visible). Page cache is not resident-set memory, so file data the
kernel buffers is not counted on either side.

Run: ``python -m benchmarks.bench_memory [--quick] [--json PATH]`` from the repo root (Linux).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.bench_save_load import (
    MODELS,
    QUICK_WIDTH,
    WIDTH,
    bench_main,
    build_sharded,
    load_state,
    local_tensors,
    median,
    resident_bytes,
    save_state,
)
from lightning_megatron_fsdp import MegatronFSDPCheckpointIO
from tests.harness import run_distributed

__all__ = ["format_table", "main", "run"]

MB = 1e6
# The operations the targets are about, with their bound on peak / resident state: the
# default plugin's save and load, and a save without checksums for comparison.
TARGETS = {"save": 1.25, "save (write_checksums=False)": 1.25, "load": 1.30}
TARGETED = tuple(TARGETS)
OPERATIONS = (
    "save",
    "save (write_checksums=False)",
    "load",
    "load (atomic_load=True)",
    "async save (first: allocates its copy)",
    "async save (next: reuses the copy)",
    "torch.save",
    "torch.load",
)
BY_DESIGN = {
    "load (atomic_load=True)": "(holds a full copy by design)",
    "async save (first: allocates its copy)": "(holds a full copy by design)",
    "async save (next: reuses the copy)": "(the copy is held between saves)",
}
FIRST_ASYNC = "async save (first: allocates its copy)"


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _release_free_heap() -> None:
    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def _peak_extra(fn: Callable[[], Any]) -> int:
    """Peak RSS during ``fn`` minus RSS right before it, in bytes (this process)."""
    dist.barrier()
    _release_free_heap()
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_bytes("VmRSS")
    fn()
    extra = _status_bytes("VmHWM") - baseline
    dist.barrier()
    return extra


def _save(
    model: nn.Module, optimizer: torch.optim.Optimizer, io: MegatronFSDPCheckpointIO, path: Path
) -> None:
    io.save_checkpoint(save_state(model, optimizer), path)


def _async_save(
    model: nn.Module, optimizer: torch.optim.Optimizer, io: MegatronFSDPCheckpointIO, path: Path
) -> None:
    io.save_checkpoint(save_state(model, optimizer), path)
    io.wait()


def _torch_save(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    with open(path, "wb") as file:
        torch.save(local_tensors(save_state(model, optimizer)), file)
        file.flush()
        os.fsync(file.fileno())


def _measure(
    rank: int, world_size: int, width: int, kind: str, directory: str, repeats: int
) -> dict[str, Any]:
    model, optimizer = build_sharded(width, world_size, kind)
    state = resident_bytes(model, optimizer)
    tensors = local_tensors(save_state(model, optimizer)).values()
    largest = max(t.numel() * t.element_size() for t in tensors)
    del tensors
    root = Path(directory)
    io = MegatronFSDPCheckpointIO()
    unhashed_io = MegatronFSDPCheckpointIO(write_checksums=False)
    atomic_io = MegatronFSDPCheckpointIO(atomic_load=True)
    async_io = MegatronFSDPCheckpointIO(async_save=True)
    # Warm-up outside the measurement: the async plugin's background process group and
    # DCP's first-use imports would otherwise count against the first measured save.
    _async_save(model, optimizer, async_io, root / "warm")
    load_state(model, optimizer, io, str(root / "warm"))
    extras: dict[str, list[int]] = {op: [] for op in OPERATIONS}
    for repeat in range(repeats):
        checkpoint = root / f"ckpt-{repeat}"
        unhashed = root / f"unhashed-{repeat}"
        mine = root / f"rank{rank}-{repeat}.pt"
        steps: list[tuple[str, Callable[[], Any]]] = [
            ("save", functools.partial(_save, model, optimizer, io, checkpoint)),
            (
                "save (write_checksums=False)",
                functools.partial(_save, model, optimizer, unhashed_io, unhashed),
            ),
            ("load", functools.partial(load_state, model, optimizer, io, str(checkpoint))),
            (
                "load (atomic_load=True)",
                functools.partial(load_state, model, optimizer, atomic_io, str(checkpoint)),
            ),
            (FIRST_ASYNC, functools.partial(_async_save, model, optimizer, async_io, checkpoint)),
            (
                "async save (next: reuses the copy)",
                functools.partial(_async_save, model, optimizer, async_io, checkpoint),
            ),
            ("torch.save", functools.partial(_torch_save, model, optimizer, mine)),
            ("torch.load", functools.partial(torch.load, mine, weights_only=True)),
        ]
        for op, fn in steps:  # load reads what save wrote: the order is fixed
            if op == FIRST_ASYNC:  # drop the copy the plugin holds from its last async save
                async_io._staging.release()
            extras[op].append(_peak_extra(fn))
        dist.barrier()
        mine.unlink()
        if rank == 0:
            shutil.rmtree(checkpoint)
            shutil.rmtree(unhashed)
    async_io.teardown()
    return {
        "rank": rank,
        "model": kind,
        "parameters": sum(p.numel() for p in model.parameters()),  # global shapes
        "state_bytes": state,
        "largest_bytes": largest,
        "extra_bytes": extras,
    }


def run(*, quick: bool = False) -> dict[str, Any]:
    """Measure both models at world size 2; each rank's worst extra per operation, verdicts."""
    if not Path("/proc/self/clear_refs").exists():
        raise SystemExit("bench_memory: needs Linux /proc (VmHWM, clear_refs).")
    width = QUICK_WIDTH if quick else WIDTH
    repeats = 3
    rows = []
    for kind in MODELS:
        with tempfile.TemporaryDirectory(prefix="bench_memory-") as directory:
            ranks = run_distributed(_measure, 2, width, kind, directory, repeats, timeout=1800)
        for op in OPERATIONS:
            for r in ranks:
                extra = max(r["extra_bytes"][op])
                ratio = 1 + extra / r["state_bytes"]
                rows.append(
                    {
                        "model": kind,
                        "parameters": r["parameters"],
                        "operation": op,
                        "rank": r["rank"],
                        "state_mb": r["state_bytes"] / MB,
                        "largest_local_mb": r["largest_bytes"] / MB,
                        "extra_mb_max": extra / MB,
                        "extra_mb_min": min(r["extra_bytes"][op]) / MB,
                        "extra_mb_median": median(r["extra_bytes"][op]) / MB,
                        "peak_over_state": ratio,
                        "met": ratio <= TARGETS[op] if op in TARGETS else None,
                    }
                )
    return {
        "quick": quick,
        "repeats": repeats,
        "rows": rows,
        "met": {op: all(r["met"] for r in rows if r["operation"] == op) for op in TARGETED},
        "worst": {
            op: max(r["peak_over_state"] for r in rows if r["operation"] == op) for op in OPERATIONS
        },
    }


def format_table(result: dict[str, Any]) -> str:
    """A Markdown table of ``run``'s result."""
    lines = [
        f"fp32 + Adam, world size 2; per rank, worst of {result['repeats']} repeats (min and "
        "median in brackets). 'peak / state' = (state + worst peak extra) / state; targets: "
        + ", ".join(f"{op} <= {bound}x" for op, bound in TARGETS.items())
        + ".",
        "",
        "| model | operation | rank | resident state MB | largest local tensor MB "
        "| peak extra MB, worst (min, median) | peak / state | target |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        target = {True: "met", False: "NOT met", None: "(reference)"}[row["met"]]
        target = BY_DESIGN.get(row["operation"], target)
        lines.append(
            f"| {row['model']} ({row['parameters'] / 1e6:.0f} M) | {row['operation']} "
            f"| {row['rank']} | {row['state_mb']:.0f} | {row['largest_local_mb']:.1f} "
            f"| {row['extra_mb_max']:.1f} ({row['extra_mb_min']:.1f}, "
            f"{row['extra_mb_median']:.1f}) | {row['peak_over_state']:.3f}x | {target} |"
        )
    verdicts = "; ".join(
        f"{op} <= {TARGETS[op]}x: {'met' if met else 'NOT met'}"
        for op, met in result["met"].items()
    )
    lines.append(f"\n{verdicts}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table, optionally write the result as JSON."""
    return bench_main(__doc__, run, format_table, "small models", argv)


if __name__ == "__main__":
    sys.exit(main())
