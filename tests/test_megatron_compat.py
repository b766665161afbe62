"""Every upstream name our compatibility shims rely on, one test each.

``lightning_megatron_fsdp/megatron/_megatron.py`` and ``cpu_execution.py`` are the only modules that
touch megatron-fsdp internals, and they pick a path per feature (``hasattr`` on what
changed), not per version string. When a future megatron-fsdp renames or reshapes one of
those internals, the library would fail somewhere deep inside a training step; these
tests fail first, each naming the shim that needs updating and the upstream name it
relies on. They run on whichever megatron-fsdp is installed (CI runs them on 0.6.1 and on
the 0.7 snapshot) and check the path that version takes, plus the feature detection
itself: a flag must pick the path whose names exist.

Static checks read signatures, class annotations and upstream source (the CUDA calls the
CPU adapter must stand in for). The behavioural checks run once on one real gloo rank
(:func:`_probe`) and each test asserts one of the facts it gathered.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import dataclasses
import importlib
import inspect
import textwrap
import types
import weakref
from typing import Any

import megatron_fsdp
import pytest
import torch
from megatron_fsdp import experimental
from megatron_fsdp.experimental import dbuffer as dbuffer_py
from megatron_fsdp.experimental import module as module_py
from megatron_fsdp.experimental import parameter_group as parameter_group_py
from megatron_fsdp.experimental import placement as placement_py
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from lightning_megatron_fsdp.megatron import _megatron, cpu_execution
from tests.harness import run_distributed
from tests.models import build_packed_lm, dp_mesh, fsdp_placements, make_batch, shard_packed_lm

# CI runs this module in every pass (README, "Supported torch and megatron-fsdp versions").
pytestmark = pytest.mark.both_versions

fully_shard_py = importlib.import_module("megatron_fsdp.experimental.fully_shard")
VERSION = getattr(megatron_fsdp, "__version__", "unknown")
TIMEOUT = 120.0


def _broken(shim: str, what: str) -> str:
    """The failure message: which shim breaks, on which version, because of what."""
    return (
        f"megatron-fsdp {VERSION}: {what}. `{shim}` relies on it: update that shim (and "
        "this test) for this megatron-fsdp version, choosing the path by feature detection."
    )


def _annotations(cls: type) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for base in reversed(cls.__mro__):
        merged.update(getattr(base, "__annotations__", {}))
    return merged


def _parameters(function: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(function).parameters)


def _upstream_dbuffer_init() -> Any:
    """Upstream's ``DBuffer.__init__``, unwrapped if the CPU adapter wrapped it."""
    init = dbuffer_py.DBuffer.__init__
    return getattr(init, "_lmf_original", init)


# ---------------------------------------------------------------------------------------
# Feature detection: each flag picks a path whose names exist
# ---------------------------------------------------------------------------------------


def test_has_sharding_context_flag_matches_the_context_api() -> None:
    shim = "_megatron.HAS_SHARDING_CONTEXT / ShardingContext"
    has = hasattr(experimental, "fully_shard_context")
    assert has == _megatron.HAS_SHARDING_CONTEXT, _broken(shim, "flag out of date")
    if has:
        # 0.7 fully_shard.py: ``fully_shard_context(device)`` and the context variable it
        # sets, which ShardingContext sets itself on CPU (the function refuses CPU).
        assert "device" in _parameters(experimental.fully_shard_context), _broken(
            shim, "fully_shard_context(device) lost its device argument"
        )
        # 0.7 module.py ``FsdpContext.__init__(device, ...)`` and ``finalize()``.
        assert "device" in _parameters(module_py.FsdpContext.__init__), _broken(
            shim, "FsdpContext(device=...) signature changed"
        )
        assert callable(getattr(module_py.FsdpContext, "finalize", None)), _broken(
            shim, "FsdpContext.finalize() is gone"
        )
        # 0.7 fully_shard.py ``microbatch(context, is_last)``.
        assert list(_parameters(experimental.microbatch))[:2] == ["context", "is_last"], _broken(
            "_megatron.microbatch", "microbatch(context, is_last) signature changed"
        )
    else:
        # 0.6.1 module.py ``FsdpModule._lazy_init_context``: ShardingContext.close builds
        # every root's context eagerly with it.
        assert callable(getattr(module_py.FsdpModule, "_lazy_init_context", None)), _broken(
            shim, "FsdpModule._lazy_init_context is gone, and there is no fully_shard_context"
        )
        # 0.6.1 fully_shard.py ``microbatch(module, is_last)``.
        assert list(_parameters(experimental.microbatch))[:2] == ["module", "is_last"], _broken(
            "_megatron.microbatch", "microbatch(module, is_last) signature changed"
        )


