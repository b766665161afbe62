"""The exit abort, distilled: a gloo worker thread needs Python while the interpreter finalises.

Two triggers, each with the process group still held when the script ends (as a model or a
mesh holds it, so destroying the registry does not free the group and join its workers):

* ``release`` (what aborts real runs): 20 synchronous ``all_reduce`` calls on temporaries.
  Gloo's worker drops the last reference to each one's tensor after ``wait()`` returned;
  the Python object is gone by then, so freeing the tensor takes the GIL. Both threads share
  one core and the main thread keeps the GIL (a 1 s switch interval) until finalisation
  frees the group, whose destructor hands the GIL to the worker: ended by ``pthread_exit``
  through ``noexcept`` destructors, "terminate called without an active exception".
* ``callback``: rank 0 starts an async ``all_reduce`` with a Python callback on its future
  and leaves at once; rank 1 joins a second later, and the callback runs on the worker.

With ``exit_hook``, the strategy's exit hook is registered first: it destroys the groups
and waits until gloo's workers are idle, while the interpreter is still whole.

    python tests/scripts/pending_gloo_work.py {no_hook|exit_hook} {release|callback}
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

if __name__ == "__main__":
    hook, trigger = sys.argv[1:3]
    if hook == "exit_hook":  # imported first: the import is slow, the timing is the point
        from lightning_megatron_fsdp.strategies.interpreter_exit import register_exit_hook
    if trigger == "release":  # before the group exists: its threads inherit the one core
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if hook == "exit_hook":
        register_exit_hook()
    group = dist.group.WORLD  # held to the end, as a model holds its mesh's groups
    rank = dist.get_rank()
    if trigger == "release":
        sys.setswitchinterval(1.0)
        for _ in range(20):
            dist.all_reduce(torch.ones(4))
    else:
        if rank == 1:
            time.sleep(1.0)
        work = dist.all_reduce(torch.ones(1 << 20), async_op=True)
        work.get_future().then(lambda future: future.value())
    print(f"finished rank {rank}", flush=True)
