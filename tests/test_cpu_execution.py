"""The CPU execution adapter runs megatron-fsdp's real path, and ``shard_module`` keeps ties.

Evidence that the adapter runs the real thing, not a stand-in: a sharded
``tests.models.PackedLM`` trained with megatron-fsdp's own hooks (all-gather, gradient
reduce-scatter, ``fully_shard_optimizer``) on 2 gloo ranks matches the same model trained
unsharded in one process -- losses, gradients, weights and outputs, to 1e-6 in fp32.
Without the adapter the same forward fails.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
from megatron_fsdp.experimental import fully_shard
from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_megatron_fsdp import (
    cpu_execution_enabled,
    enable_cpu_execution,
    shard_module,
    sharding_scope,
)
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron.cpu_execution import (
    SyncEvent,
    SyncStream,
    _patched_modules,
    _TorchProxy,
)
from tests.gpu import assert_ran_on_cuda
from tests.harness import run_distributed
from tests.models import (
    PackedLM,
    build_packed_lm,
    dp_mesh,
    fsdp_placements,
    lm_loss,
    make_batch,
    shard_packed_lm,
    sharded_adam,
)

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

TIMEOUT = 120.0
ATOL = 1e-6  # fp32; observed differences are ~2e-7 (reduction order)
STEPS = 3


# ---------------------------------------------------------------------------------------
# The adapter itself
# ---------------------------------------------------------------------------------------


def _shard_and_run_without_adapter(world_size: int) -> str:
    """Shard ``PackedLM`` with megatron-fsdp's own code and run forward; return the stage
    ("sharding" or "forward") at which it failed for want of CUDA streams.

    ``shard_module`` would enable the adapter itself, so this goes through the
    version-neutral ``_megatron`` layer, which never does.
    """
    mesh = dp_mesh(world_size)
    model = build_packed_lm(0)
    stage = "sharding"
    # torch.cuda.device(cpu) (0.6.1) or torch.cuda.Stream(cpu) (0.7) on a CPU build of torch.
    cuda_needed = r"Expected a cuda device, but got: cpu|torch.cuda.Stream requires CUDA support"
    with pytest.raises((ValueError, RuntimeError), match=cuda_needed):
        context = _megatron.ShardingContext(torch.device("cpu"), eager_roots=True)
        for block in model.blocks:
            context.shard(block, mesh, fsdp_placements(), None)
        context.shard(model, mesh, fsdp_placements(), None)
        context.close()
        stage = "forward"
        model(make_batch(0)[0])
    return stage


def _enable_twice(rank: int, world_size: int) -> dict[str, Any]:

    facts: dict[str, Any] = {"enabled_at_start": cpu_execution_enabled()}
    # Without the adapter megatron-fsdp cannot create its streams, which the sharding
    # context creates: on 0.7 when it opens, on 0.6.1 when it closes (each root's context
    # is built eagerly there, not at the first forward).
    facts["failed_at"] = _shard_and_run_without_adapter(world_size)

    # Another patch already in place: refused, not stacked.
    upstream_module = _patched_modules()[0]
    original = upstream_module.torch
    upstream_module.torch = types.ModuleType("torch")
    try:
        with pytest.raises(RuntimeError, match=r"was replaced by .*not by this adapter"):
            enable_cpu_execution()
    finally:
        upstream_module.torch = original

    enable_cpu_execution()
    proxy = upstream_module.torch
    enable_cpu_execution()
    facts["same_proxy_after_second_call"] = upstream_module.torch is proxy
    facts["every_patched_module_shares_it"] = all(m.torch is proxy for m in _patched_modules())
    facts["enabled"] = cpu_execution_enabled()
    facts["proxy_type"] = type(proxy).__name__
    # Only the copy of ``torch`` inside megatron-fsdp's module changed, not torch itself.
    facts["global_torch_cuda_untouched"] = torch.cuda.Stream is not SyncStream
    # A fresh model now runs forward, backward and a step.
    model = shard_packed_lm(build_packed_lm(0), dp_mesh(world_size))
    optimizer = sharded_adam(model)
    lm_loss(model, make_batch(0)).backward()
    optimizer.step()
    facts["trained"] = all(isinstance(p, DTensor) for p in model.parameters())
    return facts


def test_enable_cpu_execution_is_idempotent_and_required() -> None:
    (facts,) = run_distributed(_enable_twice, 1, timeout=TIMEOUT)
    assert facts == {
        "enabled_at_start": False,
        "failed_at": "sharding",
        "same_proxy_after_second_call": True,
        "every_patched_module_shares_it": True,
        "enabled": True,
        "proxy_type": "_TorchProxy",
        "global_torch_cuda_untouched": True,
        "trained": True,
    }


def test_proxy_stands_in_only_for_non_cuda_devices() -> None:
    """In-process, without installing it: CPU calls get no-op streams, the rest forwards."""
    proxy = _TorchProxy()
    cpu = torch.device("cpu")
    with proxy.cuda.device(cpu):
        stream = proxy.cuda.Stream()
    assert isinstance(stream, SyncStream) and stream.device == cpu
    assert isinstance(proxy.cuda.current_stream(cpu), SyncStream)
    assert isinstance(proxy.cuda.stream(stream), contextlib.nullcontext)
    event = stream.record_event()
    assert isinstance(event, SyncEvent) and event.query() and stream.query()
    stream.wait_stream(proxy.cuda.current_stream(cpu))
    stream.wait_event(event)
    proxy.cuda.nvtx.range_push("label")
    proxy.cuda.nvtx.range_pop()
    # Everything else is the real module: torch functions, and torch.cuda's own.
    assert proxy.cuda.is_available is torch.cuda.is_available
    assert proxy.cuda.Event is torch.cuda.Event
    assert proxy.float32 is torch.float32 and proxy.autograd is torch.autograd


@pytest.mark.gpu
def test_proxy_keeps_real_cuda_streams() -> None:
    """On CUDA the proxy forwards: real streams, so ordering stays the hardware's."""
    proxy = _TorchProxy()
    device = torch.device("cuda", torch.cuda.current_device())
    with proxy.cuda.device(device):
        stream = proxy.cuda.Stream()
    assert isinstance(stream, torch.cuda.Stream)
    assert_ran_on_cuda([stream.device], 1)
    assert proxy.cuda.current_stream(device) == torch.cuda.current_stream(device)
    assert not isinstance(proxy.cuda.stream(stream), contextlib.nullcontext)