def test_fsdp_context_variable() -> None:
    """0.7 fully_shard.py ``_FSDP_CONTEXT``: set by ShardingContext on CPU."""
    shim = "_megatron.ShardingContext.__init__ (CPU path)"
    if not _megatron.HAS_SHARDING_CONTEXT:
        assert not hasattr(fully_shard_py, "_FSDP_CONTEXT"), _broken(
            shim, "_FSDP_CONTEXT exists but fully_shard_context does not"
        )
        return
    variable = getattr(fully_shard_py, "_FSDP_CONTEXT", None)
    assert isinstance(variable, contextvars.ContextVar), _broken(
        shim, "fully_shard.py no longer has the ContextVar _FSDP_CONTEXT"
    )
    assert variable.get() is None, _broken(shim, "_FSDP_CONTEXT has a non-None default")
    # fully_shard reads it: outside any context it refuses before touching the mesh.
    with pytest.raises(RuntimeError, match="fully_shard_context"):
        experimental.fully_shard(nn.Linear(2, 2), None, fsdp_placements())


def test_upstream_ties_flag_matches_the_parameter_group_api() -> None:
    shim = "_megatron.UPSTREAM_TIES / fully_shard (our 0.6.1 tie patch)"
    group_cls = parameter_group_py.FsdpParameterGroup
    upstream = hasattr(group_cls, "_set_module_parameter")
    assert upstream == _megatron.UPSTREAM_TIES, _broken(shim, "flag out of date")
    if upstream:
        # 0.7 parameter_group.py ``_set_module_parameter(fqns, parameter)`` installs one
        # parameter under every FQN; module.py collects duplicates to feed it.
        assert list(_parameters(group_cls._set_module_parameter))[1:] == ["fqns", "parameter"], (
            _broken(shim, "_set_module_parameter(fqns, parameter) signature changed")
        )
        source = inspect.getsource(module_py._collect_owned_parameters)
        assert "remove_duplicate=False" in source, _broken(
            shim, "module.py _collect_owned_parameters no longer keeps duplicate FQNs (ties)"
        )
    else:
        # 0.6.1 parameter_group.py ``_set_module_parameters(parameters)``, which our patch
        # wraps; both switches must go through it or aliases go stale.
        assert callable(getattr(group_cls, "_set_module_parameters", None)), _broken(
            shim, "neither _set_module_parameter nor _set_module_parameters exists"
        )
        for switch in ("_switch_to_sharded_parameters", "_switch_to_unsharded_parameters"):
            source = inspect.getsource(getattr(group_cls, switch))
            assert "_set_module_parameters" in source, _broken(
                shim, f"{switch} no longer calls _set_module_parameters"
            )


def test_own_placements_flag_matches_the_exports() -> None:
    """0.6.1 exports Flat/Partial/Replicate; 0.7 takes torch's Shard(0)/Partial("avg")."""
    shim = "_megatron.fsdp_placements / hsdp_placements"
    own = hasattr(experimental, "Flat")
    assert own == _megatron._HAS_OWN_PLACEMENTS, _broken(shim, "flag out of date")
    if own:
        for name in ("Partial", "Replicate", "Placements"):
            assert hasattr(experimental, name), _broken(shim, f"experimental.{name} is gone")
        return
    # 0.7 module.py ``_specialize_placements``: Shard(0) becomes the DBuffer Flat.
    specialize = getattr(module_py, "_specialize_placements", None)
    assert specialize is not None, _broken(shim, "module.py _specialize_placements is gone")
    (flat,) = specialize((Shard(0),), torch.float32)
    assert isinstance(flat, placement_py.Flat), _broken(shim, "Shard(0) no longer maps to Flat")
    # 0.7 dbuffer.py ``_get_reduce_op``: Partial takes the reduce op's name.
    reduce_op = dbuffer_py._get_reduce_op(_megatron.hsdp_placements().gradient[0])
    assert reduce_op == torch.distributed.ReduceOp.AVG, _broken(
        shim, 'Partial("avg") no longer maps to ReduceOp.AVG'
    )


