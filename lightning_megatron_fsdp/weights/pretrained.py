"""Fill a Megatron-FSDP sharded model (and its optimizers, by FQN) from full weights or another
layout's DCP checkpoint, each rank reading only the rows it owns straight into its
main-weight shard, after every rank has checked the source against the model and the ranks
agreed (:func:`load_full_weights`, :class:`PretrainedWeights`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_megatron_fsdp import _lightning, _torch
from lightning_megatron_fsdp.agreement import Problem, Ranks
from lightning_megatron_fsdp.megatron import (
    _megatron,
    attach_uneven_dtensor_metadata,
    chunk_metadata_by_fqn,
    ensure_optimizer_state,
)
from lightning_megatron_fsdp.storage import (
    OPTIMIZER_PREFIX,
    Location,
    listed,
    locate,
    request_deadline,
)
from lightning_megatron_fsdp.weights.weight_sources import (
    SourceError,
    SourceTensorSpec,
    TensorCopy,
    WeightSource,
    WeightsPlan,
    agree_on_problems,
    open_source,
    unreadable,
)

__all__ = [
    "FullWeightsLoad",
    "PretrainedWeights",
    "apply_pretrained_weights",
    "as_pretrained_weights",
    "load_full_weights",
]

# Attribute set on a model once initial weights were applied, so a second Trainer run
# with the same model (fit, then test) does not overwrite trained weights.
_APPLIED_ATTR = "_lmf_pretrained_applied"


# ---------------------------------------------------------------------- public API


@dataclasses.dataclass(frozen=True)
class PretrainedWeights:
    """Where to read initial full weights from, and how to match their keys.

    The form of ``MegatronFSDPStrategy(init_weights_from=...)``; a plain path means
    ``PretrainedWeights(path)``.

    Args:
        path: A ``torch.save`` state dict (``.pt``/``.pth``/``.bin``), a Lightning
            ``.ckpt`` file, a ``.safetensors`` file, a consolidated export, or a DCP
            checkpoint directory (ours, or Lightning ``ModelParallelStrategy``'s); or the
            URL of any of them on an object store (``s3://bucket/model.safetensors``,
            ``s3://bucket/run/ckpts/last.ckpt``: the newest complete version), read in
            place with ranged GETs, each rank fetching only its own rows.
        strict: Refuse model FQNs missing from the source and source keys the model does
            not have. Shapes and dtypes of keys on both sides are checked either way.
        strip_prefix: Removed from the start of every source key before matching (for
            example ``"model."`` for weights saved from a wrapper); keys without it
            count as unexpected.
        add_prefix: Prepended to every source key (after ``strip_prefix``), for example
            ``"net."`` when the LightningModule holds the pretrained network as ``net``.
        weights_only: ``torch.load``'s ``weights_only`` for ``torch.save`` files. Keep
            ``True`` unless you trust the file and it holds objects the safe unpickler
            refuses.
        storage_options: Options of a URL's fsspec filesystem (s3fs: ``endpoint_url``,
            ``key``, ``secret``, ...); without them the filesystem's own configuration
            applies (the ``AWS_*`` variables).

    Raises:
        TypeError: If an option has the wrong type.
        ValueError: If ``path`` is empty.
    """

    path: str | os.PathLike[str]
    strict: bool = True
    strip_prefix: str = ""
    add_prefix: str = ""
    weights_only: bool = True
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike):
            raise TypeError(
                f"PretrainedWeights: path must be a str or os.PathLike, got {self.path!r}."
            )
        if not os.fspath(self.path):
            raise ValueError("PretrainedWeights: path must not be empty.")
        for name in ("strict", "weights_only"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"PretrainedWeights: {name} must be a bool, got {getattr(self, name)!r}."
                )
        for name in ("strip_prefix", "add_prefix"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(
                    f"PretrainedWeights: {name} must be a str, got {getattr(self, name)!r}."
                )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise TypeError(
                "PretrainedWeights: storage_options must be a mapping of fsspec filesystem "
                f"options (e.g. {{'endpoint_url': ...}}), got {self.storage_options!r:.200}."
            )


@dataclasses.dataclass(frozen=True)
class FullWeightsLoad:
    """What :func:`load_full_weights` loaded (identical on every rank).

    Attributes:
        source: The source path (absolute), or its URL as given.
        kind: ``"torch"``, ``"safetensors"`` or ``"dcp"``.
        loaded: Model FQNs filled from the source (every FQN of a tied parameter).
        missing: Model FQNs the source does not hold (left as they were; only with
            ``strict=False``).
        unexpected: Source keys no model FQN matches (ignored; only with ``strict=False``).
        optimizers: Number of optimizers whose state was loaded.
    """

    source: Path | str
    kind: str
    loaded: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    optimizers: int

    def __post_init__(self) -> None:
        if self.kind not in ("torch", "safetensors", "dcp"):
            raise AssertionError(f"FullWeightsLoad: unknown source kind {self.kind!r}.")
        if set(self.loaded) & set(self.missing):
            raise AssertionError("FullWeightsLoad: an FQN is both loaded and missing.")


def as_pretrained_weights(
    value: str | os.PathLike[str] | PretrainedWeights | None,
) -> PretrainedWeights | None:
    """Normalise ``MegatronFSDPStrategy(init_weights_from=...)``.

    Raises:
        TypeError: If ``value`` is not a path, a :class:`PretrainedWeights` or ``None``.
    """
    if value is None or isinstance(value, PretrainedWeights):
        return value
    if isinstance(value, str | os.PathLike):
        return PretrainedWeights(value)
    raise TypeError(
        "MegatronFSDPStrategy: init_weights_from must be a path (str or os.PathLike), a "
        f"lightning_megatron_fsdp.PretrainedWeights, or None; got {value!r}."
    )


def apply_pretrained_weights(model: nn.Module, weights: PretrainedWeights) -> bool:
    """Load ``weights`` into the sharded ``model`` unless they were already applied to it.

    The strategy calls this right after sharding, before optimizers exist. Once applied,
    the model is marked, so a later Trainer run with the same model and weights (``fit``
    then ``test``) keeps the trained values instead of re-initialising them. A
    ``ckpt_path`` restore runs after this and overrides it. Collective.

    Returns:
        Whether the weights were loaded now.

    Raises:
        CheckpointError | CheckpointMismatchError: As :func:`load_full_weights`.
    """
    if getattr(model, _APPLIED_ATTR, None) == weights:
        return False
    load_full_weights(
        model,
        weights.path,
        strict=weights.strict,
        strip_prefix=weights.strip_prefix,
        add_prefix=weights.add_prefix,
        weights_only=weights.weights_only,
        storage_options=weights.storage_options,
    )
    setattr(model, _APPLIED_ATTR, weights)
    return True


def load_full_weights(
    model: nn.Module,
    source: str | os.PathLike[str],
    *,
    optimizers: Sequence[Optimizer] = (),
    strict: bool = True,
    strip_prefix: str = "",
    add_prefix: str = "",
    weights_only: bool = True,
    storage_options: Mapping[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> FullWeightsLoad:
    """Fill a Megatron-FSDP sharded model from full weights, each rank reading its own rows.

    Collective over ``process_group``: every rank calls it with the same arguments, at
    rest (between steps, not inside forward or backward). No rank ever holds a full
    parameter that it does not own rows of; no gather of parameters happens.

    Args:
        model: A module tree sharded by Megatron-FSDP (``shard_module`` or
            ``MegatronFSDPStrategy``); plain buffers are filled too.
        source: See :class:`PretrainedWeights` ``path``. The format is chosen by what the
            path is: a directory holding ``.metadata`` is DCP, ``.safetensors`` is
            safetensors, ``.pt``/``.pth``/``.bin``/``.ckpt`` files are ``torch.save``; on
            an object store likewise (a prefix holding checkpoint versions or DCP
            objects is DCP).
        optimizers: Optimizers over ``model``'s sharded parameters whose state to load
            too, by parameter FQN (``optimizer_states[i]`` / ``optimizer_<i>`` of the
            source for ``optimizers[i]``). Their state is created first if they never
            stepped. Hyper-parameters (``param_groups`` values) are loaded as well.
        strict: See :class:`PretrainedWeights`. With ``strict``, requesting optimizers
            from a source without optimizer state is an error too.
        strip_prefix: See :class:`PretrainedWeights`.
        add_prefix: See :class:`PretrainedWeights`.
        weights_only: See :class:`PretrainedWeights`.
        storage_options: See :class:`PretrainedWeights`.
        process_group: Ranks that load together; the default group when ``None``. Its
            timeout bounds every collective here, and half of it every request to an
            object store.

    Returns:
        What was loaded, identical on every rank.

    Raises:
        CheckpointError: On every rank, if any rank cannot read the source (missing,
            unknown format, unreadable, a URL whose filesystem is not installed: the
            message names what to install), naming the rank(s). Raised before any value is
            written, unless reading fails halfway (then the message says the model is
            partly overwritten).
        CheckpointMismatchError: On every rank, before any value is written, listing
            every missing, unexpected, mis-shaped or mis-typed key (by FQN).
        TypeError: If an argument has the wrong type (every rank alike).
        ValueError: If ``model`` is not sharded by Megatron-FSDP.
    """
    options = PretrainedWeights(
        source,
        strict=strict,
        strip_prefix=strip_prefix,
        add_prefix=add_prefix,
        weights_only=weights_only,
        storage_options=storage_options,
    )
    if not _megatron.fsdp_modules(model):
        raise ValueError(
            f"load_full_weights: {type(model).__name__} is not sharded by Megatron-FSDP. "
            "Shard it first (shard_module or MegatronFSDPStrategy); for a plain module use "
            "model.load_state_dict(torch.load(path))."
        )
    optimizers = [_lightning.unwrap_optimizer(o) for o in optimizers]  # LightningOptimizer
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"load_full_weights: optimizers[{index}] must be a torch.optim.Optimizer, "
                f"got {type(optimizer).__name__}."
            )
    comm = Ranks.of(process_group)
    # On an object store each request gives up in time for the collectives (as a checkpoint
    # load's do), so a stopped store fails every rank before its collectives do.
    deadline = request_deadline(comm.timeout)
    try:
        location: Location | None = locate(source, storage_options, deadline=deadline).absolute()
        path: Path | str = location.returned()
    except (ImportError, ValueError) as err:  # agreed on below, like any unreadable source
        location, path, not_located = None, os.fspath(source), SourceError(str(err))

    # Every rank, whatever it finds below: the step may run collective optimizer hooks.
    for optimizer in optimizers:
        ensure_optimizer_state(optimizer)

    # Phase 1 (rank-local, then agreed on): open the source and plan every copy.
    problems: list[Problem] = []
    reader: WeightSource | None = None
    plan: WeightsPlan | None = None
    try:
        if location is None:
            raise not_located
        reader = open_source(location, weights_only)
        plan = _plan(model, optimizers, reader, options)
        problems = plan.problems
    except SourceError as err:
        problems = [unreadable(str(err))]
    except Exception as err:  # anything else must still reach the agreement below
        problems = [unreadable(f"rank {comm.rank}: {type(err).__name__}: {err}")]
    try:
        agree_on_problems(comm, path, problems, "Nothing was loaded; the model is unchanged.")
        assert reader is not None and plan is not None

        # Phase 2: each rank reads its rows; agree on the outcome.
        failure: list[Problem] = []
        try:
            reader.execute(plan, comm)
        except SourceError as err:
            failure = [unreadable(str(err))]
        except Exception as err:
            failure = [unreadable(f"rank {comm.rank}: {type(err).__name__}: {err}")]
        agree_on_problems(
            comm,
            path,
            failure,
            "The model (and optimizers) may be partly overwritten; load again from a good source.",
        )
    finally:
        if reader is not None:
            reader.close()
    for optimizer, state in zip(optimizers, plan.optimizer_states, strict=True):
        set_optimizer_state_dict(model, optimizer, state)
    _megatron.sync_compute_weights(model)
    return FullWeightsLoad(
        source=path,
        kind=reader.kind,
        loaded=tuple(sorted(plan.loaded)),
        missing=tuple(sorted(plan.missing)),
        unexpected=tuple(sorted(plan.unexpected)),
        optimizers=len(optimizers) if plan.has_optimizer_state else 0,
    )


# ---------------------------------------------------------------------- agreement


# ---------------------------------------------------------------------- targets and plan


def _tie_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Map every FQN of a tied parameter to all its FQNs (state-dict naming, in order)."""
    names_by_param: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(parameter), []).append(name)
    groups: dict[str, tuple[str, ...]] = {}
    for names in names_by_param.values():
        fqns = tuple(fqn for name in names for fqn in sorted(_torch.fqns_of(model, name)))
        if len(fqns) > 1:
            for fqn in fqns:
                groups[fqn] = fqns
    return groups


