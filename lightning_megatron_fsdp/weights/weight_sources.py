"""Where full weights come from (``torch.save`` files and Lightning ``.ckpt``, safetensors, DCP
directories: ours, FSDP2's, megatron-fsdp's), on a local disk or on an object store (a URL),
behind one small interface, :class:`WeightSource`, that reads each rank's planned rows into
its targets; the ranks agree on problems so a bad source raises the same error on every rank.

One reader per format, whatever holds the file: a file's layout comes from its header
(safetensors) or from unpickling it without its data (``torch.load(map_location="meta")``
places every storage in the file), and each rank reads the byte ranges of its own rows
through the location's :meth:`~lightning_megatron_fsdp.storage.Location.ranges` (a local
file is memory-mapped, an object fetched with ranged GETs, nothing downloaded whole); a DCP
checkpoint is read through the location's verifying reader from the version a load takes,
each rank reading the records that hold its rows.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import struct
import sys
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron_fsdp import _torch
from lightning_megatron_fsdp.agreement import Problem, Ranks
from lightning_megatron_fsdp.errors import (
    CheckpointError,
    CheckpointMismatchError,
    NotACheckpointError,
)
from lightning_megatron_fsdp.megatron import dcp_view, keep_loaded_values
from lightning_megatron_fsdp.storage import (
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    MODEL_PREFIX,
    OPTIMIZER_PREFIX,
    Location,
    VerifyingFileSystemReader,
    internal_keys,
    is_upstream_checkpoint,
    locate,
)

__all__ = [
    "SourceError",
    "SourceTensorSpec",
    "TensorCopy",
    "WeightSource",
    "WeightsPlan",
    "agree_on_problems",
    "open_source",
]

_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


_SAFETENSORS_SUFFIX = ".safetensors"


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


# Most fundamental first: a rank that cannot read the source (``CheckpointError``)
# outranks one whose tensors do not match the model.
_PRECEDENCE: tuple[type[CheckpointError], ...] = (CheckpointError, CheckpointMismatchError)


class SourceError(Exception):
    """This rank cannot read the source; turned into a :class:`CheckpointError` on all."""


def agree_on_problems(
    ranks: Ranks, path: Path | str, problems: list[Problem], aftermath: str
) -> None:
    """All-gather every rank's problems; if any rank has one, raise it on every rank
    (:meth:`~lightning_megatron_fsdp.agreement.Ranks.agree`).

    Raises:
        CheckpointError | CheckpointMismatchError: The most fundamental class found,
            listing every problem and, where not every rank saw it, which.
    """
    ranks.agree(
        problems,
        heading=f"load_full_weights: cannot load {path} into the sharded model",
        lost_peer_error=CheckpointError,
        precedence=_PRECEDENCE,
        advice=aftermath,
    )


def unreadable(text: str) -> Problem:
    """A rank cannot read the source: :class:`CheckpointError` on every rank."""
    return Problem(CheckpointError, text, "unreadable")


@dataclasses.dataclass(frozen=True)
class SourceTensorSpec:
    """Global shape and dtype of a source tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class TensorCopy:
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
class WeightsPlan:
    """Everything phase 2 does, and what phase 1 found wrong."""

    copies: list[TensorCopy] = dataclasses.field(default_factory=list)
    # Non-tensor values (optimizer hyper-parameters): (source key, container, name), set
    # as ``container[name] = value``.
    values: list[tuple[str, dict[str, Any], str]] = dataclasses.field(default_factory=list)
    optimizer_states: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    loaded: set[str] = dataclasses.field(default_factory=set)
    missing: set[str] = dataclasses.field(default_factory=set)
    unexpected: set[str] = dataclasses.field(default_factory=set)
    has_optimizer_state: bool = False
    problems: list[Problem] = dataclasses.field(default_factory=list)

    def mismatch(self, text: str, category: str = "other") -> None:
        """Record that the source does not match the model (``category``: the summary's
        count, e.g. ``"shape"``, ``"missing"``)."""
        self.problems.append(Problem(CheckpointMismatchError, text, category))