def test_placements_dataclass_fields() -> None:
    shim = "_megatron.fsdp_placements / hsdp_placements"
    fields = [f.name for f in dataclasses.fields(experimental.Placements)]
    assert fields == ["dp_axes", "parameter", "gradient", "optimizer"], _broken(
        shim, f"Placements fields are {fields}"
    )
    with pytest.raises(ValueError):  # __post_init__ validates one placement per axis
        experimental.Placements(dp_axes=[0], parameter=[], gradient=[], optimizer=[])


def test_replicated_parameters_flag_matches_the_parameter_group_api() -> None:
    """0.7 builds each buffer from its own placements; 0.6.1 refuses replicated weights."""
    shim = "_megatron.REPLICATED_PARAMETERS / placements_problem (sharding_modes)"
    names = list(_parameters(parameter_group_py.FsdpParameterGroup.__init__))
    split = "model_weight_placements" in names
    assert split == _megatron.REPLICATED_PARAMETERS, _broken(shim, "flag out of date")
    if split:
        assert {"main_grad_placements", "main_weight_placements"} <= set(names), _broken(
            shim, f"FsdpParameterGroup.__init__ parameters are {names}"
        )
        # 0.7 unshard_parameters computes with a replicated model weight as it is.
        source = inspect.getsource(parameter_group_py.FsdpParameterGroup.unshard_parameters)
        assert "self._unsharded_model_weight.placements" in source, _broken(
            shim, "unshard_parameters no longer keeps a replicated model weight"
        )
    else:  # 0.6.1 parameter_group.py ``unshard_parameters``: the refusal we pre-empt
        source = inspect.getsource(parameter_group_py.FsdpParameterGroup.unshard_parameters)
        assert "requires a changed placement axis" in source, _broken(
            shim, "0.6.1's unshard no longer needs a sharded model weight: lift the refusal"
        )


def test_buffers_redistribute_one_mesh_axis_at_a_time() -> None:
    """placements_problem uses upstream's rule; HSDP ZeRO-1 is refused while it holds.

    Exit condition for that refusal: once ``changed_mesh_axis`` accepts two changed axes
    (a DBuffer redistributing across both), lift it and test HYBRID_SHARD_OPTIMIZER.
    """
    shim = "_megatron.placements_problem"
    changed = getattr(placement_py, "changed_mesh_axis", None)
    assert changed is not None, _broken(shim, "placement.py changed_mesh_axis is gone")
    hsdp = _megatron.hsdp_placements()
    assert changed(hsdp.gradient, hsdp.optimizer) == 0
    zero1 = _megatron.sharding_placements(
        parameters=False, gradients=False, optimizer=True, hybrid=True
    )
    with pytest.raises(NotImplementedError):
        changed(zero1.gradient, zero1.optimizer)
    assert "more than one mesh axis" in (_megatron.placements_problem(zero1) or "")


def test_fully_shard_signature() -> None:
    shim = "_megatron.fully_shard"
    names = list(_parameters(experimental.fully_shard))
    assert names[:4] == ["module", "mesh", "placements", "mixed_precision_policy"], _broken(
        shim, f"fully_shard parameters are {names}"
    )
    # Upstream's _attach_mixin builds ``type(name, (FsdpModule, cls), {})``; our shared
    # class replaces it and must stay equivalent: same bases, an empty body.
    source = inspect.getsource(fully_shard_py._attach_mixin)
    assert "(FsdpModule, module_cls), {})" in source, _broken(
        "_megatron._shared_fsdp_class", "fully_shard.py _attach_mixin builds another class"
    )


# ---------------------------------------------------------------------------------------
# DBuffer (uneven_dtensor chunk arithmetic, CPU adapter)
# ---------------------------------------------------------------------------------------


def test_dbuffer_flat_placement() -> None:
    shim = "_megatron.dbuffer_flat"
    flat = _megatron.dbuffer_flat()
    assert type(flat) is placement_py.Flat, _broken(shim, "placement.py Flat moved")
    if not _megatron._HAS_OWN_PLACEMENTS:
        assert isinstance(flat, Shard) and flat.dim == 0, _broken(
            shim, "0.7 Flat is no longer a dim-0 torch Shard"
        )


def test_dbuffer_from_local_signature() -> None:
    shim = "_megatron.dbuffer_from_local"
    parameters = _parameters(dbuffer_py.DBuffer.from_local)
    assert list(parameters)[:4] == ["local_buffer", "mesh", "placements", "tensor_shapes"], _broken(
        shim, f"DBuffer.from_local parameters are {list(parameters)}"
    )
    stream = parameters.get("allocation_stream")
    assert (stream is not None) == _megatron._FROM_LOCAL_TAKES_STREAM, _broken(
        shim, "flag _FROM_LOCAL_TAKES_STREAM out of date"
    )
    if stream is not None:
        assert stream.kind is inspect.Parameter.KEYWORD_ONLY, _broken(
            shim, "allocation_stream is no longer keyword-only"
        )