def _shard_onto_a_cuda_mesh(rank: int, world_size: int) -> dict[str, Any]:
    """``shard_module`` of a module built on CPU, on a CUDA mesh: what the strategies do
    with a LightningModule on a GPU (it is built on CPU; megatron-fsdp allocates the shards
    on the mesh's device)."""
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda")  # touches no CUDA device
    error = None
    try:
        shard_module(torch.nn.Linear(4, 4), mesh)
    except Exception as err:  # no CUDA here: nowhere to allocate the shards
        error = f"{type(err).__name__}: {err}"
    return {
        "adapter_enabled": cpu_execution_enabled(),
        "cuda": torch.cuda.is_available(),
        "error": error,
    }


def test_a_cpu_built_module_sharded_onto_a_cuda_mesh_leaves_the_adapter_off() -> None:
    """The adapter follows the mesh's device, not where the module was built: a CUDA run
    keeps megatron-fsdp's real streams (0.7's context is the CUDA ``fully_shard_context``)."""
    (facts,) = run_distributed(_shard_onto_a_cuda_mesh, 1, timeout=TIMEOUT)
    assert facts["adapter_enabled"] is False, facts
    if not facts["cuda"]:
        # Where it failed: allocating on CUDA (a CPU build says "CUDA", a CUDA build without
        # a driver "no NVIDIA driver", or on megatron-fsdp 0.7 with torch 2.15 its device
        # guard "invalid argument to exchangeDevice").
        error = facts["error"]
        assert error is not None and any(
            cause in error for cause in ("CUDA", "NVIDIA driver", "exchangeDevice")
        ), facts


# ---------------------------------------------------------------------------------------
# Sharded on CPU == unsharded, and ties
# ---------------------------------------------------------------------------------------


