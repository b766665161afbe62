"""A gloo worker that started an OpenMP pool: the exit hook's wait must see the pool as idle.

A collective on a large tensor makes gloo's worker run an ``at::parallel_for`` copy, which
starts an OpenMP pool from the worker thread; the pool's threads inherit the worker's name
(``pt_gloo_runloop``). Prints how many such threads wait inside the OpenMP runtime, and
whether :func:`wait_for_idle_gloo_workers` saw every worker idle within 5 s.

    python tests/scripts/openmp_pool_at_exit.py   (as 2 torchrun-style ranks)
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_megatron_fsdp.common import interpreter_exit

if __name__ == "__main__":
    torch.set_num_threads(2)  # a pool of one more thread, on any machine
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    output = torch.empty(2 << 20)
    dist.all_gather_into_tensor(output, torch.ones(1 << 20))
    time.sleep(1.0)  # the pool's threads spin a while before they wait
    # Where libgomp's code is mapped, read here (not from the module under test).
    gomp = [
        [int(address, 16) for address in line.split()[0].split("-")]
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "libgomp" in line and " r-x" in line
    ]
    pool = 0
    for task in Path("/proc/self/task").iterdir():
        if (task / "comm").read_text().strip() == "pt_gloo_runloop":
            fields = (task / "syscall").read_text().split()
            if len(fields) > 2 and any(a <= int(fields[-1], 16) < b for a, b in gomp):
                pool += 1
    print(f"openmp threads named like gloo's workers: {pool}", flush=True)
    print(f"idle: {interpreter_exit.wait_for_idle_gloo_workers(timeout=5.0)}", flush=True)
    dist.destroy_process_group()
    print(f"finished rank {rank}", flush=True)