def _like(current: Any, loaded: Any) -> Any:
    """``loaded``, as a tuple where the live value is one (JSON turns ``betas`` into a list)."""
    if isinstance(current, tuple) and isinstance(loaded, list):
        return tuple(loaded)
    return loaded


class WeightSource(abc.ABC):
    """A readable source of full tensors under internal keys (see ``OPTIMIZER_PREFIX``).

    Phase 1 asks only for keys, shapes and dtypes (:meth:`spec`, :meth:`has`); phase 2
    (:meth:`execute`) reads. Flat files read rows rank-locally; DCP reads collectively.
    """

    kind = ""

    def __init__(self, path: str) -> None:
        self.path = path
        self.model_keys: list[str] = []
        # Filled by optimizer_count: optimizer entries that cannot be matched to FQNs.
        self.optimizer_problems: list[str] = []

    @abc.abstractmethod
    def spec(self, key: str) -> SourceTensorSpec:
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
    def execute(self, plan: WeightsPlan, comm: Ranks) -> None:
        """Fill every copy of ``plan`` and its hyper-parameters; rank-local failures raise."""

    def close(self) -> None:  # noqa: B027 - optional: DCP sources hold nothing open
        """Release file handles and mappings."""


class _FlatSource(WeightSource):
    """A source whose tensors are read by rows, rank-locally: torch.save and safetensors."""

    def __init__(self, path: str) -> None:
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
            index, _, _ = key[len(OPTIMIZER_PREFIX) :].partition(".")
            if index.isdigit():
                self._optimizer_keys.setdefault(int(index), []).append(key)
        return len(self._optimizer_keys)

    def execute(self, plan: WeightsPlan, comm: Ranks) -> None:
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
            raise SourceError(
                f"reading {self.path} failed on rank {comm.rank}: {type(err).__name__}: {err}"
            ) from err


