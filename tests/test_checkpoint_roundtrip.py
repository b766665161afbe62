"""Multi-rank DCP round trips of Megatron-FSDP models through ``attach_uneven_dtensor_metadata``.

Every test runs real ranks on a real gloo group (``tests.harness``), saves real DCP files
under ``tmp_path`` with ``torch.distributed.checkpoint`` directly, and loads them into a
fresh, zero-initialised, identically sharded model and optimizer. The model is
``tests.models.PackedLM``: nested units, a tie, a fragment in a padding gap, an unevenly
packed Linear, a 3-D parameter.

Each worker returns plain facts; the assertions live in the pytest process, so a broken
library shows up as a failed assertion with the facts of every rank, and the regression
test can run the very same worker without the metadata and assert the opposite.

Oracles, all independent of the code under test:
    * the saved model's own local shards, optimizer state and outputs (bit-exact);
    * megatron-fsdp's ``gather_and_compute_chunk_metadata``, which all-gathers every
      shard's shape (a collective; called here only);
    * the checkpoint's own ``.metadata`` as DCP wrote it;
    * torch's ``compute_local_shape_and_global_offset`` (canonical ``Shard(0)``, what
      DCP's default planner would use).
"""

from __future__ import annotations

import contextlib
import inspect
import io
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from lightning_megatron_fsdp import (
    attach_uneven_dtensor_metadata,
    chunk_metadata_by_fqn,
    enable_cpu_execution,
    ensure_optimizer_state,
)
from lightning_megatron_fsdp.megatron import _megatron
from lightning_megatron_fsdp.megatron.uneven_dtensor import CHUNK_ATTR
from tests.harness import run_distributed
from tests.models import (
    bf16_policy,
    build_packed_lm,
    dp_mesh,
    fsdp_modules,
    lm_loss,
    local_shards,
    make_batch,
    shard_packed_lm,
    sharded_adam,
    sync_compute_weights,
)

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

TIMEOUT = 120.0
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_KEY, OPTIMIZER_KEY = "state_dict", "optimizer"

# ---------------------------------------------------------------------------------------
# The collective trap
# ---------------------------------------------------------------------------------------

_C10D_COLLECTIVES = (
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "recv_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "send_object_list",
)
_FUNCTIONAL_COLLECTIVES = (
    "all_gather_into_tensor_coalesced",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "broadcast",
    "permute_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "reduce_scatter_tensor_coalesced",
)


# Every collective method of a ProcessGroup object: what the functions above call, and what
# code holding a group (``mesh.get_group()``) can call directly.
_PROCESS_GROUP_COLLECTIVES = (
    "_allgather_base",
    "_reduce_scatter_base",
    "all_gather_single",
    "all_gather_single_coalesced",
    "all_to_all_single",
    "allgather",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "allreduce_coalesced",
    "alltoall",
    "alltoall_base",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "recv",
    "recv_anysource",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "scatter",
    "send",
)


class CollectiveCalledError(RuntimeError):
    """Raised by a trapped collective, or on leaving the trap if one slipped past it."""


def _sequence_numbers() -> dict[dist.ProcessGroup, int]:
    """Each live process group's count of collectives issued through its backend.

    c10d numbers every collective and point-to-point op a backend runs, whichever way it
    was reached (``torch.distributed``, a ``ProcessGroup`` or backend method, or C++ via
    ``torch.ops.c10d`` and the functional collectives), so a changed number is a collective
    that ran.
    """
    return {
        group: group._get_sequence_number_for_group()
        for group in dist.distributed_c10d._world.pg_map
    }


