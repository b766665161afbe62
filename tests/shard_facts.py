"""Picklable "facts" about a rank's checkpoint state, and bit-exact checks on them.

A rank turns its state dicts into facts (``facts``), returns them through the harness, and
the pytest process reassembles full tensors from every rank's shards (``assemble``, each
row exactly once) and compares them bit for bit (dtype, shape and bytes: ``-0.0`` is not
``0.0``). Shared by the checkpoint-IO and fault-tolerance tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp.megatron.uneven_dtensor import CHUNK_ATTR

__all__ = [
    "assemble",
    "assert_close_to_reference",
    "assert_matches_full",
    "assert_same_facts",
    "differing",
    "facts",
    "reference_facts",
    "same_bits",
]

Facts = Mapping[str, tuple[Any, ...]]


def facts(state: Any, prefix: str = "") -> dict[str, tuple[Any, ...]]:
    """Every leaf of a state as picklable facts, keyed by its ``/``-joined path.

    A DTensor becomes ``("shard", row offset, global shape, local copy)`` (the offset from
    the chunk ``uneven_dtensor`` attached, ``-1`` if none), a tensor ``("tensor", copy)``,
    anything else ``("value", value)``.
    """
    if isinstance(state, Mapping):
        items: Any = state.items()
    elif isinstance(state, (list, tuple)) and not all(isinstance(v, str) for v in state):
        items = enumerate(state)
    else:
        items = None
    if items is not None:
        out: dict[str, tuple[Any, ...]] = {}
        for key, value in items:
            out.update(facts(value, f"{prefix}{key}/"))
        return out
    key = prefix.rstrip("/")
    if isinstance(state, DTensor):
        local = state._local_tensor
        chunk = vars(local).get(CHUNK_ATTR)
        offset = int(chunk.offsets[0]) if chunk is not None else -1
        return {key: ("shard", offset, tuple(state.shape), _copy(local))}
    if isinstance(state, torch.Tensor):
        return {key: ("tensor", _copy(state))}
    return {key: ("value", state)}


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (stricter than ``torch.equal``: ``-0.0 != 0.0``)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def _same_fact(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    if got[0] != want[0]:
        return False
    if want[0] == "value":
        return got[1] == want[1]
    return got[1:-1] == want[1:-1] and same_bits(got[-1], want[-1])


def assert_same_facts(got: Facts, want: Facts, what: str = "") -> None:
    """Bit for bit (dtype, shape, bytes), every key; values by equality.

    Raises:
        AssertionError: Naming ``what`` and the first differing key.
    """
    assert got.keys() == want.keys(), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
    for key, fact in want.items():
        other = got[key]
        assert other[0] == fact[0], f"{what} {key}: {other[0]} vs {fact[0]}"
        if fact[0] == "value":
            assert other[1] == fact[1], f"{what} {key}: {other[1]!r} != {fact[1]!r}"
            continue
        assert other[1:-1] == fact[1:-1], f"{what} {key}: {other[1:-1]} != {fact[1:-1]}"
        assert same_bits(other[-1], fact[-1]), f"{what} {key}: values differ"


def differing(got: Facts, want: Facts) -> list[str]:
    """Keys whose facts differ (rank-side check that returns instead of raising)."""
    keys = sorted(set(got) | set(want))
    return [k for k in keys if k not in got or k not in want or not _same_fact(got[k], want[k])]


def assemble(per_rank: list[Facts]) -> dict[str, Any]:
    """Full tensors from every rank's shard facts; each row must be covered exactly once.

    Raises:
        AssertionError: If a row is covered twice or never, a shard has no chunk, or a
            replicated value differs between ranks.
    """
    full: dict[str, Any] = {}
    coverage: dict[str, torch.Tensor] = {}
    for rank_facts in per_rank:
        for key, fact in rank_facts.items():
            if fact[0] == "shard":
                _, offset, shape, local = fact
                assert offset >= 0, f"{key}: no chunk attached"
                if key not in full:
                    full[key] = torch.zeros(shape, dtype=local.dtype)
                    coverage[key] = torch.zeros(shape[0], dtype=torch.int64)
                full[key][offset : offset + local.shape[0]] = local
                coverage[key][offset : offset + local.shape[0]] += 1
            elif key in full:
                same = (
                    same_bits(full[key], fact[1]) if fact[0] == "tensor" else full[key] == fact[1]
                )
                assert same, f"{key}: replicated value differs between ranks"
            else:
                full[key] = fact[1]
    for key, rows in coverage.items():
        assert bool((rows == 1).all()), f"{key}: rows covered {rows.tolist()}"
    return full


def assert_matches_full(full: Mapping[str, Any], per_rank: list[Facts]) -> None:
    """Every rank's facts equal the rows of ``full`` (bit for bit); every row checked once."""
    seen: dict[str, torch.Tensor] = {}
    for rank_facts in per_rank:
        assert rank_facts.keys() == full.keys(), sorted(set(rank_facts) ^ set(full))
        for key, fact in rank_facts.items():
            if fact[0] == "shard":
                _, offset, shape, local = fact
                reference = full[key][offset : offset + local.shape[0]]
                assert same_bits(local, reference), f"{key}: rows differ"
                rows = seen.setdefault(key, torch.zeros(shape[0], dtype=torch.int64))
                rows[offset : offset + local.shape[0]] += 1
            elif fact[0] == "tensor":
                assert same_bits(fact[1], full[key]), key
            else:
                assert fact[1] == full[key], key
    assert seen and all(bool((rows == 1).all()) for rows in seen.values())


def reference_facts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full tensors of an *unsharded* model and its torch optimizer, keyed as :func:`facts`
    keys a checkpoint's state (``state_dict/<fqn>``, ``optimizer_states/0/state/<fqn>/<name>``).

    Built without any chunk offset, so it checks full tensors that :func:`assemble` put
    together from shards at the offsets the code under test reports.
    """
    reference = {f"state_dict/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for fqn, parameter in model.named_parameters():
        for name, value in optimizer.state[parameter].items():
            reference[f"optimizer_states/0/state/{fqn}/{name}"] = value.detach().clone()
    return reference


def assert_close_to_reference(
    full: Mapping[str, Any], reference: Mapping[str, torch.Tensor], atol: float
) -> None:
    """Every tensor of ``full`` has a reference and is within ``atol`` of it (dtype and
    shape equal).

    ``atol`` only absorbs the rounding of a data-parallel gradient average; a row at the
    wrong offset is off by the size of the values themselves.

    Raises:
        AssertionError: Naming the first key that differs or has no reference.
    """
    tensors = {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
    missing = sorted(set(tensors) - set(reference))
    assert tensors and not missing, f"no reference for {missing}"
    for key in sorted(tensors):
        torch.testing.assert_close(tensors[key], reference[key], rtol=0, atol=atol, msg=key)
