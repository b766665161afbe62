"""Benchmark: peak memory of ``consolidate_checkpoint`` against the largest tensor.

``export_lightning_checkpoint`` (``.ckpt`` rows; ``+optim`` with the Adam state) streams
through the same writer and is measured the same way.

``consolidate_checkpoint`` promises to stream: allocate one full tensor, fill it from its
chunks, write it, drop it. So its peak resident memory above the interpreter baseline
should be about the largest tensor (twice that when ``--dtype`` casts, for the cast copy),
not the model. Target (issue 5): peak - baseline <= 2 x largest tensor.

Setup: two real ranks (gloo, CPU) shard a model of one 64 MiB weight and six 16 MiB ones
with Megatron-FSDP and save it with ``MegatronFSDPCheckpointIO`` (160 MiB of weights, plus
2x that in Adam state, which is not exported). Each export then runs in a
fresh interpreter, which resets its resident-set high-water mark (``/proc/self/clear_refs``)
right before the call, so the peak is the export's own, measured from its baseline after
imports.

Run: ``python -m benchmarks.bench_consolidate_memory`` from the repository root (Linux).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    enable_cpu_execution,
    ensure_optimizer_state,
    shard_module,
)
from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from tests.harness import run_distributed

MIB = 1 << 20

# Runs in a fresh interpreter: baseline after imports, reset the high-water mark, export,
# report (baseline, peak, seconds) as JSON.
_CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
from lightning_megatron_fsdp.tools.export import consolidate_checkpoint
from lightning_megatron_fsdp.tools.lightning_checkpoint import export_lightning_checkpoint

def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)

checkpoint, output, dtype = sys.argv[1], sys.argv[2], (sys.argv[3] or None)
optimizer = dtype == "+optim"
Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
baseline = rss("VmRSS")
start = time.perf_counter()
if output.endswith(".ckpt"):
    export_lightning_checkpoint(checkpoint, output, optimizer=optimizer)
else:
    consolidate_checkpoint(checkpoint, output, dtype)
seconds = time.perf_counter() - start
print(json.dumps({"baseline": baseline, "peak": rss("VmHWM"), "seconds": seconds}))
"""


def _model() -> nn.Module:
    """One 4096x4096 weight (64 MiB fp32), six 2048x2048 (16 MiB each), biases."""
    return nn.Sequential(nn.Linear(4096, 4096), *(nn.Linear(2048, 2048) for _ in range(6)))


def _save(rank: int, world_size: int, directory: str) -> None:
    """Shard, create Adam state, save through ``MegatronFSDPCheckpointIO``."""
    from lightning_megatron_fsdp import fsdp_placements
    from lightning_megatron_fsdp.megatron._megatron import fully_shard_optimizer

    enable_cpu_execution()
    torch.manual_seed(0)
    model = _model()
    mesh = init_device_mesh("cpu", (world_size,))
    placements = fsdp_placements()
    shard_module(model, mesh, placements)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    fully_shard_optimizer(optimizer)
    ensure_optimizer_state(optimizer)
    model_sd = get_model_state_dict(model)
    optimizer_sd = get_optimizer_state_dict(model, optimizer)
    attach_uneven_dtensor_metadata(model, model_sd, optimizer_sd)
    checkpoint = {"state_dict": model_sd, "optimizer_states": [optimizer_sd], "global_step": 0}
    MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, directory)


def main() -> None:
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("bench_consolidate_memory: needs Linux /proc (VmHWM, clear_refs).")
    parameters = list(_model().parameters())
    total = sum(p.numel() * 4 for p in parameters)
    largest = max(p.numel() * 4 for p in parameters)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = Path(tmp) / "checkpoint"
        run_distributed(_save, 2, str(checkpoint), timeout=600)
        rows = []
        cases = [
            (".safetensors", ""),
            (".safetensors", "bf16"),
            (".pt", ""),
            (".pt", "bf16"),
            (".ckpt", ""),
            (".ckpt", "+optim"),  # export_lightning_checkpoint(optimizer=True), no cast
        ]
        for suffix, dtype in cases:
            output = Path(tmp) / f"model{dtype}{suffix}"
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-c", _CHILD, str(checkpoint), str(output), dtype],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
            if result.returncode != 0:
                sys.exit(f"export failed:\n{result.stderr}")
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            extra = measured["peak"] - measured["baseline"]
            rows.append(
                (
                    suffix,
                    dtype or "saved",
                    measured["baseline"] / MIB,
                    measured["peak"] / MIB,
                    extra / MIB,
                    extra / largest,
                    measured["seconds"],
                    time.perf_counter() - start,
                )
            )
            output.unlink()
    print(f"model tensors: {total / MIB:.0f} MiB, largest tensor: {largest / MIB:.0f} MiB (fp32)")
    print("target: peak - baseline <= 2.0 x largest tensor\n")
    header = (
        "format",
        "dtype",
        "baseline MiB",
        "peak MiB",
        "peak-base MiB",
        "x largest",
        "export s",
        "process s",
    )
    print(" | ".join(f"{h:>13}" for h in header))
    for row in rows:
        suffix, dtype, *numbers = row
        cells = [f"{suffix:>13}", f"{dtype:>13}"]
        cells += [f"{n:>13.1f}" if i != 3 else f"{n:>13.2f}" for i, n in enumerate(numbers)]
        print(" | ".join(cells))
    worst = max(row[5] for row in rows)
    print(f"\nworst: {worst:.2f} x largest tensor -> {'OK' if worst <= 2.0 else 'ABOVE TARGET'}")


if __name__ == "__main__":
    main()