@contextlib.contextmanager
def collectives_forbidden() -> Iterator[None]:
    """Forbid every torch.distributed collective inside the block (a trap).

    Two layers. At the call: the functions in ``torch.distributed``,
    ``torch.distributed.distributed_c10d`` (callers may import from either), the functional
    collectives DTensor uses, and the collective methods of ``ProcessGroup`` raise
    :class:`CollectiveCalledError`; they are restored on exit. Behind them: every process
    group's backend sequence number is read on entry and on exit, so a collective that
    reached a backend another way (a backend object's method, ``torch.ops.c10d``) fails the
    block on exit, naming the group and how many ran.

    Raises:
        CollectiveCalledError: From a trapped call, or on exit if a backend ran one.
    """

    def trap(name: str) -> Callable[..., Any]:
        def raise_(*args: Any, **kwargs: Any) -> Any:
            raise CollectiveCalledError(f"collective {name} called")

        return raise_

    saved: list[tuple[Any, str, Any]] = []
    targets: list[tuple[Any, tuple[str, ...]]] = [
        (dist, _C10D_COLLECTIVES),
        (dist.distributed_c10d, _C10D_COLLECTIVES),
        (funcol, _FUNCTIONAL_COLLECTIVES),
        (dist.ProcessGroup, _PROCESS_GROUP_COLLECTIVES),
    ]
    for target, names in targets:
        for name in names:
            if hasattr(target, name):
                # The raw attribute: a class's pybind method read through getattr comes back
                # unbound and would lose ``self`` when put back.
                saved.append((target, name, inspect.getattr_static(target, name)))
                setattr(target, name, trap(f"{target.__name__}.{name}"))
    before = _sequence_numbers()
    try:
        yield
    finally:
        for target, name, original in saved:
            setattr(target, name, original)
    ran = {
        group.group_name: number - before.get(group, 0)
        for group, number in _sequence_numbers().items()
        if number != before.get(group, 0)
    }
    if ran:
        raise CollectiveCalledError(
            f"collectives ran past the call traps (by process group: {ran}): something "
            "called a backend directly"
        )


# ---------------------------------------------------------------------------------------
# Workers (run on every rank)
# ---------------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _dtensors(
    model_state: dict[str, Any], optimizer_state: dict[str, Any]
) -> Iterator[tuple[str, DTensor]]:
    """(DCP key, DTensor) for every DTensor of the two state dicts, in a rank-stable order."""
    for fqn, tensor in model_state.items():
        if isinstance(tensor, DTensor):
            yield f"{MODEL_KEY}.{fqn}", tensor
    for fqn, states in optimizer_state["state"].items():
        for name, tensor in states.items():
            if isinstance(tensor, DTensor):
                yield f"{OPTIMIZER_KEY}.state.{fqn}.{name}", tensor


def _as_tuples(chunk: ChunkStorageMetadata) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(chunk.offsets), tuple(chunk.sizes)


def _tiling_errors(metadata: dict[str, Any]) -> list[str]:
    """Every saved tensor's chunks must cover each element of its global shape once."""
    errors = []
    for key, entry in metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        coverage = torch.zeros(entry.size, dtype=torch.int32)
        for chunk in entry.chunks:
            region = coverage
            for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                region = region.narrow(dim, offset, size)
            region += 1
        if not bool((coverage == 1).all()):
            errors.append(f"{key}: coverage counts {sorted(set(coverage.flatten().tolist()))}")
    return errors


def _compute_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's compute-weight (``model_weight``) shard of every parameter, by unit."""
    return {
        f"unit {unit}/{entry.fqns[0]}": group.model_weight.get_local_tensor(entry.index).clone()
        for unit, module in enumerate(fsdp_modules(model))
        for group in module.parameter_groups
        for entry in _megatron.entries(group)
    }


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int) -> None:
    lm_loss(model, make_batch(100 * step + rank)).backward()
    optimizer.step()
    optimizer.zero_grad()


def _state_dicts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    state_options = StateDictOptions(**options) if options else None
    return (
        get_model_state_dict(model, options=state_options),
        get_optimizer_state_dict(model, optimizer, options=state_options),
    )