def _check_spec(
    plan: WeightsPlan,
    what: str,
    key: str,
    have: SourceTensorSpec,
    shape: tuple[int, ...],
    dtype: torch.dtype,
) -> bool:
    """Record a problem unless a source tensor ``have`` can fill a target; return OK."""
    ok = True
    if have.shape != shape:
        plan.mismatch(
            f"{what}: shape {have.shape} in the source ({key!r}), {shape} in the target", "shape"
        )
        ok = False
    if have.dtype != dtype and not (have.dtype.is_floating_point and dtype.is_floating_point):
        plan.mismatch(
            f"{what}: dtype {have.dtype} in the source ({key!r}), {dtype} in the target; only "
            "floating-point values are cast",
            "dtype",
        )
        ok = False
    return ok


def _copy_of(key: str, entry: torch.Tensor, chunk: Any) -> TensorCopy:
    if isinstance(entry, DTensor):
        start = int(chunk.offsets[0])
        return TensorCopy(
            key, _torch.local_tensor(entry), (start, start + int(chunk.sizes[0])), entry
        )
    return TensorCopy(key, entry, None, entry)


def _plan(
    model: nn.Module,
    optimizers: Sequence[Optimizer],
    reader: WeightSource,
    options: PretrainedWeights,
) -> WeightsPlan:
    """Match the source against the model (and optimizers) and list every copy."""
    plan = WeightsPlan()
    state = get_model_state_dict(model)
    optimizer_states = [get_optimizer_state_dict(model, o) for o in optimizers]
    # The chunk hooks make DCP read exactly this rank's rows; harmless for other sources.
    attach_uneven_dtensor_metadata(model, state, {})
    for optimizer_state in optimizer_states:
        attach_uneven_dtensor_metadata(model, {}, optimizer_state)
    chunks = chunk_metadata_by_fqn(model)
    ties = _tie_groups(model)

    # Model: source key -> model FQN through the prefixes.
    by_fqn: dict[str, str] = {}
    for key in reader.model_keys:
        if not key.startswith(options.strip_prefix):
            plan.unexpected.add(key)
            continue
        by_fqn[options.add_prefix + key[len(options.strip_prefix) :]] = key
    targets = {fqn: v for fqn, v in state.items() if isinstance(v, torch.Tensor)}
    plan.unexpected.update(key for fqn, key in by_fqn.items() if fqn not in targets)
    done: set[str] = set()
    for fqn, entry in targets.items():
        if fqn in done:
            continue
        aliases = ties.get(fqn, (fqn,))
        done.update(aliases)
        present = [a for a in aliases if a in by_fqn]
        if not present:
            plan.missing.update(aliases)
            continue
        # A tie is one tensor: fill it once, from its first FQN the source holds.
        first = present[0]
        key = by_fqn[first]
        spec = reader.spec(key)
        if _check_spec(plan, f"model {first!r}", key, spec, tuple(entry.shape), entry.dtype):
            plan.copies.append(_copy_of(key, targets[first], chunks.get(first)))
            plan.loaded.update(aliases)
    if options.strict and plan.missing:
        missing = sorted(plan.missing)
        plan.mismatch(
            f"{len(missing)} model FQN(s) are missing from the source: {listed(list(missing))}. "
            "Check strip_prefix/add_prefix, or pass strict=False to keep their values",
            "missing",
        )
    if options.strict and plan.unexpected:
        unexpected = sorted(plan.unexpected)
        plan.mismatch(
            f"{len(unexpected)} source key(s) match no model FQN (after strip_prefix="
            f"{options.strip_prefix!r}, add_prefix={options.add_prefix!r}): "
            f"{listed(list(unexpected))}. Pass strict=False to ignore them",
            "unexpected",
        )

    # Optimizers: by parameter FQN and state name.
    plan.optimizer_states = optimizer_states
    if optimizers:
        _plan_optimizers(plan, optimizer_states, reader, chunks, options.strict)
    return plan