def test_dbuffer_layout_attributes() -> None:
    """_megatron.owned_range reads layout, offset and local_buffer; main_weight_local
    reads ``get_local_tensor``."""
    shim = "_megatron.owned_range / main_weight_local"
    annotations = _annotations(dbuffer_py.DBuffer)
    for name in ("layout", "offset", "local_buffer", "mesh", "placements"):
        assert name in annotations, _broken(shim, f"DBuffer.{name} is gone")
    assert list(_parameters(dbuffer_py.DBuffer.get_local_tensor)) == ["self", "index"], _broken(
        shim, "DBuffer.get_local_tensor(index) signature changed"
    )
    layout = _megatron.GlobalLayout.build([torch.Size((2, 3))], 2)
    for name in ("tensor_shapes", "tensor_to_offset", "size"):
        assert hasattr(layout, name), _broken(shim, f"GlobalLayout.{name} is gone")


def test_dbuffer_allocation_stream() -> None:
    """0.7 dbuffer.py ``allocation_stream``: the CPU adapter wraps ``DBuffer.__init__``."""
    shim = "cpu_execution._record_sync_allocation_stream (enable_cpu_execution)"
    annotated = "allocation_stream" in _annotations(dbuffer_py.DBuffer)
    init_source = inspect.getsource(_upstream_dbuffer_init())
    upstream_sources = "\n".join(
        inspect.getsource(m) for m in (dbuffer_py, parameter_group_py, module_py)
    )
    if not annotated:
        assert "allocation_stream" not in upstream_sources, _broken(
            shim, "upstream uses allocation_stream but DBuffer does not annotate it"
        )
        return
    assert "self.allocation_stream =" in init_source and "is_cuda" in init_source, _broken(
        shim, "DBuffer.__init__ no longer records allocation_stream only for CUDA buffers"
    )


# ---------------------------------------------------------------------------------------
# Prefetch and backward re-entry (release_prefetched, _once_per_backward)
# ---------------------------------------------------------------------------------------


def test_phase_flag_and_prefetch_state() -> None:
    """0.7 module.py ``FsdpModule.Phase``/``phase``, ``_unshard_event`` and
    ``_reshard_parameter_groups``: what release_prefetched reads and calls."""
    shim = "_megatron.release_prefetched / fully_shard_optimizer (step pre-hook)"
    module_cls = module_py.FsdpModule
    phase = getattr(module_cls, "Phase", None)
    assert (phase is None) == (_megatron._PHASE is None), _broken(shim, "flag _PHASE out of date")
    assert "_unshard_event" in _annotations(module_cls), _broken(
        shim, "FsdpModule._unshard_event is gone"
    )
    reshard = getattr(module_cls, "_reshard_parameter_groups", None)
    assert callable(reshard) and "self._unshard_event = None" in inspect.getsource(reshard), (
        _broken(shim, "_reshard_parameter_groups no longer clears _unshard_event")
    )
    # Both versions prefetch the next unit of a static order from pre_forward/pre_backward.
    for hook, order in (("pre_forward", "forward_order"), ("pre_backward", "backward_order")):
        assert f"context.{order}.next_item(self)" in inspect.getsource(getattr(module_cls, hook)), (
            _broken(shim, f"{hook} no longer prefetches from {order}")
        )
    if phase is None:
        # 0.6.1: no phase to tell a resting unit, so release_prefetched does nothing; that
        # is safe only because a context has one root (no cross-root prefetch).
        assert "root_module" in _parameters(module_py.FsdpContext.__init__), _broken(
            shim, "no FsdpModule.phase, but FsdpContext no longer has one root"
        )
        return
    assert {"RESTING", "FORWARD", "BACKWARD"} <= set(phase.__members__), _broken(
        shim, f"FsdpModule.Phase is {list(phase.__members__)}"
    )
    assert isinstance(inspect.getattr_static(module_cls, "phase"), property), _broken(
        shim, "FsdpModule.phase is no longer a property"
    )