def _round_trip(rank: int, world_size: int, root: str, precision: str, attach: bool) -> dict:
    """Train, save, load into a zero-initialised twin, and report what came back.

    With ``attach=False`` it is the same round trip minus the metadata: the regression.
    """
    enable_cpu_execution()
    dtype = PRECISIONS[precision]
    policy = bf16_policy() if dtype == torch.bfloat16 else None
    path = f"{root}/{precision}"
    probe = make_batch(999)[0]
    facts: dict[str, Any] = {}

    model = shard_packed_lm(
        build_packed_lm(0, dtype=dtype), dp_mesh(world_size), mixed_precision_policy=policy
    )
    optimizer = sharded_adam(model)
    for step in range(2):
        _train(model, optimizer, rank, step)
    facts["groups"] = [
        tuple(entry.fqns for entry in _megatron.entries(group))
        for module in fsdp_modules(model)
        for group in module.parameter_groups
    ]
    with torch.no_grad():
        saved_output = model(probe)
    saved_shards = local_shards(model)
    saved_compute = _compute_weights(model)

    model_state, optimizer_state = _state_dicts(model, optimizer)
    saved_optimizer = {
        fqn: {name: _local(t).clone() for name, t in states.items()}
        for fqn, states in optimizer_state["state"].items()
    }
    # Canonical Shard(0), as DCP's default planner would place each shard.
    facts["canonical_defeated"] = sorted(
        fqn
        for fqn, tensor in model_state.items()
        if tuple(tensor._local_tensor.shape)
        != tuple(
            compute_local_shape_and_global_offset(
                tensor.shape, tensor.device_mesh, tensor.placements
            )[0]
        )
    )
    facts["nonempty_local_params"] = sum(t.numel() > 0 for t in saved_shards.values())

    if attach:
        with collectives_forbidden():
            # The trap is armed: the gather-based helper cannot run inside it, nor a
            # ProcessGroup method called directly...
            with contextlib.suppress(CollectiveCalledError):
                gather_and_compute_chunk_metadata(model_state["embed.weight"])
                raise AssertionError("the collective trap did not fire")
            with contextlib.suppress(CollectiveCalledError):
                dist.group.WORLD.allreduce([torch.zeros(1)]).wait()
                raise AssertionError("the ProcessGroup trap did not fire")
        # ...and a collective that reaches the backend past every Python function is
        # reported on exit (every rank runs this one, so it completes)...
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        with (
            pytest.raises(CollectiveCalledError, match=r"ran past the call traps"),
            collectives_forbidden(),
        ):
            backend.allreduce([torch.zeros(1)]).wait()
        with collectives_forbidden():
            # ...so the code under test provably runs none.
            chunk_metadata_by_fqn(model)
            attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
        # Oracle 1: megatron-fsdp's all-gather of every shard's shape, empty shards too.
        hooked, oracle = {}, {}
        for key, tensor in _dtensors(model_state, optimizer_state):
            hooked[key] = [_as_tuples(c) for c in tensor.__create_chunk_list__()]
            oracle[key] = [_as_tuples(gather_and_compute_chunk_metadata(tensor))]
        facts["hook_vs_oracle"] = sorted(k for k in oracle if hooked[k] != oracle[k])
        facts["chunks_checked"] = len(oracle)
    dcp.save({MODEL_KEY: model_state, OPTIMIZER_KEY: optimizer_state}, checkpoint_id=path)
    # The hooks sit on the optimizer's own state tensors: its state dict must still pickle.
    pickled = io.BytesIO()
    torch.save(optimizer.state_dict(), pickled)
    facts["optimizer_state_pickles"] = pickled.tell() > 0

    if attach:
        # Oracle 2: the chunks DCP wrote tile every tensor once, and are exactly the
        # non-empty oracle chunks of all ranks.
        all_oracles: list[Any] = [None] * world_size
        dist.all_gather_object(all_oracles, oracle)
        if rank == 0:
            metadata = FileSystemReader(path).read_metadata().state_dict_metadata
            facts["tiling_errors"] = _tiling_errors(metadata)
            mismatched = []
            for key in oracle:
                expected = {c for ranks in all_oracles for c in ranks[key] if 0 not in c[1]}
                written = {_as_tuples(c) for c in metadata[key].chunks}
                if written != expected:
                    mismatched.append(f"{key}: wrote {sorted(written)}, oracle {sorted(expected)}")
            facts["metadata_vs_oracle"] = mismatched
            facts["tensors_in_metadata"] = sum(
                isinstance(e, TensorStorageMetadata) for e in metadata.values()
            )

    # The fresh, zero-initialised, identically sharded twin.
    twin = shard_packed_lm(
        build_packed_lm(None, dtype=dtype), dp_mesh(world_size), mixed_precision_policy=policy
    )
    twin_optimizer = sharded_adam(twin)
    if dtype == torch.bfloat16:
        # Why ensure_optimizer_state exists: torch's own state init installs fp32 zero
        # gradients, which the bf16 grad_dtype of the sharded parameters refuses.
        with pytest.raises(RuntimeError, match=r"grad_dtype"):
            get_optimizer_state_dict(twin, twin_optimizer)
    ensure_optimizer_state(twin_optimizer)
    facts["fresh_state_entries"] = len(twin_optimizer.state)
    facts["fresh_grads_cleared"] = all(p.grad is None for p in twin.parameters())
    with torch.no_grad():
        facts["twin_output_equal_before_load"] = torch.equal(twin(probe), saved_output)
    twin_model_state, twin_optimizer_state = _state_dicts(twin, twin_optimizer)
    if attach:
        attach_uneven_dtensor_metadata(twin, twin_model_state, twin_optimizer_state)
    dcp.load({MODEL_KEY: twin_model_state, OPTIMIZER_KEY: twin_optimizer_state}, checkpoint_id=path)
    set_optimizer_state_dict(twin, twin_optimizer, twin_optimizer_state)
    sync_compute_weights(twin)

    loaded_shards = local_shards(twin)
    facts["param_mismatches"] = sorted(
        fqn for fqn, shard in saved_shards.items() if not torch.equal(shard, loaded_shards[fqn])
    )
    # Every FQN was compared; count each parameter's elements once (the tie is one).
    facts["compared_param_numel"] = sum(p._local_tensor.numel() for p in twin.parameters())
    by_fqn = get_optimizer_state_dict(twin, twin_optimizer)["state"]
    facts["optimizer_mismatches"] = sorted(
        f"{fqn}.{name}"
        for fqn, states in saved_optimizer.items()
        for name, saved in states.items()
        if not torch.equal(saved, _local(by_fqn[fqn][name]))
    )
    facts["optimizer_states_compared"] = sum(len(s) for s in saved_optimizer.values())
    loaded_compute = _compute_weights(twin)
    facts["compute_weight_mismatches"] = sorted(
        key for key, saved in saved_compute.items() if not torch.equal(saved, loaded_compute[key])
    )
    with torch.no_grad():
        facts["output_equal"] = torch.equal(twin(probe), saved_output)

    # Resume: one more identical step on both must stay bit-identical.
    _train(model, optimizer, rank, step=2)
    _train(twin, twin_optimizer, rank, step=2)
    after_model, after_twin = local_shards(model), local_shards(twin)
    facts["resume_mismatches"] = sorted(
        fqn for fqn in after_model if not torch.equal(after_model[fqn], after_twin[fqn])
    )
    facts["resume_moved"] = any(
        not torch.equal(after_model[fqn], saved_shards[fqn]) for fqn in after_model
    )
    return facts


