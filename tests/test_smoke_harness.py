"""The multi-rank harness reports results, a failing rank's traceback, and hangs; commands
a test spawns do not outlive it."""

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import (
    LaunchTimeoutError,
    communicate_all,
    run_command,
    run_distributed,
    spawned,
)


def _sum_ranks(rank: int, world_size: int) -> int:
    t = torch.tensor([rank])
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _hang(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def _die(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(7)


def test_results_by_rank() -> None:
    assert run_distributed(_sum_ranks, 3) == [3, 3, 3]


def test_failing_rank_traceback_is_shown() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed.*ValueError: boom on rank one"):
        run_distributed(_fail_on_one, 2, timeout=60)


def test_hang_is_killed_and_named() -> None:
    with pytest.raises(AssertionError, match=r"ranks \[0\] did not finish within 3s"):
        run_distributed(_hang, 2, timeout=3, init_process_group=False)


def test_dead_rank_is_named() -> None:
    with pytest.raises(AssertionError, match=r"(?s)rank 0 failed.*exit code 7"):
        run_distributed(_die, 2, timeout=30, init_process_group=False)


def _return_tensor(rank: int, world_size: int) -> torch.Tensor:
    return torch.full((3,), float(rank))


def test_tensors_come_back_by_value() -> None:
    values = run_distributed(_return_tensor, 2, init_process_group=False)
    assert [v.tolist() for v in values] == [[0.0] * 3, [1.0] * 3]


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie nobody reaped yet counts as dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# A shell that starts a grandchild and reports its pid, then waits on it: longer than
# pytest-timeout, so a cleanup that waited for it instead of killing it fails the test.
_FAMILY = ["sh", "-c", "sleep 600 & echo $!; wait"]


def test_spawned_commands_die_with_the_test_that_failed() -> None:
    """An assertion failing while a command runs: the command and its child are killed."""
    with pytest.raises(AssertionError, match="a check failed"), spawned(_FAMILY) as process:
        assert process.stdout is not None
        grandchild = int(process.stdout.readline())
        assert _running(process.pid) and _running(grandchild)
        raise AssertionError("a check failed")
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)  # the orphan is reaped by whoever adopts it
    assert not _running(process.pid) and not _running(grandchild)


def test_run_command_kills_a_command_that_times_out() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(_FAMILY, timeout=1)
    completed = run_command(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (completed.returncode, completed.stdout, completed.stderr) == (3, "out\n", "err\n")


def test_communicate_all_kills_each_session_when_time_runs_out(tmp_path: Path) -> None:
    """Launched ranks (torchrun agents and their workers) die with a test that timed out."""
    pid_files = [tmp_path / f"child{i}" for i in range(2)]
    processes = [
        subprocess.Popen(
            ["sh", "-c", f"sleep 600 & echo $! > {path}; wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for path in pid_files
    ]
    deadline = time.monotonic() + 10
    while not all(p.exists() and p.read_text().strip() for p in pid_files):
        assert time.monotonic() < deadline, "the shells did not start their children"
        time.sleep(0.05)
    children = [int(p.read_text()) for p in pid_files]
    with pytest.raises(subprocess.TimeoutExpired):
        communicate_all(processes, timeout=1)
    deadline = time.monotonic() + 10
    while any(map(_running, children)) and time.monotonic() < deadline:
        time.sleep(0.05)  # the orphans are reaped by whoever adopts them
    assert not any(_running(p.pid) for p in processes)
    assert not any(map(_running, children)), children


def test_communicate_all_stops_waiting_soon_after_one_fails() -> None:
    """A peer left waiting by a process that failed costs the grace period, not the
    timeout, and the error shows both: the failure's exit code and output, and the peer."""

    def launch(script: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    processes = [launch("echo could not bind; exit 3"), launch("echo waiting; exec sleep 600")]
    started = time.monotonic()
    with pytest.raises(LaunchTimeoutError) as raised:
        communicate_all(processes, timeout=120, grace=1)
    assert time.monotonic() - started < 30
    report = str(raised.value)
    assert report.startswith("1 of 2 launched processes did not finish"), report
    assert "process 0: exit code 3\ncould not bind" in report, report
    assert "process 1: still running (killed)\nwaiting" in report, report
    assert all(p.returncode is not None for p in processes)
    # Finished processes are returned as they ended, whatever their exit codes.
    done = [launch("echo fine"), launch("echo bad; exit 5")]
    assert communicate_all(done, timeout=30, grace=1) == [(0, "fine\n"), (5, "bad\n")]
