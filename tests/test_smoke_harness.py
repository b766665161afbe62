"""The multi-rank harness reports results, a failing rank's traceback, and hangs."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed


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