def _rows(
    full: torch.Tensor, sharded: DTensor, local: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference rows, local shard) at the shard's true position.

    The position comes from megatron-fsdp's gather-based helper, a collective every rank
    calls for the same parameters in the same order, so it is independent of the chunk
    arithmetic under test elsewhere.
    """
    chunk = gather_and_compute_chunk_metadata(sharded)
    start, rows = chunk.offsets[0], chunk.sizes[0]
    local = sharded._local_tensor if local is None else local
    return full[start : start + rows], local


def _sharded_matches_unsharded(rank: int, world_size: int) -> dict[str, Any]:
    """Train sharded (2 ranks, one batch each) and unsharded (both batches) side by side."""
    enable_cpu_execution()
    model = shard_packed_lm(build_packed_lm(0), dp_mesh(world_size))
    optimizer = sharded_adam(model)
    reference = build_packed_lm(0)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    initial = [p.detach().clone() for p in reference.parameters()]
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    facts: dict[str, Any] = {"loss_diffs": [], "grad_diffs": [], "tied_in_forward": []}

    def check_tie_in_forward(module: torch.nn.Module, args: Any) -> None:
        # Inside forward both FQNs name the one unsharded parameter.
        facts["tied_in_forward"].append(model.head.weight is model.embed.weight)

    model.head.register_forward_pre_hook(check_tie_in_forward)
    for step in range(STEPS):
        batches = [make_batch(100 * step + r) for r in range(world_size)]
        loss = lm_loss(model, batches[rank])
        loss.backward()
        reference_losses = [lm_loss(reference, batch) for batch in batches]
        # FSDP averages gradients over ranks; so does the mean of the per-rank losses.
        (sum(reference_losses) / world_size).backward()
        facts["loss_diffs"].append(abs(loss.item() - reference_losses[rank].item()))
        for name, parameter in model.named_parameters():
            grad = parameter.grad.to_local()  # rank-local; the shard of the reduced gradient
            expected, got = _rows(reference_params[name].grad, parameter, grad)
            facts["grad_diffs"].append((expected - got).abs().max().item() if got.numel() else 0.0)
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    facts["weight_diff"] = 0.0
    facts["compared_numel"] = 0
    for name, parameter in model.named_parameters(remove_duplicate=False):
        expected, got = _rows(reference_params[name].detach(), parameter)
        if got.numel():
            facts["weight_diff"] = max(facts["weight_diff"], (expected - got).abs().max().item())
        facts["compared_numel"] += got.numel()
    facts["moved"] = min(
        (p.detach() - p0).abs().max().item()
        for p, p0 in zip(reference.parameters(), initial, strict=True)
    )
    probe = make_batch(999)[0]
    with torch.no_grad():
        facts["output_diff"] = (model(probe) - reference(probe)).abs().max().item()

    # Ties: one sharded parameter under both FQNs at rest, trained through both uses.
    facts["tied_at_rest"] = model.head.weight is model.embed.weight
    facts["tied_is_sharded"] = isinstance(model.embed.weight, DTensor)
    facts["root_group"] = _group_fqns(model)
    return facts


def test_sharded_training_on_cpu_matches_unsharded() -> None:
    results = run_distributed(_sharded_matches_unsharded, 2, timeout=TIMEOUT)
    for rank, facts in enumerate(results):
        where = f"rank {rank}"
        assert max(facts["loss_diffs"]) <= ATOL, where
        assert len(facts["grad_diffs"]) == STEPS * len(list(build_packed_lm(0).parameters()))
        assert max(facts["grad_diffs"]) <= ATOL, where
        assert facts["weight_diff"] <= ATOL, where
        assert facts["output_diff"] <= ATOL, where
        # Not vacuous: training moved every parameter far beyond the tolerance.
        assert facts["moved"] > 1e-2, where
        # shard_module kept the tie: one parameter, sharded at rest, one in forward.
        assert facts["tied_at_rest"] and facts["tied_is_sharded"], where
        assert facts["tied_in_forward"] == [True] * (STEPS + 1), where  # steps and probe
        assert facts["root_group"] == [("embed.weight", "head.weight"), ("head.bias",)], where
    # Both ranks together compared every parameter element (the tie under both FQNs).
    model = build_packed_lm(0)
    total = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert sum(f["compared_numel"] for f in results) == total


def _group_fqns(module: torch.nn.Module) -> list[tuple[str, ...]]:
    """The FQNs of each physical parameter of ``module``'s own (first) parameter group."""
    return [entry.fqns for entry in _megatron.entries(module.parameter_groups[0])]


def _train_root_once(model: PackedLM, rank: int) -> dict[str, Any]:
    """One forward, backward and step; what happened to the root unit."""
    root = _megatron.entries(model.parameter_groups[0])
    before = [e.sharded._local_tensor.clone() for e in root]
    tied_at_rest = model.head.weight is model.embed.weight
    optimizer = sharded_adam(model)
    lm_loss(model, make_batch(rank)).backward()
    block = _megatron.entries(_megatron.group_of(model.blocks[0].mix))
    facts: dict[str, Any] = {
        "root_group": _group_fqns(model),
        "tied_at_rest": tied_at_rest,
        "embed_is_dtensor_after_backward": isinstance(model.embed.weight, DTensor),
        "root_sharded_grads": [e.sharded.grad is not None for e in root],
        "block_sharded_grads": all(e.sharded.grad is not None for e in block),
    }
    optimizer.step()
    facts["root_trained"] = [
        not torch.equal(b, e.sharded._local_tensor)
        for b, e in zip(before, root, strict=True)
        if b.numel()
    ]
    return facts