def test_backward_pre_hook_and_pre_backward() -> None:
    """module.py ``_register_hooks``: the full backward pre-hook that
    ``_once_per_backward`` wraps calls ``pre_backward``, which our structured-output hook
    calls too."""
    shim = "_megatron._once_per_backward / _pre_backward_for_structured_output"
    assert callable(getattr(module_py.FsdpModule, "pre_backward", None)), _broken(
        shim, "FsdpModule.pre_backward is gone"
    )
    source = inspect.getsource(module_py.FsdpModule._register_hooks)
    assert "register_full_backward_pre_hook" in source and "pre_backward()" in source, _broken(
        shim, "_register_hooks no longer registers pre_backward as a full backward pre-hook"
    )
    if _megatron._PHASE is not None:
        assert "self.phase = FsdpModule.Phase.BACKWARD" in inspect.getsource(
            module_py.FsdpModule.pre_backward
        ), _broken(shim, "pre_backward no longer enters the BACKWARD phase")


def test_fully_shard_optimizer_signature() -> None:
    shim = "_megatron.fully_shard_optimizer"
    parameters = _parameters(experimental.fully_shard_optimizer)
    assert list(parameters) == ["optimizer", "precision_aware"], _broken(
        shim, f"fully_shard_optimizer parameters are {list(parameters)}"
    )


# ---------------------------------------------------------------------------------------
# CPU adapter: the upstream modules whose ``torch`` it replaces, and the calls it covers
# ---------------------------------------------------------------------------------------


def test_patched_modules_bind_torch_by_name() -> None:
    """cpu_execution replaces ``module.torch`` and ``parameter_group.torch``."""
    shim = "cpu_execution.enable_cpu_execution (_patched_modules)"
    modules = cpu_execution._patched_modules()
    assert [m.__name__ for m in modules] == [module_py.__name__, parameter_group_py.__name__]
    for upstream in modules:
        bound = getattr(upstream, "torch", None)
        assert bound is torch or isinstance(bound, cpu_execution._TorchProxy), _broken(
            shim, f"{upstream.__name__} no longer binds the name `torch` at module level"
        )
        assert "import torch\n" in inspect.getsource(upstream), _broken(
            shim, f"{upstream.__name__} no longer does `import torch`"
        )


def _cuda_calls(source: str) -> set[str]:
    """``torch.cuda.<name>`` used in code, annotations excluded."""
    tree = ast.parse(textwrap.dedent(source))
    annotations: set[int] = set()
    for node in ast.walk(tree):
        target = None
        if isinstance(node, (ast.AnnAssign, ast.arg)):
            target = node.annotation
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            target = node.returns
        if target is not None:
            annotations.update(id(n) for n in ast.walk(target))
    used = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and id(node) not in annotations
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "cuda"
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "torch"
        ):
            used.add(node.attr)
    return used


# What the proxy stands in for on a non-CUDA device (cpu_execution._CudaProxy), and the
# calls that only run with symmetric memory (NCCL, CUDA only).
_HANDLED = {"device", "Stream", "current_stream", "stream", "nvtx"}
_CUDA_ONLY = {"use_mem_pool", "MemPool"}


def test_cuda_calls_of_patched_modules_are_covered_by_the_proxy() -> None:
    shim = "cpu_execution._CudaProxy"
    # Not vacuous: the scan finds the stream calls every version of module.py makes.
    assert {"Stream", "stream", "nvtx"} <= _cuda_calls(inspect.getsource(module_py))
    for upstream in cpu_execution._patched_modules():
        unknown = _cuda_calls(inspect.getsource(upstream)) - _HANDLED - _CUDA_ONLY
        assert not unknown, _broken(
            shim, f"{upstream.__name__} now calls torch.cuda.{sorted(unknown)} on every device"
        )


def test_dbuffer_calls_cuda_only_when_recording_its_stream() -> None:
    """dbuffer.py is not patched: its only torch.cuda call must be guarded by ``is_cuda``."""
    shim = "cpu_execution (DBuffer is not patched)"
    source = inspect.getsource(dbuffer_py)
    calls = _cuda_calls(source)
    assert calls <= {"current_stream"}, _broken(
        shim, f"dbuffer.py calls torch.cuda.{sorted(calls)}"
    )
    if calls:
        init = inspect.getsource(_upstream_dbuffer_init())
        assert "current_stream" in init and "is_cuda" in init, _broken(
            shim, "dbuffer.py calls torch.cuda.current_stream outside the guarded __init__"
        )
        outside = source.replace(textwrap.dedent(init), "").replace(init, "")
        assert "torch.cuda.current_stream(" not in outside, _broken(
            shim, "dbuffer.py calls torch.cuda.current_stream outside __init__"
        )


