"""The exit abort, distilled: a gloo worker thread needs Python while the interpreter finalises.

Rank 0 starts an ``all_reduce`` that rank 1 joins only when rank 0 lets it (``SIGUSR1``), so
rank 0's gloo worker finishes it, and then needs the GIL, when rank 0 chooses. The process
group is held to the end (as a model holds its mesh's groups), so destroying the registry
does not join the workers. The worker needs the GIL for a Python callback on the
collective's future (in real runs, as often to free a finished collective's tensors).

Without the hook (``no_hook``) rank 0 lets its peer join from the collection of garbage the
interpreter runs once it finalises (``gc`` is disabled so nothing collects it earlier): the
worker can take the GIL only after that, and finalisation's release of the group hands it
over, so every run ends in "terminate called without an active exception" (exit -6). With
``exit_hook`` the strategy's exit hook is registered, and rank 0 lets its peer join as it
begins to leave (an ``atexit`` handler registered after the hook, so it runs first): the
hook must wait for the collective while the interpreter is whole.

    python tests/scripts/pending_gloo_work.py {no_hook|exit_hook}
"""

from __future__ import annotations

import atexit
import gc
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

PEER_WAIT = 60.0  # seconds rank 1 waits for rank 0's go


class _GoAtFinalisation:
    """Sends rank 1 its go when collected: left in a cycle for finalisation's collection."""

    def __init__(self, go: object) -> None:
        self.go = go
        self.cycle = self

    def __del__(self) -> None:
        self.go()


if __name__ == "__main__":
    hook = sys.argv[1]
    # Blocked before gloo's threads start (they inherit it): rank 1 takes it with sigtimedwait.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if hook == "exit_hook":
        from lightning_megatron_fsdp.common.interpreter_exit import register_exit_hook

        register_exit_hook()
    group = dist.group.WORLD  # held to the end, as a model holds its mesh's groups
    rank = dist.get_rank()
    pids = torch.zeros(2, dtype=torch.int64)
    pids[rank] = os.getpid()
    dist.all_reduce(pids)  # kept: the worker never frees its Python object
    if rank == 0:
        peer = int(pids[1])

        def go() -> None:
            os.kill(peer, signal.SIGUSR1)

        work = dist.all_reduce(torch.ones(1 << 10), async_op=True)
        work.get_future().then(lambda future: future.value())
        del work
        if hook == "exit_hook":
            atexit.register(go)
        else:
            gc.disable()
            _GoAtFinalisation(go)
    else:
        if signal.sigtimedwait({signal.SIGUSR1}, PEER_WAIT) is None:
            sys.exit(f"rank 1: no go from rank 0 within {PEER_WAIT:.0f} s")
        joined = torch.ones(1 << 10)
        dist.all_reduce(joined)  # kept: the worker never frees its Python object
    print(f"finished rank {rank}", flush=True)