def _round_trips(rank: int, world_size: int, root: str) -> dict[str, dict]:
    return {p: _round_trip(rank, world_size, root, p, attach=True) for p in PRECISIONS}


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------

_REFERENCE = build_packed_lm(0)
TOTAL_PARAM_NUMEL = sum(p.numel() for p in _REFERENCE.parameters())
MODEL_ENTRIES = len(_REFERENCE.state_dict())  # 15: the tie is saved under both FQNs
PARAMETERS = len(list(_REFERENCE.parameters()))  # 14: the tie is one parameter


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_round_trip_is_bit_exact(world_size: int, tmp_path: Path) -> None:
    """fp32 and bf16+fp32-main: weights, optimizer state, outputs and a resumed step."""
    results = run_distributed(_round_trips, world_size, str(tmp_path), timeout=TIMEOUT)
    for precision in PRECISIONS:
        ranks = [r[precision] for r in results]
        for rank, facts in enumerate(ranks):
            where = f"{precision}, rank {rank} of {world_size}"
            assert facts["param_mismatches"] == [], where
            assert facts["optimizer_mismatches"] == [], where
            assert facts["compute_weight_mismatches"] == [], where
            assert facts["output_equal"], where
            assert not facts["twin_output_equal_before_load"], f"{where}: vacuous target"
            assert facts["resume_mismatches"] == [], where
            assert facts["resume_moved"], f"{where}: the resumed step changed nothing"
            assert facts["hook_vs_oracle"] == [], where
            assert facts["optimizer_state_pickles"], where
            assert facts["fresh_state_entries"] == PARAMETERS, where
            assert facts["fresh_grads_cleared"], where
            # Every model entry, and exp_avg and exp_avg_sq of every parameter.
            assert facts["chunks_checked"] == MODEL_ENTRIES + 2 * PARAMETERS, where
            assert facts["optimizer_states_compared"] == 3 * PARAMETERS, where
        # Anti-vacuity: the ranks together compared every parameter element exactly once,
        # and some rank held a non-empty shard.
        assert sum(f["compared_param_numel"] for f in ranks) == TOTAL_PARAM_NUMEL
        assert max(f["nonempty_local_params"] for f in ranks) > 0
        # The real groups: nested units, the tie packed once, the documented block order.
        block = tuple(
            (n,) for n in ("mix", "gain", "fc.weight", "fc.bias", "out.weight", "out.bias")
        )
        root = (("embed.weight", "head.weight"), ("head.bias",))
        assert ranks[0]["groups"] == [root, block, block]
        root_facts = ranks[0]
        assert root_facts["tiling_errors"] == []
        assert root_facts["metadata_vs_oracle"] == []
        # Every model entry, and 3 states (exp_avg, exp_avg_sq, step) of every parameter.
        assert root_facts["tensors_in_metadata"] == MODEL_ENTRIES + 3 * PARAMETERS
        if world_size > 1:
            # The layout provably defeats canonical Shard(0) on some rank.
            assert set().union(*(f["canonical_defeated"] for f in ranks))