def _raw_and_tie_aware_sharding(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """The tied model through megatron-fsdp's ``fully_shard``, then through ``shard_module``.

    "Raw" is upstream's public ``fully_shard`` with nothing of ours around it but what the
    version requires to run at all: on 0.7 a sharding context (``fully_shard_context``
    refuses CPU, so ``_megatron.ShardingContext`` stands in for it exactly).
    """
    enable_cpu_execution()
    mesh = dp_mesh(world_size)
    raw = build_packed_lm(0)
    context = _megatron.ShardingContext(torch.device("cpu"), eager_roots=False)
    for block in raw.blocks:
        fully_shard(block, mesh, fsdp_placements())
    fully_shard(raw, mesh, fsdp_placements())
    context.close()  # 0.7: finalises the context; 0.6.1: nothing (roots init lazily)
    facts = {"raw": _train_root_once(raw, rank)}

    kept = build_packed_lm(0)
    # A second kind of tie: one Parameter registered twice on the same module.
    fc = kept.blocks[1].fc
    fc.weight_alias = fc.weight
    with sharding_scope():
        for block in kept.blocks:
            shard_module(block, mesh, fsdp_placements())
        shard_module(kept, mesh, fsdp_placements())
    facts["kept"] = _train_root_once(kept, rank)
    facts["kept"]["alias_same_object"] = fc.weight_alias is fc.weight
    facts["kept"]["alias_is_dtensor"] = isinstance(fc.weight_alias, DTensor)
    facts["kept"]["alias_group"] = [
        e.fqns for e in _megatron.entries(_megatron.group_of(fc.weight))
    ]
    return facts


def _assert_ties_kept(facts: dict[str, Any]) -> None:
    """One physical parameter under both FQNs, sharded at rest, trained through both uses."""
    assert facts["root_group"] == [("embed.weight", "head.weight"), ("head.bias",)]
    assert facts["tied_at_rest"]
    assert facts["embed_is_dtensor_after_backward"]
    assert facts["root_sharded_grads"] == [True, True]
    assert facts["block_sharded_grads"]
    assert facts["root_trained"] and all(facts["root_trained"])


def test_raw_fully_shard_ties_and_shard_module_keeps_them() -> None:
    """What megatron-fsdp's own ``fully_shard`` does to a tied model, per version; and
    ``shard_module`` keeping the tie on every version.

    0.6.1 (``not UPSTREAM_TIES``), the observed failure: ``embed.weight`` and
    ``head.weight`` are packed as two parameters with two main weights (the tie is gone at
    rest). The root unit then waits for gradients of three parameters while autograd
    delivers two, so its ``post_backward`` never runs: after backward the root is left
    unsharded (plain tensors, not DTensors), its sharded parameters never receive a
    gradient, and the optimizer step leaves them untouched -- the embedding, head and
    head bias silently stop training while the blocks train.

    0.7 (``UPSTREAM_TIES``): upstream packs the tie once, as one ``FsdpParameter`` with
    both FQNs, and trains it; our tie patch is not applied and must not be needed.
    """
    results = run_distributed(_raw_and_tie_aware_sharding, 2, timeout=TIMEOUT)
    for facts in (r["raw"] for r in results):
        if _megatron.UPSTREAM_TIES:
            _assert_ties_kept(facts)
            continue
        assert facts["root_group"] == [("embed.weight",), ("head.weight",), ("head.bias",)]
        assert not facts["tied_at_rest"]
        assert not facts["embed_is_dtensor_after_backward"]
        assert facts["root_sharded_grads"] == [False, False, False]
        assert facts["block_sharded_grads"]
        assert facts["root_trained"] and not any(facts["root_trained"])

    for facts in (r["kept"] for r in results):
        _assert_ties_kept(facts)
        assert facts["alias_same_object"] and facts["alias_is_dtensor"]
        # The alias is the same buffer entry as ``fc.weight``, not a second one.
        fc_entries = [f for f in facts["alias_group"] if "fc.weight" in f]
        assert fc_entries == [("fc.weight", "fc.weight_alias")]
