"""Run a function on N real processes joined in a gloo process group on loopback.

Each rank is a separate OS process forked from a forkserver that has pre-imported torch,
Lightning and megatron-fsdp, so a 4-rank test starts in well under a second, and no rank
inherits the pytest process's OpenMP or process-group state (plain ``fork`` would).

Failure modes, each turned into one ``AssertionError`` in the pytest process:
    * a rank raises: the message carries that rank's full traceback (every failing
      rank's, lowest rank first), and the other ranks are killed;
    * a rank hangs (for example in a collective its peer never joins): after
      ``timeout`` seconds every rank is killed and the message names the ranks that
      never reported;
    * a rank dies (segfault, ``os._exit``, SIGKILL): named with its exit code.

Tests that run a command (a script, the console script, ``torchrun``) use
:func:`spawned` or :func:`run_command`: the command runs in its own session, and whatever
of it is still running when the test leaves -- an assertion failed, a timeout expired, or
the command itself left children behind -- is killed, grandchildren included.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = [
    "THIRD_PARTY_WARNINGS",
    "LaunchTimeoutError",
    "communicate_all",
    "free_port",
    "run_command",
    "run_distributed",
    "spawned",
]

# PYTHONWARNINGS for the processes tests start: the named third-party warnings that
# pyproject.toml's filterwarnings silences in the pytest process, and no others.
THIRD_PARTY_WARNINGS = ",".join(
    [
        "ignore:Transformer Engine and Apex are not installed:UserWarning:"
        "megatron_fsdp.mixed_precision",
        "ignore:torch.distributed is disabled:UserWarning:torch.distributed.checkpoint.utils",
    ]
)

_PRELOAD = [
    "torch",
    "torch.distributed.checkpoint",
    "megatron_fsdp.experimental",
    "lightning.pytorch",
    "lightning_megatron_fsdp",
]
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)

# Collectives of a rank whose peer failed give up after this long, well inside `timeout`.
PROCESS_GROUP_TIMEOUT = timedelta(seconds=45)


_PORT_RANGE = (20000, 32000)  # below Linux's ephemeral range (32768-60999)
_ports_taken = itertools.count()
# A port handed out is also locked (``flock``) in a folder every test session on this host
# shares, until this process exits or has handed out this many more.
_PORT_LOCKS = Path(tempfile.gettempdir()) / "lightning-megatron-fsdp-test-ports"
_ports_held: collections.deque[int] = collections.deque()
_PORTS_HELD = 512


def _lock_port(port: int) -> bool:
    """Whether ``port``'s lock was free and is now this process's (``True`` also where the
    folder cannot be used, another user's for example: the bind check alone decides)."""
    try:
        _PORT_LOCKS.mkdir(exist_ok=True)
        fd = os.open(_PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    _ports_held.append(fd)
    if len(_ports_held) > _PORTS_HELD:
        os.close(_ports_held.popleft())
    return True


def free_port() -> int:
    """Return a TCP port on loopback that was free a moment ago, for a server a test starts
    (SeaweedFS, a launched script's rank 0).

    Not one the kernel picks (``bind(0)``): that comes from the ephemeral range, which every
    outgoing connection (gloo opens many) also draws from, so it can be taken again between
    this call and the server binding it. Ports below that range are taken only by explicit
    binds; each process walks its own sequence through them, and a port locked by another
    test session on this host (the CI's passes run side by side) is skipped, so two callers
    are not handed one port.
    """
    low, high = _PORT_RANGE
    for _ in range(high - low):
        port = low + (os.getpid() * 7919 + next(_ports_taken) * 127) % (high - low)
        if not _lock_port(port):
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {low}-{high} on loopback")


def _rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The environment torchrun gives a rank, so Lightning sees an external launcher."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "NODE_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": THIRD_PARTY_WARNINGS,
    }


class LaunchTimeoutError(subprocess.TimeoutExpired):
    """Launched processes that did not finish in time, with what every process printed."""

    def __init__(self, timeout: float, report: str) -> None:
        super().__init__("launched processes", timeout)
        self.report = report

    def __str__(self) -> str:
        return self.report


def communicate_all(
    processes: list[Any], timeout: float, grace: float = 30.0
) -> list[tuple[int, str]]:
    """Each process's (exit code, combined output); on leaving, however it is left (time
    ran out, an output could not be read), every process's session is killed.

    The processes are waited for together, so a peer left hanging by one that failed
    (a torchrun agent whose partner could not bind its port, a rank whose peer died
    before a rendezvous) costs ``grace`` seconds and is reported next to the failure,
    instead of the whole ``timeout`` and a bare timeout error.

    Each process must have been started with ``start_new_session=True``, so its session
    holds its children too (a ``torchrun`` agent's workers, Lightning's relaunched ranks):
    ``Popen.kill`` alone would orphan them, still running, when the test fails.

    Args:
        processes: ``subprocess.Popen`` objects started with ``stdout=PIPE``, text mode,
            ``start_new_session=True``.
        timeout: Seconds all of them may take together.
        grace: Seconds the others may still take once one has exited non-zero.

    Raises:
        LaunchTimeoutError: Some did not finish; its message has every process's exit
            code (or "still running") and the tail of its output.
    """
    outputs: list[str | None] = [None] * len(processes)

    def read(index: int) -> None:
        outputs[index], _ = processes[index].communicate()

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(processes))]
    try:
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout
        while any(r.is_alive() for r in readers) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in processes):
                deadline = min(deadline, time.monotonic() + grace)
            for reader in readers:
                reader.join(0.1)
        running = [r.is_alive() for r in readers]
    finally:
        for process in processes:
            # The session outlives its leader while any member runs; none left: nothing to do.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for reader in readers:
            if reader.ident is not None:
                reader.join(10)
    if any(running):
        states = [
            f"process {i}: {'still running (killed)' if alive else f'exit code {p.returncode}'}"
            + "\n"
            + "\n".join((outputs[i] or "").splitlines()[-15:])
            for i, (p, alive) in enumerate(zip(processes, running, strict=True))
        ]
        raise LaunchTimeoutError(
            timeout,
            f"{sum(running)} of {len(processes)} launched processes did not finish "
            f"(timeout {timeout} s, {grace} s after a failure)\n" + "\n\n".join(states),
        )
    return [(p.returncode, outputs[i] or "") for i, p in enumerate(processes)]