class _TorchSource(_FlatSource):
    """A ``torch.save`` file: a state dict, a Lightning ``.ckpt``, or our export.

    It is unpickled without its data (``map_location="meta"``: on a store a few ranged GETs
    for the pickle and the zip directory), which gives every tensor's storage and its offset
    in the file; a read then takes exactly the bytes the asked-for rows span from the
    location's :meth:`~lightning_megatron_fsdp.storage.Location.ranges` (a local file is
    memory-mapped, an object read with ranged GETs).

    A Lightning checkpoint (a dict with a ``"state_dict"`` mapping) keeps its model there
    and its optimizers as a list under ``"optimizer_states"``, keyed by parameter position;
    a flat dict is a plain state dict or a consolidated export, whose optimizer entries
    are already flat ``optimizer_states.<i>.`` keys.
    """

    kind = "torch"

    def __init__(self, location: Location, weights_only: bool) -> None:
        super().__init__(str(location))
        loaded = self._load(location, weights_only)
        if not isinstance(loaded, Mapping):
            raise SourceError(
                f"{self.path}: expected a state dict (a mapping of names to tensors) or a "
                f"Lightning checkpoint, got a {type(loaded).__name__}."
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
            if isinstance(v, torch.Tensor) and not k.startswith(OPTIMIZER_PREFIX)
        ]
        self._bytes = location.ranges()

    def _load(self, location: Location, weights_only: bool) -> Any:
        """The file's object, every tensor a meta view of its storage."""
        try:
            with location.open(block_size=1 << 20) as stream:
                if not zipfile.is_zipfile(stream):
                    raise SourceError(
                        f"{self.path}: not a zip archive: a file written with the legacy "
                        "(non-zip) torch.save format cannot be read in place. Load it with "
                        "torch.load and re-save it with torch.save."
                    )
                stream.seek(0)
                names = zipfile.ZipFile(stream).namelist()
                orders = [n for n in names if n.count("/") == 1 and n.endswith("/byteorder")]
                if orders:
                    with zipfile.ZipFile(stream).open(orders[0]) as record:
                        order = record.read().decode(errors="replace")
                    if order != sys.byteorder:
                        raise SourceError(
                            f"{self.path} was saved on a {order}-endian machine; this one is "
                            f"{sys.byteorder}-endian. Load it with torch.load and re-save it."
                        )
                stream.seek(0)
                return torch.load(stream, map_location="meta", weights_only=weights_only)
        except SourceError:
            raise
        except FileNotFoundError as err:
            raise SourceError(f"{self.path} does not exist.") from err
        except Exception as err:
            raise SourceError(
                f"{self.path}: torch.load(map_location='meta', weights_only={weights_only}) "
                f"failed: {type(err).__name__}: {str(err).rstrip('.')}."
                f"{_unpickling_hint(weights_only)}"
            ) from err

    def spec(self, key: str) -> SourceTensorSpec:
        tensor = self._flat[key]
        return SourceTensorSpec(tuple(tensor.shape), tensor.dtype)

    def has(self, key: str) -> bool:
        return key in self._flat

    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        if self._lightning_optimizers is not None:
            for index, state in enumerate(self._lightning_optimizers):
                if index < len(group_fqns):
                    self._flatten_positional(index, state, group_fqns[index])
        keys = (k for k in self._flat if k.startswith(OPTIMIZER_PREFIX))
        count = self._index_optimizer_keys(keys)
        if self._lightning_optimizers is not None:
            return len(self._lightning_optimizers)
        return count

    def _flatten_positional(self, index: int, state: Any, group_fqns: list[list[str]]) -> None:
        """Re-key torch ``Optimizer.state_dict()`` (by position) to flat FQN keys.

        Saved parameter groups that do not line up with the live ones are recorded in
        :attr:`optimizer_problems`: position is all that links them to FQNs.
        """
        prefix = f"{OPTIMIZER_PREFIX}{index}."
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

    def _fetch(self, tensor: Any) -> Any:
        """A tensor of the file (a meta view of its storage) with its bytes read."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return tensor
        if tensor.numel() == 0:
            return torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
        base = _torch.checkpoint_offset(tensor)
        size = tensor.element_size()
        first = tensor.storage_offset()
        span = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
        if base is None or (first + span) * size > tensor.untyped_storage().nbytes():
            raise SourceError(
                f"{self.path}: torch.load did not place a tensor's bytes in the file "
                f"(offset {base}); torch's serialization changed in a way this reader does "
                "not support. Load it with torch.load and re-save it as .safetensors."
            )
        data = self._bytes.read(base + first * size, base + (first + span) * size)
        flat = torch.frombuffer(data, dtype=torch.uint8).view(tensor.dtype)
        return flat.as_strided(tuple(tensor.shape), tuple(tensor.stride()))

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self._fetch(self._flat[key][start:stop])

    def whole(self, key: str) -> torch.Tensor:
        return self._fetch(self._flat[key])

    def value(self, key: str) -> Any:
        return self._fetch(self._flat[key])

    def close(self) -> None:
        self._flat = {}
        self._lightning_optimizers = None
        self._bytes.close()


class _SafetensorsSource(_FlatSource):
    """A ``.safetensors`` file: its header is read (on a store two ranged GETs), then each
    read takes the bytes of the asked-for rows (tensors are row-major and contiguous) from
    the location's :meth:`~lightning_megatron_fsdp.storage.Location.ranges`. The
    safetensors package is not needed.

    Non-tensor entries of a consolidated export (optimizer ``param_groups`` values) are
    JSON strings in the header's ``__metadata__``.
    """

    kind = "safetensors"

    def __init__(self, location: Location) -> None:
        url = str(location)
        super().__init__(url)
        try:
            self._bytes = location.ranges()
        except FileNotFoundError as err:
            raise SourceError(f"{url} does not exist.") from err
        size = self._bytes.size
        if size < 8:
            raise SourceError(f"{url}: {size} bytes, not a safetensors file.")
        (length,) = struct.unpack("<Q", self._bytes.read(0, 8))
        if length > min(size - 8, _HEADER_LIMIT):
            raise SourceError(
                f"{url}: not a readable safetensors file (a header of {length} bytes in a "
                f"{size}-byte file)."
            )
        try:
            header = json.loads(bytes(self._bytes.read(8, 8 + length)))
            self._metadata: dict[str, str] = dict(header.pop("__metadata__", None) or {})
            self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
            for key, entry in header.items():
                begin, end = (int(v) for v in entry["data_offsets"])
                shape = tuple(int(n) for n in entry["shape"])
                self._entries[key] = (str(entry["dtype"]), shape, begin, end)
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise SourceError(
                f"{url}: not a readable safetensors file (its header does not parse: "
                f"{type(err).__name__}: {err})."
            ) from err
        self._data = 8 + length
        self._size = size
        self.model_keys = [k for k in self._entries if not k.startswith(OPTIMIZER_PREFIX)]

    def has(self, key: str) -> bool:
        return key in self._entries or key in self._metadata

    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        keys = [k for k in (*self._entries, *self._metadata) if k.startswith(OPTIMIZER_PREFIX)]
        return self._index_optimizer_keys(iter(keys))

    def value(self, key: str) -> Any:
        return json.loads(self._metadata[key])

    def spec(self, key: str) -> SourceTensorSpec:
        """Shape and dtype of ``key``, which the load needs; a dtype is judged only here,
        so a tensor the model does not load never stops the load.

        Raises:
            SourceError: If torch has no dtype for its safetensors dtype, or its bytes do
                not fit its shape or the file.
        """
        code, shape, begin, end = self._entries[key]
        dtype = _SAFETENSORS_DTYPES.get(code)
        if dtype is None:
            raise SourceError(
                f"{self.path}: tensor {key!r} has safetensors dtype {code}, which this loader "
                f"cannot read into torch {torch.__version__} (readable: "
                f"{', '.join(sorted(_SAFETENSORS_DTYPES))}); the model needs it. Convert "
                "that tensor to a supported dtype, or load into a model without it."
            )
        if end - begin != math.prod(shape) * dtype.itemsize or self._data + end > self._size:
            raise SourceError(
                f"{self.path}: tensor {key!r} spans bytes [{begin}, {end}) of the data, which "
                f"does not match its shape {shape} and dtype {code} or lies past the end of "
                "the file; the file is damaged."
            )
        return SourceTensorSpec(shape, dtype)

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        spec = self.spec(key)
        row = math.prod(spec.shape[1:]) * spec.dtype.itemsize
        at = self._data + self._entries[key][2]
        data = self._bytes.read(at + start * row, at + stop * row)
        return _tensor_from(data, spec.dtype, (stop - start, *spec.shape[1:]))

    def whole(self, key: str) -> torch.Tensor:
        spec = self.spec(key)
        _, _, begin, end = self._entries[key]
        data = self._bytes.read(self._data + begin, self._data + end)
        return _tensor_from(data, spec.dtype, spec.shape)

    def close(self) -> None:
        self._bytes.close()


class _DcpSource(WeightSource):
    """A DCP directory: ours (``state_dict.``/``optimizer_states.<i>.`` keys), Lightning
    ``ModelParallelStrategy``'s (``state_dict.``/``optimizer_<i>.``), megatron-fsdp's own
    ``save_checkpoint`` (``model.``/``optimizer.``, see
    :mod:`~lightning_megatron_fsdp.storage.upstream_checkpoint`), or a plain ``dcp.save`` of a
    model state dict (FQN keys).

    Reads go through one ``dcp.load`` (a collective) into the live sharded tensors, whose
    chunk hooks make DCP read only this rank's rows, wherever the writer put them. A
    directory of ours must be complete: its manifest parses and every file has its
    recorded size (``lightning-megatron-fsdp verify`` also checks the checksums).
    """

    kind = "dcp"

    def __init__(self, location: Location, weights_only: bool = True) -> None:
        super().__init__(str(location))
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.location = location
        path = self.path

        self._trust = not weights_only
        self._check_complete()
        try:
            metadata = self._reader().read_metadata()
        except Exception as err:
            raise SourceError(
                f"{path}: cannot read the DCP metadata ({DCP_METADATA_FILE}): "
                f"{type(err).__name__}: {err}."
            ) from err
        saved = metadata.state_dict_metadata
        # Internal key -> DCP key.
        self._dcp_key: dict[str, str] = {}
        lightning = any(k.startswith(MODEL_PREFIX) for k in saved)
        model_prefix = MODEL_PREFIX if lightning else ""
        for key in saved:
            internal = _dcp_optimizer_key(key)
            if internal is not None:
                self._dcp_key[internal] = key
            elif key.startswith(model_prefix):
                self._dcp_key[key[len(model_prefix) :]] = key
        if is_upstream_checkpoint(metadata):  # megatron-fsdp's own format
            self._dcp_key = internal_keys(metadata)
        self._specs: dict[str, SourceTensorSpec] = {}
        for internal, key in self._dcp_key.items():
            entry = saved[key]
            if isinstance(entry, TensorStorageMetadata):
                self._specs[internal] = SourceTensorSpec(tuple(entry.size), entry.properties.dtype)
        self.model_keys = [
            k for k in self._dcp_key if not k.startswith(OPTIMIZER_PREFIX) and k in self._specs
        ]
        self._optimizer_indices = sorted(
            {
                int(k[len(OPTIMIZER_PREFIX) :].partition(".")[0])
                for k in self._dcp_key
                if k.startswith(OPTIMIZER_PREFIX)
            }
        )

    def _check_complete(self) -> None:
        """A directory of ours must be complete: its manifest parses and every file has
        its recorded size.

        Raises:
            SourceError: Naming what is wrong.
        """
        if MANIFEST_FILE not in self.location.sizes():
            return
        try:
            damaged = self.location.check_files(self.location.read_manifest())
        except (NotACheckpointError, OSError) as err:
            raise SourceError(str(err)) from err
        if damaged:
            raise SourceError(
                f"{self.path} is an incomplete or damaged checkpoint: {'; '.join(damaged)}. "
                "Use another checkpoint."
            )

    def _reader(self) -> VerifyingFileSystemReader:
        """The reader of every load from this checkpoint: nothing from it runs, files are
        opened confined to it, records are checked against their CRC32C where recorded."""
        return self.location.reader(verify=True, trust_checkpoint=self._trust)

    def spec(self, key: str) -> SourceTensorSpec:
        spec = self._specs.get(key)
        if spec is None:
            raise SourceError(f"{self.path}: entry {self._dcp_key[key]!r} is not a tensor.")
        return spec

    def has(self, key: str) -> bool:
        return key in self._dcp_key

    def optimizer_count(self, group_fqns: list[list[list[str]]]) -> int:
        return len(self._optimizer_indices)

    def optimizer_keys(self, index: int) -> list[str]:
        prefix = f"{OPTIMIZER_PREFIX}{index}."
        return [k for k in self._dcp_key if k.startswith(prefix)]

    def execute(self, plan: WeightsPlan, comm: Ranks) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        targets: dict[str, Any] = {self._dcp_key[c.key]: c.target for c in plan.copies}
        for key, container, name in plan.values:
            targets[self._dcp_key[key]] = container[name]
        view = dcp_view(targets)
        try:
            dcp.load(
                view,
                storage_reader=self._reader(),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                process_group=comm.group,
            )
        except CheckpointException as err:
            # DCP raises this on every rank, listing each failing rank's error.
            raise SourceError(f"DCP failed reading {self.path}: {err}") from err
        keep_loaded_values(targets, view)
        for key, container, name in plan.values:
            container[name] = _like(container[name], targets[self._dcp_key[key]])


def _dcp_optimizer_key(key: str) -> str | None:
    """Internal key of a DCP optimizer entry (ours or Lightning's), else ``None``."""
    if key.startswith(OPTIMIZER_PREFIX):
        return key
    head, dot, rest = key.partition(".")
    if dot and head.startswith("optimizer_") and head[len("optimizer_") :].isdigit():
        return f"{OPTIMIZER_PREFIX}{head[len('optimizer_') :]}.{rest}"
    return None


def _unpickling_hint(weights_only: bool) -> str:
    return (
        " If the file holds objects the weights-only unpickler refuses and you trust it, "
        "pass weights_only=False."
        if weights_only
        else ""
    )


_HEADER_LIMIT = 100 << 20
"""Largest safetensors header read (the safetensors package's own limit)."""


def _tensor_from(
    data: memoryview | bytearray, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """``data`` (native byte order) as a tensor of ``dtype`` and ``shape``, without a copy."""
    if not len(data):
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


def open_source(
    path: Path | str | Location,
    weights_only: bool,
    storage_options: Mapping[str, Any] | None = None,
) -> WeightSource:
    """Open ``path`` (a local path, or a URL with ``storage_options``) by what it is.

    Each rank reads only the byte ranges of its rows, through the location (a local file is
    memory-mapped, an object fetched with ranged GETs). A DCP checkpoint of ours is read
    from the version a load takes (its newest complete one).

    Args:
        path: The source.
        weights_only: As for :class:`~lightning_megatron_fsdp.weights.pretrained.PretrainedWeights`.
        storage_options: Options of a URL's fsspec filesystem.

    Raises:
        SourceError: If it does not exist or is no supported format, or a URL's
            filesystem is not installed (naming what to install).
    """
    try:
        location = locate(path, storage_options)
    except (ImportError, ValueError) as err:
        raise SourceError(str(err)) from err
    try:
        return _open(location, weights_only)
    except SourceError:
        raise
    except NotACheckpointError as err:
        raise SourceError(str(err)) from err
    except (OSError, CheckpointError) as err:
        raise SourceError(f"{location}: {type(err).__name__}: {err}") from err


def _open(location: Location, weights_only: bool) -> WeightSource:
    """:func:`open_source` of a located ``path``."""
    if location.is_file():
        if location.suffix == _SAFETENSORS_SUFFIX:
            return _SafetensorsSource(location)
        if location.suffix in _TORCH_SUFFIXES:
            return _TorchSource(location, weights_only)
        raise SourceError(
            f"{location}: unsupported suffix {location.suffix!r}. Expected a torch.save file "
            f"({', '.join(_TORCH_SUFFIXES)}), {_SAFETENSORS_SUFFIX}, or a DCP checkpoint "
            "directory."
        )
    if not location.is_dir():
        raise SourceError(f"{location} does not exist (or is not a regular file or directory).")
    version, notes = location.loaded_version()
    if DCP_METADATA_FILE not in version.sizes():
        if notes:
            raise SourceError(
                f"{location} holds no complete checkpoint ({'; '.join(notes)}). Use another "
                "checkpoint."
            )
        inside = location.checkpoints_inside()
        hint = (
            f"It holds checkpoint directories {inside[:5]}: pass one of them, e.g. "
            f"{location.file(inside[-1])}."
            if inside
            else "Expected a DCP checkpoint directory, or a .pt/.pth/.bin/.ckpt/.safetensors file."
        )
        raise SourceError(
            f"{location} is a directory without {DCP_METADATA_FILE}: not a DCP checkpoint. " + hint
        )
    return _DcpSource(version, weights_only)