def _plan_optimizers(
    plan: WeightsPlan,
    optimizer_states: list[dict[str, Any]],
    reader: WeightSource,
    chunks: Mapping[str, Any],
    strict: bool,
) -> None:
    """Match optimizer ``i``'s state (by parameter FQN and state name) and hyper-parameters
    (by param group and name) with the source's ``optimizer_states.<i>.`` entries."""
    group_fqns = [[list(g["params"]) for g in s["param_groups"]] for s in optimizer_states]
    available = reader.optimizer_count(group_fqns)
    plan.has_optimizer_state = available > 0
    if reader.optimizer_problems:  # structure does not line up: per-key reports would be noise
        for problem in reader.optimizer_problems:
            plan.mismatch(problem, "optimizers")
        return
    if available == 0:
        if strict:
            plan.mismatch(
                f"{len(optimizer_states)} optimizer(s) were given to fill, but the source holds "
                "no optimizer state. Load weights only (no optimizers), or pass strict=False",
                "optimizers",
            )
        return
    if available != len(optimizer_states):
        plan.mismatch(
            f"the source holds state for {available} optimizer(s), but {len(optimizer_states)} "
            "were given; configure the same optimizers as the run that saved it",
            "optimizers",
        )
        return
    for index, state in enumerate(optimizer_states):
        prefix = f"{OPTIMIZER_PREFIX}{index}."
        wanted: set[str] = set()
        missing: list[str] = []
        for fqn, entries in state["state"].items():
            for name, value in entries.items():
                key = f"{prefix}state.{fqn}.{name}"
                wanted.add(key)
                if not reader.has(key):
                    missing.append(f"{fqn}/{name}")
                elif not isinstance(value, torch.Tensor):
                    plan.values.append((key, entries, name))
                elif _check_spec(
                    plan,
                    f"optimizer {index} state {fqn!r} {name!r}",
                    key,
                    reader.spec(key),
                    tuple(value.shape),
                    value.dtype,
                ):
                    plan.copies.append(_copy_of(key, value, chunks.get(fqn)))
        extra = sorted(
            k[len(prefix) :]
            for k in reader.optimizer_keys(index)
            if k.startswith(f"{prefix}state.") and k not in wanted
        )
        for g, group in enumerate(state["param_groups"]):
            for name in group:
                key = f"{prefix}param_groups.{g}.{name}"
                if name == "params":
                    continue
                if reader.has(key):
                    plan.values.append((key, group, name))
                else:
                    missing.append(f"param_groups[{g}][{name!r}]")
        if strict and missing:
            plan.mismatch(
                f"optimizer {index}: {len(missing)} entr(y/ies) are missing from the source "
                f"(parameter/state, or hyper-parameter): {listed(list(missing))}. A different "
                "optimizer class or parameters that never stepped? Pass strict=False to keep "
                "those values",
                "missing",
            )
        if strict and extra:
            plan.mismatch(
                f"optimizer {index}: {len(extra)} source state entr(y/ies) match no parameter "
                f"of the optimizer: {listed(list(extra))}",
                "unexpected",
            )


# ---------------------------------------------------------------------- sources
