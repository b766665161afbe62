"""Benchmark: bytes a load reads from storage, against the checkpoint's size.

Question: does a load read each replicated record once (``checkpoint/replicated_reads.py``),
or once per replica? A replicated tensor (HSDP's replica dimension, ``NO_SHARD``, Adam's
``step``) is written once; without the sharing each replica reads it again, so at 64
replicas a bucket serves 64 times the checkpoint.

Setup: ``examples/train_gpt.py``'s ``GPT`` (``--width``/``--depth``), every block a unit,
AdamW, two training steps, through the real Fabric strategy on 2 real ranks (gloo, CPU),
per mode saved with ``fabric.save`` to a local directory and to a SeaweedFS bucket on
loopback (``tests/object_store.py``; skipped without the ``weed`` binary), then loaded
with ``fabric.load`` into the same model, ``--repeats`` times per side. The plugin's
readers count the bytes of the records they read and checked (``ReadProgress``); a load's
figure is the sum over both ranks. "before" is the same load with the sharing switched off
(every rank reads all its targets, as before the change); "after" is the default. Times
are the slowest rank's medians.

Run: ``python -m benchmarks.bench_replicas_load [--width 256] [--depth 4] [--repeats 3]``
from the repo root (megatron-fsdp 0.7 adds ``NO_SHARD``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from benchmarks.bench_replicas import gpt_arguments, launched_fabric, train_gpt_example
from lightning_megatron_fsdp.checkpoint import load as load_module
from lightning_megatron_fsdp.checkpoint.replicated_reads import ReplicaPlan
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.storage import VerifyingFileSystemReader
from tests.harness import run_distributed
from tests.object_store import SeaweedServer, weed_binary
from tests.test_replicated_reads import CountingStorage

WORLD_SIZE = 2

MODES: list[tuple[str, str, tuple[int, int] | None]] = [
    ("FULL_SHARD", "FULL_SHARD", None),
    ("HYBRID_SHARD (2,1)", "HYBRID_SHARD", (2, 1)),
]
if _megatron.REPLICATED_PARAMETERS:
    MODES.append(("NO_SHARD", "NO_SHARD", None))


@contextlib.contextmanager
def _every_rank_reads_all() -> Iterator[None]:
    """The load as before the sharing: no replicated target left to another rank."""
    planned = load_module.plan_replicated_reads
    load_module.plan_replicated_reads = lambda state, saved, ranks: ReplicaPlan(state, {}, ())
    try:
        yield
    finally:
        load_module.plan_replicated_reads = planned


def _record_bytes(path: Path) -> tuple[int, int]:
    """The checkpoint's records, each once: all of them, the tensor records."""
    metadata = VerifyingFileSystemReader(path).read_metadata()
    tensors = {
        fqn
        for fqn, entry in metadata.state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    lengths = [(index.fqn in tensors, info.length) for index, info in metadata.storage_data.items()]
    return sum(n for _, n in lengths), sum(n for tensor, n in lengths if tensor)


def _rank(
    rank: int,
    world_size: int,
    env: dict[str, str] | None,
    bucket: str | None,
    root: str,
    width: int,
    depth: int,
    repeats: int,
) -> list[dict[str, Any]]:
    if env:
        os.environ.update(env)
    example = train_gpt_example()
    rows = []
    for name, mode, mesh in MODES:
        fabric = launched_fabric(example, mode, mesh, world_size)
        fabric.seed_everything(1234)
        model = fabric.setup_module(example.GPT(width=width, depth=depth))
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
        data = example.RepeatedPatterns(32, 32, 32, seed=rank)
        for i in range(2):
            batch = torch.stack([data[16 * i + j] for j in range(16)])
            logits = model(batch[:, :-1])
            fabric.backward(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
            optimizer.step()
            optimizer.zero_grad()
        checkpoint_io = fabric.strategy.checkpoint_io
        counting = CountingStorage(checkpoint_io.storage)
        checkpoint_io.storage = counting
        state = {"model": model, "optimizer": optimizer}
        local = Path(root) / mode
        places = [("local", str(local))]
        if bucket is not None:
            places.append(("s3", f"s3://{bucket}/{mode}"))
        for where, path in places:
            fabric.save(path, state)
            for side in ("before", "after"):
                times, counts = [], []
                for _ in range(repeats):
                    with _every_rank_reads_all() if side == "before" else contextlib.nullcontext():
                        dist.barrier()
                        start = time.perf_counter()
                        fabric.load(path, state)
                        dist.barrier()
                    times.append(time.perf_counter() - start)
                    counts.append(counting.take())
                rows.append(
                    {
                        "mode": name,
                        "where": where,
                        "side": side,
                        "records": _record_bytes(local) if rank == 0 else None,
                        "read": counts[0],
                        "same_every_time": len(set(counts)) == 1,
                        "time": statistics.median(times),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = gpt_arguments(__doc__, argv, width=256, depth=4, repeats=3)
    binary = weed_binary()
    with tempfile.TemporaryDirectory() as root:
        server = None
        env, bucket = None, None
        if binary is not None:
            server = SeaweedServer(Path(root, "seaweed"), binary)
            server.start()
            env, bucket = server.env, server.new_bucket()
        try:
            ranks = run_distributed(
                _rank,
                WORLD_SIZE,
                env,
                bucket,
                str(Path(root, "local")),
                args.width,
                args.depth,
                args.repeats,
                init_process_group=False,
                timeout=3600,
            )
        finally:
            if server is not None:
                server.stop()
    print(
        f"GPT width {args.width}, depth {args.depth}, AdamW, {WORLD_SIZE} ranks (gloo, CPU), "
        f"torch {torch.__version__}, megatron-fsdp {_megatron.VERSION}"
        + ("" if binary is not None else "; no `weed` binary, local only")
    )
    print(
        "bytes read per load, both ranks together (records read and CRC32C-checked), against"
        "\nthe checkpoint's records, each once; time: slowest rank's median of "
        f"{args.repeats}\n"
    )
    print(
        "| mode | storage | checkpoint tensor bytes | read: tensor bytes | x | all records | "
        "x | load s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for index, row in enumerate(ranks[0]):
        every, tensors = row["records"]
        read_all = sum(r[index]["read"][0] for r in ranks)
        read_tensors = sum(r[index]["read"][1] for r in ranks)
        slowest = max(r[index]["time"] for r in ranks)
        steady = all(r[index]["same_every_time"] for r in ranks)
        print(
            f"| {row['mode']} | {row['where']}, {row['side']} | {tensors:,} | "
            f"{read_tensors:,} | {read_tensors / tensors:.2f} | {read_all:,} | "
            f"{read_all / every:.2f} | {slowest:.3f}{'' if steady else ' (counts varied)'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
