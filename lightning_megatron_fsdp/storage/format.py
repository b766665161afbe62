"""The on-disk format: file names, key prefixes, the manifest and the layout fingerprint.

A sharded checkpoint is a directory of files from every rank, so "the directory exists" does
not mean "the checkpoint is complete", and DCP records nothing a human can check before its
tensor reads begin. ``manifest.json``, written last, records the layout fingerprint (every
tensor's global shape and dtype by FQN), the world size and mesh, package versions, the
training position and the size and checksum of every other file; a directory is a complete
checkpoint iff its manifest parses and every listed file has its recorded size. Pure files
and bookkeeping: no process group, no Lightning (docs/DESIGN.md, "On-disk format"). What
other folders use is listed in ``storage/__init__.py`` (no ``__all__`` here to repeat it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_megatron_fsdp.agreement import Problem
from lightning_megatron_fsdp.errors import CheckpointMismatchError, NotACheckpointError
from lightning_megatron_fsdp.storage.checksums import ALGORITHMS, file_digest
from lightning_megatron_fsdp.storage.confined_files import (
    check_plain_name,
    read_regular,
    regular_size,
)

FORMAT_NAME = "lightning-megatron-fsdp"

FORMAT_VERSION = 2
"""Written by this version: CRC32C digests and a ``"checksum"`` field naming the algorithm."""

READABLE_FORMAT_VERSIONS = (1, 2)
"""Format 1 (sha256 digests, no ``"checksum"`` field) still loads and verifies."""

MANIFEST_FILE = "manifest.json"

META_FILE = "meta.pt"

DCP_METADATA_FILE = ".metadata"

DCP_METADATA_KEYS_FILE = ".metadata.keys"
"""``.metadata`` cut by key (``storage.metadata_index``): what a load reads instead, where
the manifest lists it."""

_DATA_FILE_RE = re.compile(r"__(?P<rank>\d+)_\d+\.distcp")
"""DCP's ``FileSystemWriter`` names rank r's record files ``__<r>_<n>.distcp``."""


def data_file_rank(name: str) -> int | None:
    """The rank that wrote the record file ``name`` (DCP's naming), or ``None`` for a
    name of another form."""
    found = _DATA_FILE_RE.fullmatch(name)
    return None if found is None else int(found["rank"])


MODEL_PREFIX = "state_dict."
"""DCP keys of model tensors: ``state_dict.<fqn>``."""
OPTIMIZER_PREFIX = "optimizer_states."
"""DCP keys of optimizer state: ``optimizer_states.<i>.state.<fqn>.<name>`` and
``optimizer_states.<i>.param_groups.<g>.<key>`` (DCP flattens nested dicts with dots)."""

MAX_EXAMPLES = 3
"""Problems of one kind are summarised after this many examples, so a truncated shard of a
large model yields a readable report rather than one line per chunk."""

# Kinds of hidden sibling directories (docs/DESIGN.md, "On-disk format").
STAGING, ASIDE, DELETING = "tmp", "old", "del"

_HIDDEN_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<token>[0-9a-f]{8,64})$")

_DIGEST_RE = {"sha256": re.compile(r"^[0-9a-f]{64}$"), "crc32c": re.compile(r"^[0-9a-f]{8}$")}

_MAX_LISTED = 20
# A manifest lists a few lines per tensor; a larger file is not one (and is not read).
_MAX_MANIFEST_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """Global shape and dtype of one state-dict entry; both ``None`` for a non-tensor."""

    shape: tuple[int, ...] | None
    dtype: str | None

    def __post_init__(self) -> None:
        if (self.shape is None) != (self.dtype is None):
            raise ValueError(
                f"TensorSpec: shape and dtype must both be set (a tensor) or both be None "
                f"(a non-tensor entry), got shape={self.shape!r}, dtype={self.dtype!r}."
            )
        if self.shape is not None and any(
            not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in self.shape
        ):
            raise ValueError(f"TensorSpec: shape must hold non-negative ints, got {self.shape!r}.")
        if self.dtype is not None and not isinstance(getattr(torch, self.dtype, None), torch.dtype):
            raise ValueError(f"TensorSpec: {self.dtype!r} is not a torch dtype name.")

    @classmethod
    def of(cls, value: Any) -> TensorSpec:
        """Describe ``value``: a DTensor by its global shape, any tensor by its shape."""
        if isinstance(value, torch.Tensor):  # DTensor.shape is the global shape
            return cls(tuple(int(d) for d in value.shape), str(value.dtype).removeprefix("torch."))
        return cls(None, None)

    def describe(self) -> str:
        """Human form: ``(7, 5) float32`` or ``a non-tensor value``."""
        if self.shape is None:
            return "a non-tensor value"
        return f"{self.shape} {self.dtype}"

    def to_json(self) -> dict[str, Any]:
        """JSON form: ``{"shape": [...], "dtype": "float32"}`` (both null for a non-tensor)."""
        return {"shape": None if self.shape is None else list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any) -> TensorSpec:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: If ``data`` is not of that form.
        """
        if not isinstance(data, Mapping) or set(data) != {"shape", "dtype"}:
            raise ValueError(f"expected {{'shape': ..., 'dtype': ...}}, got {data!r}")
        shape = data["shape"]
        if shape is not None and not isinstance(shape, list):
            raise ValueError(f"shape must be a list or null, got {shape!r}")
        return cls(None if shape is None else tuple(shape), data["dtype"])


Fingerprint = dict[str, TensorSpec]


def model_fingerprint(state_dict: Mapping[str, Any]) -> Fingerprint:
    """Fingerprint an FQN-keyed model state dict: each entry's global shape and dtype.

    Rank-local and collective-free: a DTensor reports its global shape without communication.
    """
    return {str(fqn): TensorSpec.of(value) for fqn, value in state_dict.items()}


def optimizer_fingerprint(optimizer_state_dict: Mapping[str, Any]) -> Fingerprint:
    """Fingerprint an FQN-keyed optimizer state dict, keyed ``"<param fqn>/<state name>"``.

    The ``/`` separator cannot be confused with the dots inside an FQN. ``param_groups``
    holds no tensors and is not fingerprinted; DCP checks its keys when it loads.

    Raises:
        TypeError: If ``optimizer_state_dict["state"]`` is not a mapping of mappings (not
            from ``get_optimizer_state_dict``).
    """
    state = optimizer_state_dict.get("state", {})
    if not isinstance(state, Mapping):
        raise TypeError(
            "optimizer state dict: expected 'state' to map parameter FQNs to state dicts "
            f"(torch's get_optimizer_state_dict), got {type(state).__name__}."
        )
    fingerprint: Fingerprint = {}
    for fqn, entries in state.items():
        if not isinstance(entries, Mapping):
            raise TypeError(
                f"optimizer state dict: state[{fqn!r}] should map state names to values, got "
                f"{type(entries).__name__}. Take the state dict with get_optimizer_state_dict."
            )
        for name, value in entries.items():
            fingerprint[f"{fqn}/{name}"] = TensorSpec.of(value)
    return fingerprint


def listed(keys: list[str], limit: int = _MAX_LISTED) -> str:
    """``['a', 'b', ... and 3 more']``: keys for a message, the first ``limit`` by name."""
    shown = ", ".join(repr(k) for k in keys[:limit])
    more = len(keys) - limit
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def compare_fingerprints(
    saved: Mapping[str, TensorSpec],
    target: Mapping[str, TensorSpec],
    *,
    what: str,
    strict: bool,
) -> list[Problem]:
    """Say exactly how a checkpoint's fingerprint differs from the target's.

    Args:
        saved: Fingerprint recorded in the checkpoint's manifest.
        target: Fingerprint of the state the checkpoint will be loaded into.
        what: Names the state dict in messages, e.g. ``"model"`` or ``"optimizer 0"``.
        strict: Report keys missing on either side. With ``strict=False`` target keys
            absent from the checkpoint keep their values and extra checkpoint keys are
            ignored, but a key present on both sides must still agree in shape and dtype.

    Returns:
        One :class:`CheckpointMismatchError` problem per difference, categorised
        (``missing``, ``unexpected``, ``shape``, ``dtype``, ``value``); empty when the
        target can be loaded.
    """
    problems: list[Problem] = []
    missing = sorted(k for k in target if k not in saved)
    unexpected = sorted(k for k in saved if k not in target)
    if strict and missing:
        problems.append(
            _mismatch(
                "missing",
                f"{what}: {len(missing)} key(s) of the target are missing from the checkpoint: "
                f"{listed(missing)}",
            )
        )
    if strict and unexpected:
        problems.append(
            _mismatch(
                "unexpected",
                f"{what}: {len(unexpected)} key(s) in the checkpoint are not in the target: "
                f"{listed(unexpected)}",
            )
        )
    for key in sorted(k for k in target if k in saved):
        have, want = saved[key], target[key]
        if have.shape is None or want.shape is None:
            if (have.shape is None) != (want.shape is None):
                problems.append(
                    _mismatch(
                        "value",
                        f"{what} {key!r}: the checkpoint holds {have.describe()}, the target "
                        f"holds {want.describe()}",
                    )
                )
            continue
        if have.shape != want.shape:
            problems.append(
                _mismatch(
                    "shape",
                    f"{what} {key!r}: shape {have.shape} in the checkpoint, {want.shape} in the "
                    "target",
                )
            )
        if have.dtype != want.dtype:
            problems.append(
                _mismatch(
                    "dtype",
                    f"{what} {key!r}: dtype {have.dtype} in the checkpoint, {want.dtype} in the "
                    "target",
                )
            )
    return problems


def _mismatch(category: str, text: str) -> Problem:
    return Problem(CheckpointMismatchError, text, category)


@dataclasses.dataclass(frozen=True)
class FileRecord:
    """Size in bytes and (optional) digest of one checkpoint file.

    Attributes:
        size: Bytes.
        sha256: Hex sha256 (format 1), or ``None``.
        crc32c: Hex CRC32C, 8 digits (format 2), or ``None``. At most one digest is set.
    """

    size: int
    sha256: str | None = None
    crc32c: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 0:
            raise ValueError(f"FileRecord: size must be a non-negative int, got {self.size!r}.")
        if self.sha256 is not None and self.crc32c is not None:
            raise ValueError("FileRecord: give one digest, sha256 or crc32c, not both.")
        for algorithm in ALGORITHMS:
            value = getattr(self, algorithm)
            if value is not None and not (
                isinstance(value, str) and _DIGEST_RE[algorithm].match(value)
            ):
                digits = 64 if algorithm == "sha256" else 8
                raise ValueError(
                    f"FileRecord: {algorithm} must be {digits} lowercase hex digits, got {value!r}."
                )

    def digest(self) -> tuple[str, str] | None:
        """``(algorithm, hex digest)``, or ``None`` when none was recorded."""
        for algorithm in ALGORITHMS:
            value = getattr(self, algorithm)
            if value is not None:
                return algorithm, value
        return None

    def to_json(self) -> dict[str, Any]:
        """JSON form: ``{"size": n}`` plus ``"crc32c"`` or ``"sha256"`` when computed."""
        digest = self.digest()
        return {"size": self.size} | ({} if digest is None else {digest[0]: digest[1]})


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Contents of ``manifest.json``; see docs/DESIGN.md, "On-disk format".

    Attributes:
        fingerprint: Model state-dict entries by FQN.
        optimizer_fingerprints: One fingerprint per optimizer, keyed ``"<fqn>/<state>"``;
            empty for a weights-only checkpoint.
        world_size: Number of ranks that wrote the checkpoint.
        mesh: ``{"shape": [...], "dim_names": [...]}`` of the DTensors' device mesh, or
            ``None`` when the state held no DTensor.
        versions: Package versions that wrote the checkpoint.
        global_step: Lightning's ``global_step`` at save time, if the checkpoint had one.
        epoch: Lightning's ``epoch`` at save time, if the checkpoint had one.
        files: Every other file of the checkpoint, by name relative to its directory.
        format_version: On-disk format version (:data:`READABLE_FORMAT_VERSIONS`).
    """

    fingerprint: dict[str, TensorSpec]
    optimizer_fingerprints: list[dict[str, TensorSpec]]
    world_size: int
    mesh: dict[str, Any] | None
    versions: dict[str, str]
    global_step: int | None
    epoch: int | None
    files: dict[str, FileRecord]
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"Manifest: world_size must be an int >= 1, got {self.world_size!r}.")
        for name in ("global_step", "epoch"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ValueError(f"Manifest: {name} must be an int or None, got {value!r}.")
        if DCP_METADATA_FILE not in self.files or META_FILE not in self.files:
            raise ValueError(
                f"Manifest: files must list {DCP_METADATA_FILE!r} and {META_FILE!r}, got "
                f"{sorted(self.files)}."
            )
        for name in self.files:
            if not name or "/" in name or "\\" in name or name in (".", "..", MANIFEST_FILE):
                raise ValueError(f"Manifest: {name!r} is not a file name inside a checkpoint.")
        if self.mesh is not None and (
            not isinstance(self.mesh, Mapping) or set(self.mesh) != {"shape", "dim_names"}
        ):
            raise ValueError(
                f"Manifest: mesh must be {{'shape': [...], 'dim_names': [...]}} or None, got "
                f"{self.mesh!r}."
            )
        if self.format_version not in READABLE_FORMAT_VERSIONS:
            raise ValueError(
                f"Manifest: format_version must be one of {READABLE_FORMAT_VERSIONS}, got "
                f"{self.format_version!r}."
            )
        algorithms = {d[0] for r in self.files.values() if (d := r.digest()) is not None}
        if len(algorithms) > 1:
            raise ValueError(f"Manifest: files mix digest algorithms {sorted(algorithms)}.")

    @property
    def checksum(self) -> str | None:
        """The algorithm of the file digests (``"crc32c"``, or ``"sha256"`` in format 1),
        or ``None`` when saved without checksums."""
        for record in self.files.values():
            digest = record.digest()
            if digest is not None:
                return digest[0]
        return None

    def to_json(self) -> dict[str, Any]:
        """The ``manifest.json`` document."""
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "fingerprint": {k: v.to_json() for k, v in self.fingerprint.items()},
            "optimizer_fingerprints": [
                {k: v.to_json() for k, v in fp.items()} for fp in self.optimizer_fingerprints
            ],
            "world_size": self.world_size,
            "mesh": self.mesh,
            "versions": self.versions,
            "global_step": self.global_step,
            "epoch": self.epoch,
            **({"checksum": self.checksum} if self.format_version >= 2 else {}),
            "files": {k: v.to_json() for k, v in sorted(self.files.items())},
        }

    def dumps(self) -> str:
        """The ``manifest.json`` text: one line per tensor and per file, so it greps by FQN."""
        lines = []
        for key, value in self.to_json().items():
            if isinstance(value, dict) and value and key != "versions" and key != "mesh":
                value = _one_per_line(value, "  ")
            elif key == "optimizer_fingerprints" and value:
                value = "[\n" + ",\n".join("  " + _one_per_line(fp, "   ") for fp in value) + "\n ]"
            else:
                value = json.dumps(value)
            lines.append(f" {json.dumps(key)}: {value}")
        return "{\n" + ",\n".join(lines) + "\n}\n"

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse a ``manifest.json`` document.

        Raises:
            ValueError: If it is not a manifest of a format version this library reads.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT_NAME:
            found = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"'format' is {found!r}, expected {FORMAT_NAME!r}")
        version = data.get("format_version")
        if version not in READABLE_FORMAT_VERSIONS or isinstance(version, bool):
            raise ValueError(
                f"format_version {version!r} is not supported (this version of "
                f"lightning-megatron-fsdp reads versions {list(READABLE_FORMAT_VERSIONS)}); use "
                f"the version of lightning-megatron-fsdp that wrote it "
                f"({data.get('versions')!r})"
            )
        allowed = ("sha256",) if version == 1 else ("crc32c",)
        try:
            manifest = cls(
                fingerprint={
                    str(k): TensorSpec.from_json(v) for k, v in data["fingerprint"].items()
                },
                optimizer_fingerprints=[
                    {str(k): TensorSpec.from_json(v) for k, v in fp.items()}
                    for fp in data["optimizer_fingerprints"]
                ],
                world_size=data["world_size"],
                mesh=data["mesh"],
                versions=dict(data["versions"]),
                global_step=data["global_step"],
                epoch=data["epoch"],
                files={
                    check_plain_name(k, what="manifest.json file"): FileRecord(
                        size=v["size"], **{a: v.get(a) for a in allowed}
                    )
                    for k, v in data["files"].items()
                },
                format_version=version,
            )
        except (KeyError, TypeError, AttributeError, OSError) as err:
            raise ValueError(f"malformed manifest ({type(err).__name__}: {err})") from err
        if version >= 2 and data.get("checksum") != manifest.checksum:
            raise ValueError(
                f"'checksum' is {data.get('checksum')!r} but the files carry "
                f"{manifest.checksum!r} digests"
            )
        return manifest


def _one_per_line(mapping: Mapping[str, Any], indent: str) -> str:
    if not mapping:
        return "{}"
    body = ",\n".join(f"{indent}{json.dumps(k)}: {json.dumps(v)}" for k, v in mapping.items())
    return "{\n" + body + "\n" + indent[:-1] + "}"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Return the sha256 hex digest of a file (format-1 checkpoints), read in 8 MiB blocks."""
    return file_digest(path, "sha256")


def hidden_path(final: str | os.PathLike[str], kind: str, token: str) -> Path:
    """Return the hidden sibling ``<parent>/.<name>.<kind>-<token>`` of ``final``.

    Args:
        final: The checkpoint's final path.
        kind: ``"tmp"`` (a save in progress), ``"old"`` (the previous checkpoint renamed
            aside during a commit) or ``"del"`` (being removed).
        token: Lowercase hex, 8 to 64 digits, unique per save.

    Raises:
        ValueError: For an unknown kind or a malformed token.
    """
    final = Path(final)
    path = final.parent / f".{final.name}.{kind}-{token}"
    parsed = parse_hidden_name(path.name)
    if parsed is None or parsed != (final.name, kind):
        raise ValueError(f"hidden_path: bad kind {kind!r} or token {token!r} for {final}.")
    return path


def parse_hidden_name(name: str) -> tuple[str, str] | None:
    """Return ``(final name, kind)`` for a hidden sibling's name, else ``None``."""
    match = _HIDDEN_RE.match(name)
    return None if match is None else (match["name"], match["kind"])


def _describe_not_a_checkpoint(path: Path) -> str:
    """Explain why ``path``, which has no readable manifest, is not a checkpoint."""
    if not path.exists():
        return f"{path} does not exist. Expected a checkpoint directory; check the path."
    if path.is_file():
        with open(path, "rb") as file:
            head = file.read(9)
        if head[:4] == b"PK\x03\x04":
            kind = "a single-file torch.save checkpoint (Lightning's default format)"
            one_process = "torch.load it (or Model.load_from_checkpoint)"
        elif path.suffix == ".safetensors" or _safetensors_header(head, path.stat().st_size):
            kind = "a safetensors file"
            one_process = "read it with safetensors.torch.load_file"
        else:
            kind, one_process = "a file", "torch.load it (or Model.load_from_checkpoint)"
        return (
            f"{path} is {kind}, not a checkpoint directory. MegatronFSDPCheckpointIO reads "
            "the sharded directory format only: to start from this file's weights, pass it "
            "as MegatronFSDPStrategy(init_weights_from=...); to use it in one process, "
            f"{one_process}; or point at a directory written by MegatronFSDPStrategy."
        )
    if not path.is_dir():
        return f"{path} is neither a file nor a directory; expected a checkpoint directory."
    hidden = parse_hidden_name(path.name)
    if hidden is not None and hidden[1] == STAGING:
        return (
            f"{path} is the temporary directory of a save that did not finish "
            "(no manifest.json); load the checkpoint under its final name instead."
        )
    if (path / DCP_METADATA_FILE).exists():
        return (
            f"{path} holds DCP files but no {MANIFEST_FILE}: the save did not finish (the "
            "manifest is written last) or the directory was written by plain "
            "torch.distributed.checkpoint. Use a complete checkpoint."
        )
    inside = checkpoints_in_directory(path)
    if inside:
        return (
            f"{path} is a directory of checkpoints ({summarise('pass one of them', inside)})"
            f", not a checkpoint: it has no {MANIFEST_FILE}."
        )
    return (
        f"{path} has no {MANIFEST_FILE}: not a checkpoint written by "
        "MegatronFSDPCheckpointIO. Check the path."
    )


def _safetensors_header(head: bytes, size: int) -> bool:
    """Whether a file starts as safetensors does: its header's length, then the JSON."""
    return head[8:9] == b"{" and int.from_bytes(head[:8], "little") < size


def checkpoints_in_directory(path: Path) -> list[str]:
    """The complete checkpoints directly inside ``path`` (by name; hidden saves left out):
    a user who points at ``ModelCheckpoint``'s ``dirpath`` gets their names."""
    with os.scandir(path) as children:
        names = [c.name for c in children if c.is_dir() and not c.name.startswith(".")]
    return sorted(name for name in names if (path / name / MANIFEST_FILE).is_file())


def count(number: int, noun: str) -> str:
    """``"1 problem"``, ``"3 problems"``: a count in a message, its noun agreeing."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def summarise(prefix: str, examples: list[str]) -> str:
    """One report line: ``prefix``, the first :data:`MAX_EXAMPLES` examples, and how many
    more there are."""
    shown = "; ".join(examples[:MAX_EXAMPLES])
    more = f" (and {len(examples) - MAX_EXAMPLES} more)" if len(examples) > MAX_EXAMPLES else ""
    return f"{prefix}: {shown}{more}"


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``<path>/manifest.json``.

    Raises:
        NotACheckpointError: If ``path`` is missing, a file, a directory without a manifest,
            or its manifest cannot be parsed; the message says which and what to do.
    """
    path = Path(path)
    manifest_path = path / MANIFEST_FILE
    if not path.is_dir() or not manifest_path.is_file():
        raise NotACheckpointError(_describe_not_a_checkpoint(path))
    try:
        text = read_regular(path, MANIFEST_FILE, limit=_MAX_MANIFEST_BYTES).decode("utf-8")
        data = json.loads(text)
        return Manifest.from_json(data)
    except RecursionError as err:
        raise NotACheckpointError(
            f"{manifest_path} cannot be parsed: it nests deeper than any manifest does. The "
            "checkpoint is damaged or crafted; use another checkpoint."
        ) from err
    except (ValueError, OSError) as err:  # json.JSONDecodeError is a ValueError
        raise NotACheckpointError(
            f"{manifest_path} cannot be parsed: {err}. The checkpoint is damaged or was not "
            "written by MegatronFSDPCheckpointIO; use another checkpoint."
        ) from err


def check_files(
    path: str | os.PathLike[str],
    manifest: Manifest,
    *,
    checksum_files: list[str] | None = None,
) -> list[str]:
    """Check that every file the manifest lists exists with its recorded size and digest.

    Args:
        path: The checkpoint directory.
        manifest: Its manifest.
        checksum_files: Files whose digest (CRC32C, or sha256 in format 1) to verify, each
            read once; files without a recorded digest are skipped. The caller may split
            this work across ranks. ``None`` verifies sizes only.

    Returns:
        One line per problem, naming the file and what was expected.
    """
    path = Path(path)
    problems: list[str] = []
    for name, record in sorted(manifest.files.items()):
        try:
            size = regular_size(path, name)
        except FileNotFoundError:
            problems.append(f"{name}: missing (expected {record.size} bytes)")
            continue
        except OSError as err:  # a link, FIFO or device: never followed or opened
            problems.append(f"{name}: {err}")
            continue
        if size != record.size:
            problems.append(f"{name}: {size} bytes on disk, {record.size} in the manifest")
    if checksum_files and not problems:
        problems += check_digests(
            manifest, checksum_files, lambda name, algorithm: file_digest(path / name, algorithm)
        )
    return problems


def check_digests(
    manifest: Manifest,
    names: list[str],
    digest_of: Callable[[str, str], str],
    *,
    where: str = "on disk",
    kind: str = "file",
) -> list[str]:
    """Compare the digest of each of ``names`` with the manifest's.

    Args:
        manifest: The checkpoint's manifest (listing every one of ``names``).
        names: Files to check; those without a recorded digest are skipped.
        digest_of: ``digest_of(name, algorithm)``: the file's digest as stored, each file
            read once.
        where: Where messages say the file's bytes are (``"on disk"``, ``"stored"``).
        kind: What messages call it (``"file"``, ``"object"``).

    Returns:
        One line per file whose digest differs, naming both digests.
    """
    problems = []
    for name in names:
        digest = manifest.files[name].digest()
        if digest is None:
            continue
        algorithm, expected = digest
        found = digest_of(name, algorithm)
        if found != expected:
            problems.append(
                f"{name}: {algorithm} {found} {where}, {expected} in the manifest (the "
                f"{kind} changed after it was written)"
            )
    return problems


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Return whether ``path`` is a complete checkpoint: manifest parses, all sizes match.

    Reads the manifest and stats each file; no checksums (use ``load_checkpoint`` or the
    CLI's ``verify`` for those).
    """
    try:
        manifest = read_manifest(path)
    except NotACheckpointError:
        return False
    return not check_files(path, manifest)


def mesh_info(*state_dicts: Any) -> dict[str, Any] | None:
    """Return the device mesh of a DTensor in the state dicts (all share one), or ``None``."""
    # Imported here: the offline tools import this module but never hold a DTensor.
    from torch.distributed.tensor import DTensor

    stack: list[Any] = list(state_dicts)
    while stack:
        value = stack.pop()
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            names = mesh.mesh_dim_names
            return {"shape": list(mesh.shape), "dim_names": list(names) if names else None}
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return None


def finite_int_or_none(value: Any) -> int | None:
    """Return ``value`` as an int for the manifest's step/epoch, or ``None``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if math.isfinite(value) and float(value).is_integer() else None


@functools.cache
def package_versions() -> dict[str, str]:
    """Package versions, looked up once per process (``importlib.metadata`` scans
    ``sys.path`` on every call); callers copy the dict."""
    versions = {"torch": torch.__version__}
    for key, distribution in (
        ("lightning", "lightning"),
        ("megatron_fsdp", "megatron-fsdp"),
        ("lightning_megatron_fsdp", "lightning-megatron-fsdp"),
    ):
        try:
            versions[key] = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = "unknown"
    return versions
