"""A gloo collective still in flight when the interpreter finalises: the exit abort, distilled.

Rank 0 starts an async ``all_reduce`` with a Python callback on its future and leaves
``main`` at once; rank 1 joins the collective a moment later. Gloo's worker thread then
completes the work, and runs the callback, while rank 0's interpreter is being torn down:
taking the GIL there ends the thread with a forced unwind through C++ ``noexcept`` frames,
and the process aborts with "terminate called without an active exception".

With ``exit_hook`` as argument, the strategy's own exit hook is registered first: it
destroys the process groups at ``atexit``, while the interpreter is still whole.

    python tests/scripts/pending_gloo_work.py [exit_hook]      # torchrun-style env vars
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

if __name__ == "__main__":
    hook = sys.argv[1:] == ["exit_hook"]
    if hook:  # imported first: the import is slow, the collective's timing is the point
        from lightning_megatron_fsdp.mesh import destroy_process_groups_at_exit
    dist.init_process_group("gloo")
    if hook:
        destroy_process_groups_at_exit()
    rank = dist.get_rank()
    tensor = torch.ones(1 << 20)
    if rank == 1:
        time.sleep(1.0)
    work = dist.all_reduce(tensor, async_op=True)
    work.get_future().then(lambda future: future.value())
    print(f"finished rank {rank}", flush=True)
