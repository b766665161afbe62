"""``Ranks.exchange``: the round that carries each rank's data also carries its outcome;
``Ranks.agree``: the error each problem carries, and the summary of their categories."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_megatron_fsdp.agreement import Outcomes, Problem, Ranks
from lightning_megatron_fsdp.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
)
from tests.harness import run_distributed


def _exchange(rank: int, world_size: int) -> Outcomes[dict[str, Any]]:
    error = f"rank {rank}: disk full" if rank == 1 else None
    return Ranks.of().exchange({"rank": rank, "files": [f"__{rank}_0.distcp"]}, error)


def test_exchange_gives_every_rank_every_payload_and_every_error() -> None:
    results = run_distributed(_exchange, 3, timeout=180)
    for outcomes in results:  # the same on every rank, in rank order
        assert outcomes.payloads == [{"rank": r, "files": [f"__{r}_0.distcp"]} for r in range(3)]
        assert outcomes.errors == [None, "rank 1: disk full", None]
        assert outcomes.failed == [1]
        assert outcomes.error_texts == ["rank 1: disk full"]


def test_exchange_without_a_group_is_this_process_alone() -> None:
    outcomes = Ranks(None, 0, 1).exchange("payload", None)
    assert outcomes.payloads == ["payload"]
    assert outcomes.failed == [] and outcomes.error_texts == []


def test_agree_raises_the_most_fundamental_class_and_counts_categories_not_phrases() -> None:
    """Each problem carries its error class and category: the class first in ``precedence``
    is raised, and the summary counts categories, whatever words the texts contain (a
    damaged file whose text says "shape" is not a shape problem)."""
    problems = [
        Problem(CheckpointMismatchError, "model 'w': missing dtype words", "shape"),
        Problem(CheckpointCorruptedError, "meta.pt: 2 bytes on disk (a shape of sorts)", "damaged"),
        Problem(CheckpointMismatchError, "model 'v': checksum of the words", "dtype"),
    ]
    with pytest.raises(CheckpointCorruptedError) as raised:
        Ranks.of().agree(
            problems,
            heading="Cannot load x",
            lost_peer_error=CheckpointError,
            precedence=(CheckpointCorruptedError, CheckpointMismatchError),
        )
    summary, *details = str(raised.value).splitlines()
    assert summary == (
        "Cannot load x: 3 problems (1 damaged, 1 shape, 1 dtype); first: meta.pt: 2 bytes on "
        "disk (a shape of sorts)"
    ), summary
    assert len(details) == 3, details
    with pytest.raises(TypeError, match="error must be an exception class, got 0"):
        Problem(0, "text")  # type: ignore[arg-type]
