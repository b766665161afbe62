"""Helpers for ``@pytest.mark.gpu`` tests: pick the ranks, and prove the test ran on CUDA.

``tests/conftest.py`` skips GPU tests where CUDA is absent; these helpers turn a GPU test
that would run on zero devices (and assert over an empty list) into a failure instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["assert_ran_on_cuda", "cuda_world_size"]


def cuda_world_size(most: int = 2) -> int:
    """Number of ranks for a multi-rank GPU test: one per GPU, at most ``most``.

    Raises:
        AssertionError: If there is no CUDA device (the test should have been skipped).
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert count >= 1, (
        f"a GPU test found {count} CUDA devices: it must be skipped (tests/conftest.py), "
        "not run on none"
    )
    return min(count, most)


def assert_ran_on_cuda(devices: Sequence[Any], world_size: int) -> None:
    """Every one of ``world_size`` ranks reported a CUDA device (``devices[rank]``).

    Raises:
        AssertionError: If a rank is missing or reported another device type.
    """
    assert world_size >= 1 and len(devices) == world_size, (world_size, devices)
    for rank, device in enumerate(devices):
        assert torch.device(device).type == "cuda", f"rank {rank} ran on {device}"