# ---------------------------------------------------------------------------------------
# Parameter groups and modules, on one real rank
# ---------------------------------------------------------------------------------------


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _probe(rank: int, world_size: int) -> dict[str, Any]:
    """Shard real models once and record every fact the tests below check."""
    from lightning_megatron_fsdp import enable_cpu_execution

    enable_cpu_execution()
    facts: dict[str, Any] = {}
    mesh = dp_mesh(world_size)
    model = shard_packed_lm(build_packed_lm(0), mesh)
    module = model.blocks[0]
    group = module.parameter_groups[0]
    facts["module_is_fsdp"] = isinstance(module, module_py.FsdpModule)
    facts["parameter_groups_type"] = type(module.parameter_groups).__name__
    facts["group_type_ok"] = isinstance(group, parameter_group_py.FsdpParameterGroup)
    facts["group_has"] = {
        name: hasattr(group, name)
        for name in (
            "fsdp_parameters",
            "parameter_names",
            "sharded_parameters",
            "unsharded_parameters",
            "owning_module",
            "_owning_module",
            "main_weight",
            "model_weight",
        )
    }
    if hasattr(group, "fsdp_parameters"):
        first = group.fsdp_parameters[0]
        facts["fsdp_parameter_fields"] = [f.name for f in dataclasses.fields(first)]
        facts["owning_module_is_weakref"] = isinstance(group._owning_module, weakref.ref)
        facts["owning_module_ok"] = group._owning_module() is module
    else:
        facts["owning_module_ok"] = group.owning_module is module
    entries = _megatron.entries(group)
    facts["entries_fqns"] = [e.fqns for e in entries]
    facts["entries_sharded_dtensor"] = all(isinstance(e.sharded, DTensor) for e in entries)
    facts["sharded_is_module_parameter"] = entries[0].sharded is module.mix
    facts["group_of_sharded"] = _megatron.group_of(entries[0].sharded) is group
    facts["group_of_unsharded"] = _megatron.group_of(entries[0].unsharded) is group
    facts["main_weight_is_dbuffer"] = isinstance(group.main_weight, dbuffer_py.DBuffer)
    facts["owned_range_matches_local"] = all(
        _megatron.owned_range(group.main_weight, e.index).numel
        == _megatron.main_weight_local(group, e.index).numel()
        for e in entries
    )
    facts["group_mesh_ok"] = _megatron.group_mesh(group) is mesh
    storage = _megatron.main_weight_storage(group)
    facts["main_weight_storage_ok"] = storage.dim() == 1 and all(
        _megatron.main_weight_local(group, e.index).untyped_storage().data_ptr()
        == storage.untyped_storage().data_ptr()
        for e in entries
    )
    facts["replicated_mesh_dims"] = _megatron.replicated_mesh_dims(group)
    facts["owning_module_shim"] = _megatron.owning_module(group) is module
    facts["context_attr"] = isinstance(module._context, module_py.FsdpContext)
    facts["context_property"] = module.context is module._context
    context = module.context
    facts["context_streams"] = callable(getattr(context, "current_stream", None)) and hasattr(
        context, "reduce_scatter_stream"
    )
    facts["is_root"] = [model.is_root(), module.is_root()]
    if hasattr(group.main_weight, "allocation_stream"):
        facts["allocation_stream"] = type(group.main_weight.allocation_stream).__name__
    # sync_model_weight_from_main_weight: our load path's refresh.
    _megatron.sync_compute_weights(model)
    facts["synced"] = True

    # Upstream's own fully_shard on a tied module (no tie patch of ours).
    tied = _Tied()
    sharding = _megatron.ShardingContext(torch.device("cpu"), eager_roots=False)
    experimental.fully_shard(tied, mesh, fsdp_placements())
    sharding.close()
    facts["raw_class_bases"] = [c.__name__ for c in type(tied).__bases__]
    facts["raw_class_body"] = sorted(
        k for k in vars(type(tied)) if k not in ("__module__", "__doc__", "__qualname__")
    )
    facts["raw_tied_fqns"] = [e.fqns for e in _megatron.entries(tied.parameter_groups[0])]

    # nested_calls_unhooked: the root called inside its own forward, as a strategy step
    # that calls self(x) does; with the shim, then without it.
    facts["recorded_hooks"] = {
        name: len(keys) for name, keys in vars(model)[_megatron._FSDP_HOOKS_ATTR].items()
    }
    facts["nested"] = {}
    for shim in (True, False):
        lm = shard_packed_lm(build_packed_lm(1, num_blocks=1), mesh)

        def forward_calling_itself(tokens: torch.Tensor, lm: Any = lm, shim: bool = shim) -> Any:
            del lm.forward
            with _megatron.nested_calls_unhooked(lm) if shim else contextlib.nullcontext():
                return lm(tokens).float().square().mean()

        lm.forward = forward_calling_itself
        try:
            lm(make_batch(0)[0]).backward()
            facts["nested"][shim] = "ok"
        except RuntimeError as err:
            facts["nested"][shim] = str(err)
        facts["nested"][f"{shim}/trained"] = all(p.grad is not None for p in lm.parameters())
    return facts


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    (result,) = run_distributed(_probe, 1, timeout=TIMEOUT)
    return result


