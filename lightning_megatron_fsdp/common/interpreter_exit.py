"""The process's end: an ``atexit`` hook destroys the process groups, then waits (bounded)
until gloo's worker threads are idle, so none needs Python once the interpreter finalises.
Without it a gloo job can abort after its results were written (docs/DESIGN.md,
"Lifecycle").
"""

from __future__ import annotations

import atexit
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

__all__ = ["EXIT_WAIT", "register_exit_hook", "wait_for_idle_gloo_workers"]

EXIT_WAIT = 10.0  # seconds the exit hook waits at most for gloo's workers to go idle
_POLL = 0.001  # seconds between two readings of the workers' states
_READINGS = 3  # consecutive all-idle readings that end the wait
_WORKER_NAME = "pt_gloo_runloop"  # the name torch gives gloo's worker threads
# The futex syscall's number by machine, where glibc's pthread_cond_wait is known to wait
# with FUTEX_WAIT_BITSET (elsewhere the worker's state, running or not, is all there is).
_FUTEX = (
    {"x86_64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}.get(
        platform.machine()
    )
    if platform.libc_ver()[0] == "glibc"
    else None
)
_FUTEX_CMD = 0x7F  # the command bits of a futex op (the rest: PRIVATE, CLOCK_REALTIME)
_FUTEX_WAIT_BITSET = 9
_TASKS = Path("/proc/self/task")
_MAPS = Path("/proc/self/maps")
# The OpenMP runtimes torch builds link (GNU, Intel, LLVM), by the start of a file name.
_OPENMP_RUNTIMES = ("libgomp", "libiomp", "libomp")
_EXIT_HOOKS: list[Callable[[], None]] = []  # the atexit hook, once registered (one per process)


def _gloo_workers() -> list[Path]:
    """The task directories of this process's gloo worker threads (none off Linux)."""
    try:
        tasks = list(_TASKS.iterdir())
    except OSError:
        return []
    workers = []
    for task in tasks:
        try:
            if (task / "comm").read_text().strip() == _WORKER_NAME:
                workers.append(task)
        except OSError:  # the thread ended meanwhile
            continue
    return workers


def _openmp_code() -> list[tuple[int, int]]:
    """The address ranges of the OpenMP runtimes' code mapped in this process."""
    ranges = []
    try:
        lines = _MAPS.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or "x" not in fields[1]:
            continue
        if Path(fields[5]).name.startswith(_OPENMP_RUNTIMES):
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _is_idle(task: Path, openmp: list[tuple[int, int]]) -> bool:
    """Whether a gloo worker waits for work (so it holds and frees no tensor).

    ``openmp``: the OpenMP runtimes' code (:func:`_openmp_code`); a thread waiting there
    is an OpenMP pool thread that inherited a worker's name, idle between parallel loops.
    """
    if _FUTEX is not None:
        try:
            syscall = (task / "syscall").read_text().split()
        except OSError:  # the thread ended, or the kernel does not show syscalls
            syscall = []
        if len(syscall) > 2:  # "<nr> <args...> <sp> <pc>": where the wait was made from
            pc = int(syscall[-1], 16)
            if any(start <= pc < end for start, end in openmp):
                return True
        if syscall:
            # "<nr> <uaddr> <op> <val> <timeout> ..." or "running". runLoop's wait for work
            # is glibc's pthread_cond_wait: FUTEX_WAIT_BITSET without a timeout. A lock
            # (FUTEX_WAIT: perhaps behind a preempted holder) or a timed wait is not idle.
            return (
                len(syscall) > 4
                and syscall[0] == str(_FUTEX)
                and int(syscall[2], 16) & _FUTEX_CMD == _FUTEX_WAIT_BITSET
                and int(syscall[4], 16) == 0
            )
    try:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # the thread ended
    return state not in ("R", "D")


def wait_for_idle_gloo_workers(timeout: float = EXIT_WAIT) -> bool:
    """Sleep, the GIL released, until every gloo worker thread is idle.

    Args:
        timeout: seconds to wait at most.

    Returns:
        True when the workers were idle for ``_READINGS`` readings in a row (at once when
        there are none); False when ``timeout`` passed first.
    """
    deadline = time.monotonic() + timeout
    openmp = _openmp_code()
    idle_readings = 0
    while idle_readings < _READINGS:
        workers = _gloo_workers()
        if not workers:
            return True
        idle = all(_is_idle(task, openmp) for task in workers)
        idle_readings = idle_readings + 1 if idle else 0
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL)
    return True


def _leave_cleanly() -> None:
    """The exit hook: destroy the process groups, then wait for gloo's workers."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if not wait_for_idle_gloo_workers():
        print(
            f"lightning-megatron-fsdp: a gloo collective was still in flight {EXIT_WAIT:.0f} s "
            "after the end of the script (a peer that never joined it?); leaving anyway, and "
            "the interpreter may abort at exit (exit code 134).",
            file=sys.stderr,
            flush=True,
        )


def register_exit_hook() -> None:
    """Register, once per process, the hook that ends the process groups at exit.

    Lightning registers ``destroy_process_group`` at exit for NCCL only; this hook runs
    for every backend and waits for gloo's workers (see the module docstring).
    """
    if _EXIT_HOOKS:
        return
    atexit.register(_leave_cleanly)
    _EXIT_HOOKS.append(_leave_cleanly)
