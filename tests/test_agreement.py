"""``Ranks.exchange``: the round that carries each rank's data also carries its outcome;
``Ranks.agree``: the error each problem carries, and the summary of their categories;
``Ranks.raise_together``: one rank's error class of ours arrives as itself on every rank;
``peer_failures_explained``: an error torch.distributed raised is explained, whatever its
words, and no other is."""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_megatron_fsdp.agreement import (
    Outcomes,
    PeerLostError,
    Problem,
    Ranks,
    peer_failures_explained,
)
from lightning_megatron_fsdp.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    NotACheckpointError,
    error_category,
    error_class,
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


# Every class that may travel between ranks, one per category.
_TRAVELING: tuple[type[Exception], ...] = (
    CheckpointError,
    NotACheckpointError,
    CheckpointCorruptedError,
    CheckpointMismatchError,
    CheckpointSaveError,
    PeerLostError,
    TypeError,
    ValueError,
)


def _misleading(cls: type[Exception]) -> str:
    """A message naming every other category and the phrases a text matcher would key on."""
    others = ", ".join(error_category(c) for c in _TRAVELING if c is not cls)
    return f"rank 1 saw {others}; a missing key, not in the target, shape, dtype, checksum crc32c"


def _one_rank_fails(rank: int, world_size: int) -> list[tuple[str, str, str, str]]:
    """Rank 1 fails with each class in turn, through ``raise_together`` and ``agree``;
    every rank says what it raised: (path, class expected, class raised, message)."""
    ranks = Ranks.of()
    seen = []
    for cls in _TRAVELING:
        message = _misleading(cls)
        error = cls(message) if rank == 1 else None
        try:
            ranks.raise_together("doing it", error, CheckpointError, consequence="nothing done")
        except Exception as raised:
            expected = cls if issubclass(cls, CheckpointError) else CheckpointError  # by type
            seen.append(("raise_together", expected.__name__, type(raised).__name__, str(raised)))
        problems = [Problem(cls, message)] if rank == 1 else []
        try:
            ranks.agree(problems, heading="Cannot do it", lost_peer_error=CheckpointError)
        except Exception as raised:
            seen.append(("agree", cls.__name__, type(raised).__name__, str(raised)))
    # Ours but not a class the caller promises (not a CheckpointSaveError): the caller's.
    error = NotACheckpointError("not a checkpoint") if rank == 1 else None
    try:
        ranks.raise_together("saving", error, CheckpointSaveError, consequence="nothing written")
    except Exception as raised:
        seen.append(("not-a-subclass", "CheckpointSaveError", type(raised).__name__, str(raised)))
    return seen


def test_one_ranks_error_class_arrives_as_itself_on_every_rank_whatever_its_words() -> None:
    """For each category, the class rank 1 raised (or put in a problem) is the class every
    rank raises, with rank 1's message; a message full of the other categories' names and
    of the phrases a text matcher keys on changes nothing. Exceptions that are not ours
    become the caller's class, by type. (Before classes travelled by category,
    ``raise_together`` raised the caller's ``CheckpointError`` for a ``NotACheckpointError``,
    a ``CheckpointCorruptedError``, ...)"""
    assert len({error_category(cls) for cls in _TRAVELING}) == len(_TRAVELING)
    results = run_distributed(_one_rank_fails, 2, timeout=180)
    assert results[0] == results[1], "the ranks raised differently"
    assert len(results[0]) == 2 * len(_TRAVELING) + 1, results[0]
    for path, expected, raised, message in results[0]:
        assert raised == expected, (path, expected, raised, message)
        if path != "not-a-subclass":
            assert "rank 1 saw" in message and "checksum crc32c" in message, message


def test_problems_travel_as_category_strings_and_only_registered_classes_travel() -> None:
    """A problem is pickled as its class's category (no module or class name a peer must
    import), comes back as the same class, and counts as that category by default; a class
    that is not registered is refused where the problem is made, before any collective."""
    for cls in _TRAVELING:
        problem = Problem(cls, _misleading(cls))
        wire = pickle.dumps(problem)
        assert cls.__name__.encode() not in wire, wire
        assert pickle.loads(wire) == problem and pickle.loads(wire).error is cls
        assert problem.category == error_category(cls)
        assert error_class(error_category(cls)) is cls

    class UnregisteredError(CheckpointMismatchError):
        pass

    with pytest.raises(TypeError, match="cannot travel between ranks"):
        Problem(UnregisteredError, "text")
    with pytest.raises(TypeError, match="cannot travel between ranks"):
        Problem(KeyError, "text")


_EXPLAINED = "step failed in a collective with the other ranks"


def _explained(run: Any) -> str:
    """What ``peer_failures_explained`` lets out of ``run()``: its error's type and text."""
    try:
        with peer_failures_explained("step"):
            run()
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def _peer_hangs_then_leaves(rank: int, world_size: int, flag: str) -> list[str]:
    """Rank 1 stays out of rank 0's collective past a short group's timeout, then leaves;
    rank 0 says what each collective it tried raised, through ``peer_failures_explained``."""
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
    if rank == 1:
        while not Path(flag).exists():  # alive, connected, silent
            time.sleep(0.05)
        return []  # leaving closes its connections (the harness destroys its groups)

    def gather() -> None:
        dist.all_gather_object([None] * world_size, 0, group=short)

    hung = [_explained(gather), _explained(gather)]  # timed out, then the pairs it closed
    Path(flag).touch()
    return [
        *hung,
        _explained(sharded.full_tensor),  # DTensor's functional collective
        _explained(lambda: dist.all_reduce(torch.ones(2))),
    ]


def test_errors_torch_distributed_raised_are_explained_whatever_their_words(
    tmp_path: Path,
) -> None:
    """A hung peer (gloo: a timeout, then "Application timeout caused pair closure", no word
    a phrase list held) and a peer that left ("Connection closed by peer"), in a c10d and in
    a DTensor collective: each is explained, chained from gloo's error. (Explained by
    phrases, the closed pair passed through unexplained.)"""
    messages = run_distributed(_peer_hangs_then_leaves, 2, str(tmp_path / "go"))[0]
    assert len(messages) == 4, messages
    for message in messages:
        assert message.startswith(f"RuntimeError: {_EXPLAINED}"), message
        assert "another rank probably crashed or timed out" in message, message
        assert "Backend error: RuntimeError: " in message, message


def test_other_errors_pass_unexplained_whatever_their_words() -> None:
    """A step's own RuntimeError that names a backend or a timeout is not a collective's:
    it passes unchanged. (Explained by phrases, it was blamed on the other ranks.)"""

    def own_error() -> None:
        raise RuntimeError("gloo config: nccl connection closed, timed out")

    assert _explained(own_error) == "RuntimeError: gloo config: nccl connection closed, timed out"
    assert _explained(lambda: None) == "no error"