def _worker(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    init_process_group: bool,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    results: Any,
) -> None:
    os.environ.update(_rank_env(rank, world_size, port))
    # Join the store ``run_distributed`` holds, as torchelastic's workers join their agent's.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    import torch

    torch.set_num_threads(1)
    try:
        if init_process_group:
            dist.init_process_group(
                "gloo", rank=rank, world_size=world_size, timeout=PROCESS_GROUP_TIMEOUT
            )
        value = fn(rank, world_size, *args, **kwargs)
        # Pickled here with plain pickle: multiprocessing's own pickler would pass torch
        # tensors through shared memory whose owner (this process) may exit before the
        # parent maps it ("connection reset"); plain pickle copies the bytes.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    init_process_group: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes.

    Args:
        fn: A module-level (picklable) function; its return value must be picklable
            (torch tensors included: they are copied, not shared).
        world_size: Number of ranks.
        *args: Extra positional arguments for ``fn``.
        timeout: Seconds for the whole run before every rank is killed.
        init_process_group: Join a gloo group first (leave it to Lightning when False;
            the torchrun-style environment variables are set either way).
        **kwargs: Extra keyword arguments for ``fn``.

    Returns:
        Each rank's return value, indexed by rank.

    Raises:
        AssertionError: If any rank raised, died or did not finish in time.
    """
    # The rendezvous store is served from here, on a port the kernel picked and that stays
    # bound for the whole run: no rank binds a port that another test, or another session
    # on this host, was handed too (two such rendezvous join each other's ranks). It lives
    # as long as the run, so a rank that joined a group twice would find the first one's
    # keys in it.
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=PROCESS_GROUP_TIMEOUT
    )
    port = store.port
    results = _CONTEXT.Queue()
    processes = [
        _CONTEXT.Process(
            target=_worker,
            args=(fn, rank, world_size, port, init_process_group, args, kwargs, results),
            name=f"rank{rank}",
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(failures) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(processes)
                    if not p.is_alive() and r not in values and r not in failures
                ]
                for r in dead:
                    # Give a rank that just reported a moment to land in the queue.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        failures[r] = f"process died with exit code {processes[r].exitcode}"
                        continue
                    if ok:
                        values[rank] = pickle.loads(value)
                    else:
                        failures[rank] = value
                continue
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures[rank] = value
                # One failing rank: give peers a short grace to report their own error.
                deadline = min(deadline, time.monotonic() + 15.0)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=10)
    missing = [r for r in range(world_size) if r not in values and r not in failures]
    if failures or missing:
        parts = [f"--- rank {r} failed ---\n{failures[r]}" for r in sorted(failures)]
        if missing:
            parts.append(f"--- ranks {missing} did not finish within {timeout:.0f}s (killed) ---")
        raise AssertionError(
            f"run_distributed({getattr(fn, '__name__', fn)}, world_size={world_size}):\n"
            + "\n".join(parts)
        )
    return [values[r] for r in range(world_size)]


@contextlib.contextmanager
def spawned(
    command: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | None = None
) -> Iterator[subprocess.Popen[str]]:
    """Start ``command`` (text pipes for stdout/stderr) in a new session; on leaving the
    block, however it is left, SIGKILL every process of that session still running.

    A new session makes the command's process group hold its children too (Lightning's
    rank 1, torchrun's workers), which ``Popen.kill`` would orphan.

    Args:
        command: The program and its arguments.
        env: The environment (``None``: this process's).
        cwd: The working directory (``None``: this process's).

    Yields:
        The running process; read its output with ``communicate``.
    """
    process = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        # The group outlives its leader while any member runs; none left: nothing to do.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()  # reap it and close the pipes


def run_command(
    command: Sequence[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to completion through :func:`spawned`; its output as text.

    Raises:
        subprocess.TimeoutExpired: After ``timeout`` seconds (everything it started is
            killed first).
    """
    with spawned(command, env=env, cwd=cwd) as process:
        stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(list(command), process.returncode, stdout, stderr)