def test_fsdp_module_and_parameter_groups(facts: dict[str, Any]) -> None:
    shim = "_megatron.fsdp_modules / parameter_groups"
    assert facts["module_is_fsdp"], _broken(shim, "sharded modules are not FsdpModule")
    assert facts["parameter_groups_type"] == "tuple", _broken(
        shim, "FsdpModule.parameter_groups is not a tuple"
    )
    assert facts["group_type_ok"], _broken(shim, "groups are not FsdpParameterGroup")


def test_fsdp_parameters(facts: dict[str, Any]) -> None:
    """0.7 ``FsdpParameter(fqns, sharded, unsharded)``; 0.6.1 three parallel tuples."""
    shim = "_megatron.entries"
    has = facts["group_has"]
    if has["fsdp_parameters"]:
        assert facts["fsdp_parameter_fields"] == ["fqns", "sharded", "unsharded"], _broken(
            shim, f"FsdpParameter fields are {facts['fsdp_parameter_fields']}"
        )
    else:
        missing = [
            n
            for n in ("parameter_names", "sharded_parameters", "unsharded_parameters")
            if not has[n]
        ]
        assert not missing, _broken(shim, f"no fsdp_parameters, and no {missing}")
    assert facts["entries_fqns"][:2] == [("mix",), ("gain",)], _broken(
        shim, f"entries report {facts['entries_fqns']}"
    )
    assert facts["entries_sharded_dtensor"] and facts["sharded_is_module_parameter"], _broken(
        shim, "the sharded parameters are not the DTensors installed on the module at rest"
    )


def test_owning_module(facts: dict[str, Any]) -> None:
    """0.7 ``_owning_module`` (a weak reference); 0.6.1 ``owning_module``."""
    shim = "_megatron.owning_module"
    if facts["group_has"]["fsdp_parameters"]:
        assert facts["group_has"]["_owning_module"] and facts["owning_module_is_weakref"], _broken(
            shim, "FsdpParameterGroup._owning_module is no longer a weak reference"
        )
    else:
        assert facts["group_has"]["owning_module"], _broken(shim, "owning_module is gone")
    assert facts["owning_module_ok"] and facts["owning_module_shim"], _broken(
        shim, "the group's owning module is not the unit it belongs to"
    )


def test_get_containing_parameter_group(facts: dict[str, Any]) -> None:
    shim = "_megatron.group_of (parameter_group.get_containing_parameter_group)"
    assert facts["group_of_sharded"] and facts["group_of_unsharded"], _broken(
        shim, "sharded or unsharded parameters no longer point to their group"
    )


def test_main_weight_buffer(facts: dict[str, Any]) -> None:
    shim = "_megatron.main_weight / owned_range (uneven_dtensor, sharding)"
    assert facts["group_has"]["main_weight"] and facts["main_weight_is_dbuffer"], _broken(
        shim, "FsdpParameterGroup.main_weight is not a DBuffer"
    )
    assert facts["owned_range_matches_local"], _broken(
        shim, "owned_range disagrees with DBuffer.get_local_tensor's rows"
    )
    assert facts["group_mesh_ok"], _broken("_megatron.group_mesh", "group.mesh is not the mesh")
    assert facts["main_weight_storage_ok"], _broken(
        "_megatron.main_weight_storage (replicas)",
        "DBuffer.local_buffer is not the flat storage behind the main-weight views",
    )
    assert facts["replicated_mesh_dims"] == (), _broken(
        "_megatron.replicated_mesh_dims (replicas)",
        "a fully sharded group's main-weight placements read as replicated",
    )