def test_round_trip_without_metadata_does_not_restore(tmp_path: Path) -> None:
    """The regression the hooks guard against: the same round trip, minus the metadata.

    DCP accepts it silently and places packed shards at canonical Shard(0) offsets, so the
    loaded weights are wrong: it is the hooks, not luck, that make the round trip exact.
    """
    results = run_distributed(_round_trip, 3, str(tmp_path), "fp32", False, timeout=TIMEOUT)
    assert any(facts["param_mismatches"] for facts in results)
    assert not any(facts["output_equal"] for facts in results)
    assert set().union(*(f["canonical_defeated"] for f in results))


@pytest.mark.parametrize("lr", [0.1, torch.tensor(0.1)], ids=["float_lr", "tensor_lr"])
def test_ensure_optimizer_state_creates_state_without_moving_parameters(
    lr: float | torch.Tensor,
) -> None:
    """The zero-learning-rate step creates state, and leaves weights and lr as they were.

    AdamW's decoupled weight decay would shrink every weight on a step at any non-zero lr,
    so an unchanged weight proves the step really ran at lr 0.
    """
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    ensure_optimizer_state(optimizer)
    for parameter, original in zip(model.parameters(), before, strict=True):
        assert torch.equal(parameter, original)
        assert parameter.grad is None
        assert set(optimizer.state[parameter]) == {"step", "exp_avg", "exp_avg_sq"}
    assert optimizer.param_groups[0]["lr"] is lr
    state = dict(optimizer.state)
    ensure_optimizer_state(optimizer)  # already has state: a no-op
    assert all(optimizer.state[p] is state[p] for p in model.parameters())
    # And a stateful optimizer does change weights at this lr: the check above can fail.
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    assert not torch.equal(model.weight, before[0])


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.3),
        lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.3, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.3),
        lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5, centered=True),
    ],
    ids=["adam_l2", "adamw_amsgrad", "sgd_momentum", "rmsprop"],
)
def test_materialised_state_behaves_like_a_fresh_optimizer(make_optimizer: object) -> None:
    """Saving before the first step must not change training: after ensure_optimizer_state
    the next two real steps are bit-identical to a fresh optimizer's (L2 weight decay would
    otherwise leak into the moments, and Adam's step count would start at 1)."""

    def train(materialise: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        optimizer = make_optimizer(model.parameters())  # type: ignore[operator]
        if materialise:
            ensure_optimizer_state(optimizer)
            assert optimizer.state, "state was not created"
        for step in range(2):
            model(torch.full((2, 4), float(step + 1))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    for fresh, materialised in zip(train(False), train(True), strict=True):
        torch.testing.assert_close(materialised, fresh, rtol=0, atol=0)


def test_state_is_created_only_where_missing_and_gradients_survive() -> None:
    """Partial state (a parameter that had no gradient yet) and mid-accumulation gradients:
    only the missing state is created (zeroed), existing state does not advance, and every
    gradient is back, unchanged, afterwards."""
    torch.manual_seed(0)
    used, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam([*used.parameters(), *unused.parameters()], lr=0.1)
    used(torch.ones(1, 3)).sum().backward()
    optimizer.step()  # state for `used` only
    before = {
        id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in used.parameters()
    }
    used(torch.full((1, 3), 2.0)).sum().backward()  # a gradient mid-accumulation
    grads = [p.grad.clone() for p in used.parameters()]
    weights = [p.detach().clone() for p in (*used.parameters(), *unused.parameters())]

    ensure_optimizer_state(optimizer)

    for parameter, grad in zip(used.parameters(), grads, strict=True):
        torch.testing.assert_close(parameter.grad, grad, rtol=0, atol=0)
        for key, value in before[id(parameter)].items():
            torch.testing.assert_close(optimizer.state[parameter][key], value, rtol=0, atol=0)
    for parameter in unused.parameters():
        assert parameter.grad is None
        state = optimizer.state[parameter]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(not value.any() for value in state.values())
    for parameter, weight in zip((*used.parameters(), *unused.parameters()), weights, strict=True):
        torch.testing.assert_close(parameter.detach(), weight, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


def _bad_inputs(rank: int, world_size: int) -> list[str]:
    """Each bad input raises a clear error on this rank (all ranks run the same cases)."""
    enable_cpu_execution()
    mesh = dp_mesh(world_size)
    model = shard_packed_lm(build_packed_lm(0), mesh)
    optimizer = sharded_adam(model)
    checked = []

    # A model never passed to fully_shard: a clear error, not an empty success.
    plain = build_packed_lm(0)
    with pytest.raises(ValueError, match=r"PackedLM holds no Megatron-FSDP parameter"):
        chunk_metadata_by_fqn(plain)
    with pytest.raises(ValueError, match=r"PackedLM holds no Megatron-FSDP parameter"):
        attach_uneven_dtensor_metadata(plain, plain.state_dict(), {})
    checked.append("never sharded")

    # A DTensor Megatron-FSDP does not own, in the model and in the optimizer state dict.
    foreign = DTensor.from_local(torch.zeros(1, 3), mesh, [Shard(0)])
    model_state, optimizer_state = _state_dicts(model, optimizer)
    with pytest.raises(KeyError, match=r"FQN 'extra\.weight'.*not a Megatron-FSDP parameter"):
        attach_uneven_dtensor_metadata(model, {**model_state, "extra.weight": foreign}, {})
    bad_optimizer = {**optimizer_state, "state": {"extra.weight": {"exp_avg": foreign}}}
    with pytest.raises(KeyError, match=r"\['extra\.weight'\]\['exp_avg'\]"):
        attach_uneven_dtensor_metadata(model, model_state, bad_optimizer)
    checked.append("foreign DTensor")

    # A local shard whose shape disagrees with its chunk: both shapes named.
    true_rows = model_state["blocks.0.mix"]._local_tensor.shape[0]
    wrong = DTensor.from_local(
        torch.zeros(true_rows + 1, 2, 3),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size((5, 2, 3)),
        stride=(6, 3, 1),
    )
    with pytest.raises(
        ValueError,
        match=(
            rf"'blocks\.0\.mix'\]: local shard shape \({true_rows + 1}, 2, 3\) disagrees "
            rf"with its Megatron-FSDP chunk sizes \({true_rows}, 2, 3\)"
        ),
    ):
        attach_uneven_dtensor_metadata(model, {**model_state, "blocks.0.mix": wrong}, {})
    checked.append("shape mismatch")

    # A local tensor that already carries another layout's chunk.
    fqn = next(f for f, t in model_state.items() if t._local_tensor.numel())
    stale = model_state[fqn]._local_tensor
    real_chunk = chunk_metadata_by_fqn(model)[fqn]
    setattr(stale, CHUNK_ATTR, ChunkStorageMetadata(real_chunk.offsets, real_chunk.sizes))
    attach_uneven_dtensor_metadata(model, model_state, optimizer_state)  # same chunk: fine
    shifted = torch.Size((real_chunk.offsets[0] + 1, *real_chunk.offsets[1:]))
    setattr(stale, CHUNK_ATTR, ChunkStorageMetadata(shifted, real_chunk.sizes))
    with pytest.raises(ValueError, match=rf"'{fqn}'\]: its local tensor already carries chunk"):
        attach_uneven_dtensor_metadata(model, model_state, optimizer_state)
    checked.append("stale chunk")

    # A flattened optimizer state dict would silently keep canonical offsets: refused.
    _, flat = _state_dicts(model, optimizer, flatten_optimizer_state_dict=True)
    with pytest.raises(KeyError, match=r"optimizer_state_dict\['state\.embed\.weight\.exp_avg'\]"):
        attach_uneven_dtensor_metadata(model, get_model_state_dict(model), flat)
    with pytest.raises(TypeError, match=r"optimizer_state_dict\['state'\] must map"):
        attach_uneven_dtensor_metadata(model, {}, {"state": [1]})
    checked.append("malformed optimizer state dict")

    # Inside forward the parameters are unsharded: refused, not mis-described.
    errors: list[str] = []

    def probe(module: torch.nn.Module, args: Any) -> None:
        with pytest.raises(ValueError, match=r"not one of its sharded.*inside forward or backward"):
            chunk_metadata_by_fqn(model)
        errors.append("raised")

    handle = model.blocks[0].register_forward_pre_hook(probe)
    with torch.no_grad():
        model(make_batch(0)[0])
    handle.remove()
    assert errors == ["raised"]
    checked.append("mid-forward")
    return checked


def test_bad_input_raises_clear_errors_on_every_rank() -> None:
    results = run_distributed(_bad_inputs, 2, timeout=TIMEOUT)
    expected = [
        "never sharded",
        "foreign DTensor",
        "shape mismatch",
        "stale chunk",
        "malformed optimizer state dict",
        "mid-forward",
    ]
    assert results == [expected, expected]
