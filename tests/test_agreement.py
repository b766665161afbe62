"""``Ranks.exchange``: the round that carries each rank's data also carries its outcome."""

from __future__ import annotations

from typing import Any

from lightning_megatron_fsdp.agreement import Outcomes, Ranks
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
