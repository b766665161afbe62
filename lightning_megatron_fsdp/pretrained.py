"""Fill a Megatron-FSDP sharded model from full (unsharded) weights, each rank its own rows.

Problem: pretrained weights, and checkpoints of other strategies, come as one full state
dict (a ``torch.save`` file, a Lightning ``.ckpt`` of a DDP or single-device run, a
``.safetensors`` file, our consolidated export) or as a DCP directory written at another
layout (Lightning's ``ModelParallelStrategy``/FSDP2, or ours at another world size or
mesh). A Megatron-FSDP parameter is a packed shard whose rows are *not* torch's canonical
``Shard(0)`` rows, so the usual tools put values in the wrong place: ``load_state_dict``
on the sharded module, and torch's ``set_model_state_dict(full_state_dict=True)`` (rank 0
reads everything, broadcasts it, every rank keeps its canonical slice).

How: every rank asks the layout which dim-0 rows of each parameter it owns
(:func:`~lightning_megatron_fsdp.chunk_metadata_by_fqn`, rank-local arithmetic) and reads
only those from the source, straight into its main-weight shard::

    full tensor P, 10 rows         rank 0 owns rows [0, 7)  -> shard.copy_(P[0:7])
    (one packed layout at 3 ranks) rank 1 owns rows [7, 10) -> shard.copy_(P[7:10])
                                   rank 2 owns no row of P  -> reads nothing of P

* ``torch.save`` files (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): ``torch.load(mmap=True,
  weights_only=True)`` maps the file; slicing rows touches only their pages. A Lightning
  checkpoint's model lives under ``"state_dict"``.
* ``.safetensors``: ``safe_open`` and ``get_slice(key)[start:stop]`` read only those bytes.
* DCP directories (``.metadata`` inside): ``dcp.load`` into the live sharded tensors with
  the chunk hooks of :mod:`~lightning_megatron_fsdp.uneven_dtensor` attached, so DCP
  plans reads of exactly this rank's chunks, whatever layout wrote them.

Buffers (unsharded, a full copy on every rank) are read whole. The compute weights are
then refreshed from the main weights (``group.sync_model_weight_from_main_weight()``).

Validation comes first: every rank compares the source's keys, shapes and dtypes with the
model (and optimizers) and the ranks exchange what they found, so a bad source raises the
same error on every rank, naming each missing, unexpected and mis-shaped FQN, before any
value is written. Floating-point values are cast to the target's dtype (bf16 pretrained
weights into fp32 main weights are exact); any other dtype difference is an error.

Optimizer state is loaded by parameter FQN where the source holds it: DCP directories
(ours: ``optimizer_states.<i>.``, Lightning's ``ModelParallelStrategy``:
``optimizer_<i>.``), consolidated exports with ``include_optimizer=True``, and Lightning
``.ckpt`` files, whose ``optimizer_states`` are keyed by parameter position (torch's
``Optimizer.state_dict``) and are matched to FQNs by the position of each parameter in
the live optimizer's parameter groups, checking every shape.

Alternatives rejected:
    * ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``
      (Lightning's ``ModelParallelStrategy`` path): the whole model in rank 0's memory, a
      broadcast of every tensor, and canonical ``Shard(0)`` slicing, wrong for packed
      shards.
    * Loading into the unsharded module before sharding: a full model on every rank,
      which meta-device initialisation exists to avoid.
    * Converting every source into our DCP format first: a second copy on disk and a
      conversion step the user must run; reading rows in place needs neither.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    _get_fqns,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_megatron_fsdp import _megatron, upstream_checkpoint
from lightning_megatron_fsdp.export import _checkpoints_inside
from lightning_megatron_fsdp.manifest import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    CheckpointError,
    CheckpointMismatchError,
    NotACheckpointError,
    check_files,
    read_manifest,
)
from lightning_megatron_fsdp.optimizer_state import ensure_optimizer_state
from lightning_megatron_fsdp.uneven_dtensor import (
    attach_uneven_dtensor_metadata,
    chunk_metadata_by_fqn,
)

__all__ = [
    "FullWeightsLoad",
    "PretrainedWeights",
    "apply_pretrained_weights",
    "as_pretrained_weights",
    "load_full_weights",
]

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_SAFETENSORS_SUFFIX = ".safetensors"
# Internal (and consolidated-export, and our DCP) key convention for optimizer entries:
# ``optimizer_states.<i>.state.<fqn>.<name>`` and ``optimizer_states.<i>.param_groups.<g>.<key>``.
_OPTIMIZER_PREFIX = "optimizer_states."
_LIGHTNING_MODEL_PREFIX = "state_dict."
_MAX_LISTED = 20
# Attribute set on a model once initial weights were applied, so a second Trainer run
# with the same model (fit, then test) does not overwrite trained weights.
_APPLIED_ATTR = "_lmf_pretrained_applied"

# safetensors dtype code -> torch dtype name. Codes torch has no dtype for (F6_*), or whose
# shape means something else in torch (F4: torch packs two values per element), are absent:
# a tensor of such a dtype is refused when, and only when, the model needs it.
_SAFETENSORS_DTYPE_NAMES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
}
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    code: getattr(torch, name)
    for code, name in _SAFETENSORS_DTYPE_NAMES.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
# Read by every safetensors release we support; others are probed before the first read.
_SAFETENSORS_BASIC = frozenset(
    ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
)

# Problem kinds, most fundamental first: every rank raises the class of the lowest kind.
_UNREADABLE, _MISMATCH = 0, 1
_ERRORS: tuple[type[CheckpointError], ...] = (CheckpointError, CheckpointMismatchError)


# ---------------------------------------------------------------------- public API


@dataclasses.dataclass(frozen=True)
class PretrainedWeights:
    """Where to read initial full weights from, and how to match their keys.

    The form of ``MegatronFSDPStrategy(init_weights_from=...)``; a plain path means
    ``PretrainedWeights(path)``.

    Args:
        path: A ``torch.save`` state dict (``.pt``/``.pth``/``.bin``), a Lightning
            ``.ckpt`` file, a ``.safetensors`` file, a consolidated export, or a DCP
            checkpoint directory (ours, or Lightning ``ModelParallelStrategy``'s).
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

    Raises:
        TypeError: If an option has the wrong type.
        ValueError: If ``path`` is empty.
    """

    path: str | os.PathLike[str]
    strict: bool = True
    strip_prefix: str = ""
    add_prefix: str = ""
    weights_only: bool = True

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


@dataclasses.dataclass(frozen=True)
class FullWeightsLoad:
    """What :func:`load_full_weights` loaded (identical on every rank).

    Attributes:
        source: The source path.
        kind: ``"torch"``, ``"safetensors"`` or ``"dcp"``.
        loaded: Model FQNs filled from the source (every FQN of a tied parameter).
        missing: Model FQNs the source does not hold (left as they were; only with
            ``strict=False``).
        unexpected: Source keys no model FQN matches (ignored; only with ``strict=False``).
        optimizers: Number of optimizers whose state was loaded.
    """

    source: Path
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
            safetensors, ``.pt``/``.pth``/``.bin``/``.ckpt`` files are ``torch.save``.
        optimizers: Optimizers over ``model``'s sharded parameters whose state to load
            too, by parameter FQN (``optimizer_states[i]`` / ``optimizer_<i>`` of the
            source for ``optimizers[i]``). Their state is created first if they never
            stepped. Hyper-parameters (``param_groups`` values) are loaded as well.
        strict: See :class:`PretrainedWeights`. With ``strict``, requesting optimizers
            from a source without optimizer state is an error too.
        strip_prefix: See :class:`PretrainedWeights`.
        add_prefix: See :class:`PretrainedWeights`.
        weights_only: See :class:`PretrainedWeights`.
        process_group: Ranks that load together; the default group when ``None``. Its
            timeout bounds every collective here.

    Returns:
        What was loaded, identical on every rank.

    Raises:
        CheckpointError: On every rank, if any rank cannot read the source (missing,
            unknown format, unreadable), naming the rank(s). Raised before any value is
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
    )
    if not _megatron.fsdp_modules(model):
        raise ValueError(
            f"load_full_weights: {type(model).__name__} is not sharded by Megatron-FSDP. "
            "Shard it first (shard_module or MegatronFSDPStrategy); for a plain module use "
            "model.load_state_dict(torch.load(path))."
        )
    optimizers = [getattr(o, "_optimizer", o) for o in optimizers]  # LightningOptimizer
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"load_full_weights: optimizers[{index}] must be a torch.optim.Optimizer, "
                f"got {type(optimizer).__name__}."
            )
    comm = _Comm(process_group)
    path = Path(os.path.abspath(os.fspath(source)))

    # Every rank, whatever it finds below: the step may run collective optimizer hooks.
    for optimizer in optimizers:
        ensure_optimizer_state(optimizer)

    # Phase 1 (rank-local, then agreed on): open the source and plan every copy.
    problems: list[tuple[int, str]] = []
    reader: _Source | None = None
    plan: _Plan | None = None
    try:
        reader = _open_source(path, weights_only)
        plan = _plan(model, optimizers, reader, options)
        problems = plan.problems
    except _SourceError as err:
        problems = [(_UNREADABLE, str(err))]
    except Exception as err:  # anything else must still reach the agreement below
        problems = [(_UNREADABLE, f"rank {comm.rank}: {type(err).__name__}: {err}")]
    try:
        comm.raise_together(path, problems, "Nothing was loaded; the model is unchanged.")
        assert reader is not None and plan is not None

        # Phase 2: each rank reads its rows; agree on the outcome.
        failure: list[tuple[int, str]] = []
        try:
            reader.execute(plan, comm)
        except _SourceError as err:
            failure = [(_UNREADABLE, str(err))]
        except Exception as err:
            failure = [(_UNREADABLE, f"rank {comm.rank}: {type(err).__name__}: {err}")]
        comm.raise_together(
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


class _SourceError(Exception):
    """This rank cannot read the source; turned into a :class:`CheckpointError` on all."""


class _Comm:
    """The ranks of one load: agree on problems so every rank raises the same error."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world_size = dist.get_world_size(group) if self.distributed else 1

    def raise_together(self, path: Path, problems: list[tuple[int, str]], aftermath: str) -> None:
        """All-gather every rank's problems; if any rank has one, raise it on every rank.

        Raises:
            CheckpointError | CheckpointMismatchError: The class of the most fundamental
                kind found, listing every problem and, where not every rank saw it, which.
        """
        gathered: list[Any] = [problems]
        if self.world_size > 1:
            gathered = [None] * self.world_size
            dist.all_gather_object(gathered, problems, group=self.group)
        ranks_by_problem: dict[tuple[int, str], list[int]] = {}
        for rank, rank_problems in enumerate(gathered):
            for problem in rank_problems:
                ranks_by_problem.setdefault(tuple(problem), []).append(rank)
        if not ranks_by_problem:
            return
        kind = min(k for k, _ in ranks_by_problem)
        lines = []
        for (_, text), ranks in sorted(ranks_by_problem.items()):
            where = "" if len(ranks) == self.world_size else f" [rank(s) {ranks}]"
            lines.append(f"  - {text}{where}")
        raise _ERRORS[kind](
            f"load_full_weights: cannot load {path} into the sharded model:\n"
            + "\n".join(lines)
            + f"\n{aftermath}"
        )


# ---------------------------------------------------------------------- targets and plan


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Global shape and dtype of a source tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class _Copy:
    """One tensor to fill: ``into`` (this rank's shard, or a whole tensor) from ``key``.

    ``rows`` is the owned dim-0 range ``[start, stop)`` of a sharded tensor in global
    coordinates, or ``None`` to copy the whole tensor. ``target`` is the state-dict entry
    (a DTensor with chunk hooks, or a plain tensor) DCP sources load into.
    """

    key: str
    into: torch.Tensor
    rows: tuple[int, int] | None
    target: Any

    def __post_init__(self) -> None:
        if self.rows is not None and self.rows[1] - self.rows[0] != self.into.shape[0]:
            raise AssertionError(
                f"{self.key}: owned rows {self.rows} do not match the shard's "
                f"{self.into.shape[0]} rows."
            )


@dataclasses.dataclass
class _Plan:
    """Everything phase 2 does, and what phase 1 found wrong."""

    copies: list[_Copy] = dataclasses.field(default_factory=list)
    # Non-tensor values (optimizer hyper-parameters): (source key, container, name), set
    # as ``container[name] = value``.
    values: list[tuple[str, dict[str, Any], str]] = dataclasses.field(default_factory=list)
    optimizer_states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    loaded: set[str] = dataclasses.field(default_factory=set)
    missing: set[str] = dataclasses.field(default_factory=set)
    unexpected: set[str] = dataclasses.field(default_factory=set)
    has_optimizer_state: bool = False
    problems: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    def mismatch(self, text: str) -> None:
        self.problems.append((_MISMATCH, text))


def _listed(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_LISTED])
    more = len(keys) - _MAX_LISTED
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def _tie_groups(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Map every FQN of a tied parameter to all its FQNs (state-dict naming, in order)."""
    names_by_param: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names_by_param.setdefault(id(parameter), []).append(name)
    groups: dict[str, tuple[str, ...]] = {}
    for names in names_by_param.values():
        fqns = tuple(fqn for name in names for fqn in sorted(_get_fqns(model, name)))
        if len(fqns) > 1:
            for fqn in fqns:
                groups[fqn] = fqns
    return groups


def _check_spec(
    plan: _Plan, what: str, key: str, have: _Spec, shape: tuple[int, ...], dtype: torch.dtype
) -> bool:
    """Record a problem unless a source tensor ``have`` can fill a target; return OK."""
    ok = True
    if have.shape != shape:
        plan.mismatch(f"{what}: shape {have.shape} in the source ({key!r}), {shape} in the target")
        ok = False
    if have.dtype != dtype and not (have.dtype.is_floating_point and dtype.is_floating_point):
        plan.mismatch(
            f"{what}: dtype {have.dtype} in the source ({key!r}), {dtype} in the target; only "
            "floating-point values are cast"
        )
        ok = False
    return ok


def _copy_of(key: str, entry: torch.Tensor, chunk: Any) -> _Copy:
    if isinstance(entry, DTensor):
        start = int(chunk.offsets[0])
        return _Copy(key, entry._local_tensor, (start, start + int(chunk.sizes[0])), entry)
    return _Copy(key, entry, None, entry)


def _plan(
    model: nn.Module, optimizers: Sequence[Optimizer], reader: _Source, options: PretrainedWeights
) -> _Plan:
    """Match the source against the model (and optimizers) and list every copy."""
    plan = _Plan()
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
            f"{len(missing)} model FQN(s) are missing from the source: {_listed(missing)}. "
            "Check strip_prefix/add_prefix, or pass strict=False to keep their values"
        )
    if options.strict and plan.unexpected:
        unexpected = sorted(plan.unexpected)
        plan.mismatch(
            f"{len(unexpected)} source key(s) match no model FQN (after strip_prefix="
            f"{options.strip_prefix!r}, add_prefix={options.add_prefix!r}): "
            f"{_listed(unexpected)}. Pass strict=False to ignore them"
        )

    # Optimizers: by parameter FQN and state name.
    plan.optimizer_states = optimizer_states
    if optimizers:
        _plan_optimizers(plan, optimizer_states, reader, chunks, options.strict)
    return plan


def _plan_optimizers(
    plan: _Plan,
    optimizer_states: list[dict[str, Any]],
    reader: _Source,
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
            plan.mismatch(problem)
        return
    if available == 0:
        if strict:
            plan.mismatch(
                f"{len(optimizer_states)} optimizer(s) were given to fill, but the source holds "
                "no optimizer state. Load weights only (no optimizers), or pass strict=False"
            )
        return
    if available != len(optimizer_states):
        plan.mismatch(
            f"the source holds state for {available} optimizer(s), but {len(optimizer_states)} "
            "were given; configure the same optimizers as the run that saved it"
        )
        return
    for index, state in enumerate(optimizer_states):
        prefix = f"{_OPTIMIZER_PREFIX}{index}."
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
                f"(parameter/state, or hyper-parameter): {_listed(missing)}. A different "
                "optimizer class or parameters that never stepped? Pass strict=False to keep "
                "those values"
            )
        if strict and extra:
            plan.mismatch(
                f"optimizer {index}: {len(extra)} source state entr(y/ies) match no parameter "
                f"of the optimizer: {_listed(extra)}"
            )


def _like(current: Any, loaded: Any) -> Any:
    """``loaded``, as a tuple where the live value is one (JSON turns ``betas`` into a list)."""
    if isinstance(current, tuple) and isinstance(loaded, list):
        return tuple(loaded)
    return loaded


# ---------------------------------------------------------------------- sources


class _Source(abc.ABC):
    """A readable source of full tensors under internal keys (see ``_OPTIMIZER_PREFIX``).

    Phase 1 asks only for keys, shapes and dtypes (:meth:`spec`, :meth:`has`); phase 2
    (:meth:`execute`) reads. Flat files read rows rank-locally; DCP reads collectively.
    """

    kind = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.model_keys: list[str] = []
        # Filled by optimizer_count: optimizer entries that cannot be matched to FQNs.
        self.optimizer_problems: list[str] = []

    @abc.abstractmethod
    def spec(self, key: str) -> _Spec:
        """Global shape and dtype of tensor ``key``."""

    @abc.abstractmethod
    def has(self, key: str) -> bool:
        """Whether the source holds entry ``key`` (tensor or not)."""

    @abc.abstractmethod
    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        """Number of optimizers with state in the source (keys prepared for them)."""

    @abc.abstractmethod
    def optimizer_keys(self, index: int) -> list[str]:
        """Every key of optimizer ``index`` in the source."""

    @abc.abstractmethod
    def execute(self, plan: _Plan, comm: _Comm) -> None:
        """Fill every copy of ``plan`` and its hyper-parameters; rank-local failures raise."""

    def close(self) -> None:  # noqa: B027 - optional: DCP sources hold nothing open
        """Release file handles and mappings."""


class _FlatSource(_Source):
    """A source whose tensors are read by rows, rank-locally: torch.save and safetensors."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._optimizer_keys: dict[int, list[str]] = {}

    @abc.abstractmethod
    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Dim-0 rows ``[start, stop)`` of tensor ``key``."""

    @abc.abstractmethod
    def whole(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``."""

    @abc.abstractmethod
    def value(self, key: str) -> Any:
        """The non-tensor value ``key``."""

    def optimizer_keys(self, index: int) -> list[str]:
        return self._optimizer_keys.get(index, [])

    def _index_optimizer_keys(self, keys: Iterator[str]) -> int:
        for key in keys:
            index, _, _ = key[len(_OPTIMIZER_PREFIX) :].partition(".")
            if index.isdigit():
                self._optimizer_keys.setdefault(int(index), []).append(key)
        return len(self._optimizer_keys)

    def execute(self, plan: _Plan, comm: _Comm) -> None:
        try:
            with torch.no_grad():
                for copy in plan.copies:
                    if copy.rows is None:
                        copy.into.copy_(self.whole(copy.key))
                    elif copy.rows[1] > copy.rows[0]:
                        copy.into.copy_(self.rows(copy.key, *copy.rows))
            for key, container, name in plan.values:
                container[name] = _like(container[name], self.value(key))
        except Exception as err:
            raise _SourceError(
                f"reading {self.path} failed on rank {comm.rank}: {type(err).__name__}: {err}"
            ) from err


class _TorchSource(_FlatSource):
    """A ``torch.save`` file, memory-mapped: a state dict, a Lightning ``.ckpt``, or our export.

    A Lightning checkpoint (a dict with a ``"state_dict"`` mapping) keeps its model there
    and its optimizers as a list under ``"optimizer_states"``, keyed by parameter position;
    a flat dict is a plain state dict or a consolidated export, whose optimizer entries
    are already flat ``optimizer_states.<i>.`` keys.
    """

    kind = "torch"

    def __init__(self, path: Path, weights_only: bool) -> None:
        super().__init__(path)
        try:
            loaded = torch.load(path, mmap=True, weights_only=weights_only, map_location="cpu")
        except Exception as err:
            hint = (
                " If the file holds objects the weights-only unpickler refuses and you trust "
                "it, pass weights_only=False."
                if weights_only
                else ""
            )
            raise _SourceError(
                f"{path}: torch.load(mmap=True, weights_only={weights_only}) failed: "
                f"{type(err).__name__}: {str(err).rstrip('.')}.{hint} Files written with the "
                "legacy (non-zip) torch.save format cannot be memory-mapped: re-save them with "
                "torch.save."
            ) from err
        if not isinstance(loaded, Mapping):
            raise _SourceError(
                f"{path}: expected a state dict (a mapping of names to tensors) or a Lightning "
                f"checkpoint, got a {type(loaded).__name__}."
            )
        self._lightning_optimizers: list[Any] | None = None
        if isinstance(loaded.get("state_dict"), Mapping):
            self._flat: dict[str, Any] = dict(loaded["state_dict"])
            optimizer_states = loaded.get("optimizer_states")
            if isinstance(optimizer_states, list) and optimizer_states:
                self._lightning_optimizers = optimizer_states
        else:
            self._flat = dict(loaded)
        self.model_keys = [
            k
            for k, v in self._flat.items()
            if isinstance(v, torch.Tensor) and not k.startswith(_OPTIMIZER_PREFIX)
        ]

    def spec(self, key: str) -> _Spec:
        tensor = self._flat[key]
        return _Spec(tuple(tensor.shape), tensor.dtype)

    def has(self, key: str) -> bool:
        return key in self._flat

    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        if self._lightning_optimizers is not None:
            for index, state in enumerate(self._lightning_optimizers):
                if index < len(group_fqns):
                    self._flatten_positional(index, state, group_fqns[index])
        keys = (k for k in self._flat if k.startswith(_OPTIMIZER_PREFIX))
        count = self._index_optimizer_keys(keys)
        if self._lightning_optimizers is not None:
            return len(self._lightning_optimizers)
        return count

    def _flatten_positional(self, index: int, state: Any, group_fqns: list[list[str]]) -> None:
        """Re-key torch ``Optimizer.state_dict()`` (by position) to flat FQN keys.

        Saved parameter groups that do not line up with the live ones are recorded in
        :attr:`optimizer_problems`: position is all that links them to FQNs.
        """
        prefix = f"{_OPTIMIZER_PREFIX}{index}."
        groups = state.get("param_groups") if isinstance(state, Mapping) else None
        entries = state.get("state") if isinstance(state, Mapping) else None
        if not isinstance(groups, list) or not isinstance(entries, Mapping):
            self.optimizer_problems.append(
                f"optimizer_states[{index}] of the source is not a torch optimizer state dict "
                "({'state': ..., 'param_groups': [...]})"
            )
            return
        sizes = [len(g.get("params", ())) for g in groups]
        wanted = [len(fqns) for fqns in group_fqns]
        if sizes != wanted:
            self.optimizer_problems.append(
                f"optimizer {index}: the source's param groups hold {sizes} parameters, the "
                f"live optimizer's {wanted}. State saved by position (torch's "
                "Optimizer.state_dict) matches only the same optimizer over the same "
                "parameters: keep configure_optimizers unchanged"
            )
            return
        for g, (group, fqns) in enumerate(zip(groups, group_fqns, strict=True)):
            for position, fqn in zip(group["params"], fqns, strict=True):
                for name, value in entries.get(position, {}).items():
                    self._flat[f"{prefix}state.{fqn}.{name}"] = value
            for name, value in group.items():
                if name != "params":
                    self._flat[f"{prefix}param_groups.{g}.{name}"] = value

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self._flat[key][start:stop]

    def whole(self, key: str) -> torch.Tensor:
        return self._flat[key]

    def value(self, key: str) -> Any:
        return self._flat[key]

    def close(self) -> None:
        self._flat = {}
        self._lightning_optimizers = None


class _SafetensorsSource(_FlatSource):
    """A ``.safetensors`` file: ``get_slice`` reads only the requested rows' bytes.

    Non-tensor entries of a consolidated export (optimizer ``param_groups`` values) are
    JSON strings in the header's ``__metadata__``.
    """

    kind = "safetensors"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        try:
            from safetensors import safe_open
        except ImportError as err:
            raise _SourceError(
                f"{path}: reading .safetensors needs the safetensors package: pip install "
                "'lightning-megatron-fsdp[export]' (or safetensors)."
            ) from err
        try:
            self._file = safe_open(os.fspath(path), framework="pt", device="cpu")
            self._keys = set(self._file.keys())
            self._metadata = self._file.metadata() or {}
        except Exception as err:
            raise _SourceError(
                f"{path}: not a readable safetensors file: {type(err).__name__}: {err}."
            ) from err
        # Only the header is read here; a dtype is judged when a key is needed (spec()),
        # so a tensor the model does not load never stops the load.
        self._codes = {key: self._file.get_slice(key).get_dtype() for key in self._keys}
        self._specs: dict[str, _Spec] = {}
        self.model_keys = [k for k in self._keys if not k.startswith(_OPTIMIZER_PREFIX)]

    def spec(self, key: str) -> _Spec:
        """Shape and dtype of ``key``, which the load needs.

        Raises:
            _SourceError: If torch has no dtype for its safetensors dtype, or the
                installed safetensors cannot read it (checked on an empty slice).
        """
        if key in self._specs:
            return self._specs[key]
        code = self._codes[key]
        piece = self._file.get_slice(key)
        dtype = _SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise _SourceError(
                f"{self.path}: tensor {key!r} has safetensors dtype {code}, which this loader "
                f"cannot read into torch {torch.__version__} (readable: "
                f"{', '.join(sorted(_SAFETENSORS_DTYPES))}); the model needs it. Convert "
                "that tensor to a supported dtype, or load into a model without it."
            )
        shape = tuple(piece.get_shape())
        if code not in _SAFETENSORS_BASIC:
            try:
                probe = piece[:0] if shape else self._file.get_tensor(key)
            except Exception as err:  # the Rust extension raises its own error types
                probe, failure = None, f"{type(err).__name__}: {err}"
            else:
                failure = None if probe.dtype == dtype else f"it reads as {probe.dtype}"
            if failure is not None:
                raise _SourceError(
                    f"{self.path}: tensor {key!r} has safetensors dtype {code}, which the "
                    f"installed safetensors cannot read as {dtype} ({failure}); the model "
                    "needs it. Upgrade safetensors (pip install -U safetensors)."
                )
        self._specs[key] = _Spec(shape, dtype)
        return self._specs[key]

    def has(self, key: str) -> bool:
        return key in self._keys or key in self._metadata

    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        keys = [k for k in (*self._keys, *self._metadata) if k.startswith(_OPTIMIZER_PREFIX)]
        return self._index_optimizer_keys(iter(keys))

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self._file.get_slice(key)[start:stop]

    def whole(self, key: str) -> torch.Tensor:
        return self._file.get_tensor(key)

    def value(self, key: str) -> Any:
        return json.loads(self._metadata[key])

    def close(self) -> None:
        self._file = None


class _DcpSource(_Source):
    """A DCP directory: ours (``state_dict.``/``optimizer_states.<i>.`` keys), Lightning
    ``ModelParallelStrategy``'s (``state_dict.``/``optimizer_<i>.``), megatron-fsdp's own
    ``save_checkpoint`` (``model.``/``optimizer.``, see
    :mod:`~lightning_megatron_fsdp.upstream_checkpoint`), or a plain ``dcp.save`` of a
    model state dict (FQN keys).

    Reads go through one ``dcp.load`` (a collective) into the live sharded tensors, whose
    chunk hooks make DCP read only this rank's rows, wherever the writer put them. A
    directory of ours must be complete: its manifest parses and every file has its
    recorded size (``lightning-megatron-fsdp verify`` also checks the sha256 digests).
    """

    kind = "dcp"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if (path / MANIFEST_FILE).exists():
            try:
                damaged = check_files(path, read_manifest(path))
            except (NotACheckpointError, OSError) as err:
                raise _SourceError(str(err)) from err
            if damaged:
                raise _SourceError(
                    f"{path} is an incomplete or damaged checkpoint: {'; '.join(damaged)}. Use "
                    "another checkpoint."
                )
        try:
            metadata = FileSystemReader(os.fspath(path)).read_metadata()
        except Exception as err:
            raise _SourceError(
                f"{path}: cannot read the DCP metadata ({DCP_METADATA_FILE}): "
                f"{type(err).__name__}: {err}."
            ) from err
        saved = metadata.state_dict_metadata
        # Internal key -> DCP key.
        self._dcp_key: dict[str, str] = {}
        lightning = any(k.startswith(_LIGHTNING_MODEL_PREFIX) for k in saved)
        model_prefix = _LIGHTNING_MODEL_PREFIX if lightning else ""
        for key in saved:
            internal = _dcp_optimizer_key(key)
            if internal is not None:
                self._dcp_key[internal] = key
            elif key.startswith(model_prefix):
                self._dcp_key[key[len(model_prefix) :]] = key
        if upstream_checkpoint.is_upstream_checkpoint(metadata):  # megatron-fsdp's own format
            self._dcp_key = upstream_checkpoint.internal_keys(metadata)
        self._specs: dict[str, _Spec] = {}
        for internal, key in self._dcp_key.items():
            entry = saved[key]
            if isinstance(entry, TensorStorageMetadata):
                self._specs[internal] = _Spec(tuple(entry.size), entry.properties.dtype)
        self.model_keys = [
            k for k in self._dcp_key if not k.startswith(_OPTIMIZER_PREFIX) and k in self._specs
        ]
        self._optimizer_indices = sorted(
            {
                int(k[len(_OPTIMIZER_PREFIX) :].partition(".")[0])
                for k in self._dcp_key
                if k.startswith(_OPTIMIZER_PREFIX)
            }
        )

    def spec(self, key: str) -> _Spec:
        spec = self._specs.get(key)
        if spec is None:
            raise _SourceError(f"{self.path}: entry {self._dcp_key[key]!r} is not a tensor.")
        return spec

    def has(self, key: str) -> bool:
        return key in self._dcp_key

    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        return len(self._optimizer_indices)

    def optimizer_keys(self, index: int) -> list[str]:
        prefix = f"{_OPTIMIZER_PREFIX}{index}."
        return [k for k in self._dcp_key if k.startswith(prefix)]

    def execute(self, plan: _Plan, comm: _Comm) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        targets: dict[str, Any] = {self._dcp_key[c.key]: c.target for c in plan.copies}
        for key, container, name in plan.values:
            targets[self._dcp_key[key]] = container[name]
        try:
            dcp.load(
                targets,
                storage_reader=FileSystemReader(os.fspath(self.path)),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                process_group=comm.group,
            )
        except CheckpointException as err:
            # DCP raises this on every rank, listing each failing rank's error.
            raise _SourceError(f"DCP failed reading {self.path}: {err}") from err
        for key, container, name in plan.values:
            container[name] = _like(container[name], targets[self._dcp_key[key]])


def _dcp_optimizer_key(key: str) -> str | None:
    """Internal key of a DCP optimizer entry (ours or Lightning's), else ``None``."""
    if key.startswith(_OPTIMIZER_PREFIX):
        return key
    head, dot, rest = key.partition(".")
    if dot and head.startswith("optimizer_") and head[len("optimizer_") :].isdigit():
        return f"{_OPTIMIZER_PREFIX}{head[len('optimizer_') :]}.{rest}"
    return None


def _open_source(path: Path, weights_only: bool) -> _Source:
    """Open ``path`` by what it is.

    Raises:
        _SourceError: If it does not exist or is no supported format.
    """
    if path.is_dir():
        if not (path / DCP_METADATA_FILE).is_file():
            inside = _checkpoints_inside(path)
            hint = (
                f"It holds checkpoint directories {inside[:5]}: pass one of them, e.g. "
                f"{path / inside[-1]}."
                if inside
                else "Expected a DCP checkpoint directory, or a .pt/.pth/.bin/.ckpt/"
                ".safetensors file."
            )
            raise _SourceError(
                f"{path} is a directory without {DCP_METADATA_FILE}: not a DCP checkpoint. " + hint
            )
        return _DcpSource(path)
    if not path.is_file():
        raise _SourceError(f"{path} does not exist (or is not a regular file or directory).")
    if path.suffix == _SAFETENSORS_SUFFIX:
        return _SafetensorsSource(path)
    if path.suffix in _TORCH_SUFFIXES:
        return _TorchSource(path, weights_only)
    raise _SourceError(
        f"{path}: unsupported suffix {path.suffix!r}. Expected a torch.save file "
        f"({', '.join(_TORCH_SUFFIXES)}), {_SAFETENSORS_SUFFIX}, or a DCP checkpoint directory."
    )