def test_sync_model_weight_from_main_weight(facts: dict[str, Any]) -> None:
    shim = "_megatron.sync_compute_weights"
    assert callable(
        getattr(parameter_group_py.FsdpParameterGroup, "sync_model_weight_from_main_weight", None)
    ), _broken(shim, "FsdpParameterGroup.sync_model_weight_from_main_weight is gone")
    assert facts["synced"]


def test_module_context(facts: dict[str, Any]) -> None:
    """``FsdpModule._context``/``context``: microbatch, join_gradient_reduction, close()."""
    shim = "_megatron._contexts / join_gradient_reduction / ShardingContext.owns"
    assert facts["context_attr"] and facts["context_property"], _broken(
        shim, "FsdpModule._context is not the module's FsdpContext"
    )
    assert facts["context_streams"], _broken(
        shim, "FsdpContext.current_stream() or reduce_scatter_stream is gone"
    )
    assert facts["is_root"] == [True, False], _broken(
        "strategy root handling (FsdpModule.is_root)", f"is_root() gave {facts['is_root']}"
    )


def test_cpu_buffers_record_a_sync_stream(facts: dict[str, Any]) -> None:
    shim = "cpu_execution._record_sync_allocation_stream"
    if "allocation_stream" in _annotations(dbuffer_py.DBuffer):
        assert facts.get("allocation_stream") == "SyncStream", _broken(
            shim, "a CPU DBuffer's allocation_stream is not our SyncStream"
        )
    else:
        assert "allocation_stream" not in facts


def test_upstream_fully_shard_class_and_ties(facts: dict[str, Any]) -> None:
    """Upstream's own class (replaced by our shared one) and its tie handling."""
    assert facts["raw_class_bases"] == ["FsdpModule", "_Tied"], _broken(
        "_megatron._shared_fsdp_class / user_class",
        f"fully_shard's class has bases {facts['raw_class_bases']}",
    )
    assert facts["raw_class_body"] == [], _broken(
        "_megatron._shared_fsdp_class",
        f"fully_shard's class defines {facts['raw_class_body']}",
    )
    if _megatron.UPSTREAM_TIES:
        expected = [("a.weight", "b.weight"), ("a.bias",), ("b.bias",)]
    else:  # packed twice: why our 0.6.1 tie patch exists
        expected = [("a.weight",), ("a.bias",), ("b.weight",), ("b.bias",)]
    assert facts["raw_tied_fqns"] == expected, _broken(
        "_megatron.UPSTREAM_TIES / fully_shard",
        f"upstream packed a tied module as {facts['raw_tied_fqns']}",
    )


def test_fsdp_hooks_and_reentry(facts: dict[str, Any]) -> None:
    """module.py ``FsdpModule._register_hooks`` uses the module's hook registries, and a
    unit called inside its own forward needs ``nested_calls_unhooked`` exactly where the
    hooks are not re-entrant (0.7's ``FsdpModule.phase``)."""
    shim = "_megatron.nested_calls_unhooked (steps._run_as_root_forward)"
    recorded = facts["recorded_hooks"]
    for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks"):
        assert recorded.get(name, 0) >= 1, _broken(
            shim, f"fully_shard registered no hook in {name} ({recorded})"
        )
    assert facts["nested"][True] == "ok" and facts["nested"]["True/trained"], _broken(
        shim, f"a unit called inside its own forward failed: {facts['nested'][True]}"
    )
    if hasattr(module_py.FsdpModule, "phase"):
        assert "Invalid FSDP module phase transition" in facts["nested"][False], _broken(
            shim, f"unhooked re-entry no longer needed? without the shim: {facts['nested'][False]}"
        )
    else:
        assert facts["nested"][False] == "ok", _broken(shim, facts["nested"][False])


def test_this_module_covers_every_private_import() -> None:
    """Every private megatron-fsdp module _megatron/cpu_execution import is checked here."""
    from lightning_megatron_fsdp.megatron import _megatron as shims

    used = set()
    for source_module in (shims, cpu_execution):
        tree = ast.parse(inspect.getsource(source_module))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "megatron_fsdp.experimental."
            ):
                used.add(node.module)
    covered = {
        m.__name__
        for m in (dbuffer_py, module_py, parameter_group_py, placement_py, fully_shard_py)
    } | {"megatron_fsdp.experimental.layout"}
    assert used <= covered, f"add tests for {sorted(used - covered)} to {__name__}"
    assert isinstance(fully_shard_py, types.ModuleType)
