"""A single-file Lightning checkpoint from one of our checkpoint directories, for
``LightningModule.load_from_checkpoint`` in single-device or DDP code:
:func:`export_lightning_checkpoint` streams the dict a single-device run would have saved
(``meta.pt``'s entries, full tensors by FQN, optimizer state by position) through the
consolidating writer, and :func:`load_lightning_module` loads either kind of path.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from lightning_megatron_fsdp.errors import CheckpointCorruptedError, NotACheckpointError
from lightning_megatron_fsdp.storage import (
    DCP_METADATA_FILE,
    META_FILE,
    Location,
    Manifest,
    VerifyingFileSystemReader,
    load_weights_only,
    locate,
)
from lightning_megatron_fsdp.tools.export import (
    ExportEntry,
    TorchFile,
    TreePlace,
    load_object,
    parse_dtype,
    refuse_problems,
    select_entries,
    write_export,
)
from lightning_megatron_fsdp.tools.inspection import (
    MODEL_PREFIX,
    check_directory,
    read_checked,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EXPORT_INFO_KEY", "export_lightning_checkpoint", "load_lightning_module"]

EXPORT_INFO_KEY = "lightning_megatron_fsdp_export"
"""Top-level key of an exported file: ``{"world_size", "versions", "format_version"}`` of
the checkpoint it came from (plain values; Lightning ignores unknown keys)."""

_LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
_SAFETENSORS_SUFFIX = ".safetensors"

ModuleT = TypeVar("ModuleT", bound="pl.LightningModule")


def export_lightning_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    optimizer: bool = False,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
    verify_checksums: bool = True,
    trust_checkpoint: bool = False,
    storage_options: Mapping[str, Any] | None = None,
) -> Path | str:
    """Write one of our checkpoint directories as a single-file Lightning checkpoint.

    ``Model.load_from_checkpoint(output_path)`` then works in one process, with no GPU
    and no process group, restoring the hyper-parameters; so does
    ``DataModule.load_from_checkpoint`` for datamodule hyper-parameters. Runs offline
    like :func:`~lightning_megatron_fsdp.consolidate_checkpoint` (no collective), with
    peak memory about the largest tensor plus ``meta.pt``'s contents; the output is
    written to a hidden temporary file and renamed into place only when complete. Either
    side may be a URL, as for ``consolidate_checkpoint`` (an output there appears when
    its streaming upload completes).

    Args:
        checkpoint_dir: A checkpoint directory written by ``MegatronFSDPStrategy``, or
            its URL.
        output_path: The file (or URL) to write, conventionally ``*.ckpt``; any suffix
            but ``.safetensors`` (which holds no hyper-parameters).
        optimizer: Also write ``"optimizer_states"``, converted to torch's positional
            ``Optimizer.state_dict`` format (see the module docstring), so a
            single-device or DDP run can resume from the file. Without it the file has
            no optimizer state, like Lightning's ``save_weights_only`` checkpoints; the
            other training state (loops, callbacks, schedulers) is kept either way.
        dtype: Cast floating-point model tensors (``"bf16"``, ``"fp16"``, ``"fp32"`` or a
            torch dtype); ``None`` keeps the saved dtypes. Optimizer state is never cast.
        overwrite: Replace an existing ``output_path``.
        verify_checksums: Check every file's checksum against the manifest first.
        trust_checkpoint: Unpickle ``meta.pt``, ``.metadata`` and byte records in full
            (hyper-parameters that are objects of your classes need it). By default
            nothing from the checkpoint runs.
        storage_options: Options of a URL's fsspec filesystem (both sides).

    Returns:
        ``output_path`` as a ``Path``; a URL as the string given.

    Raises:
        NotACheckpointError: If ``checkpoint_dir`` is a file (already single-file), a
            directory without a readable manifest, or a URL naming nothing.
        CheckpointCorruptedError: If the checkpoint is damaged (missing, truncated or
            altered files, chunk gaps) or ``meta.pt`` does not unpickle.
        FileExistsError: If ``output_path`` exists and ``overwrite`` is false.
        FileNotFoundError: If the output's directory does not exist.
        ImportError: If a URL's filesystem is not installed (naming what to install).
        IsADirectoryError: If ``output_path`` is a directory.
        ValueError: For a ``.safetensors`` output, a bad ``dtype``, an output inside the
            checkpoint, ``optimizer`` on a weights-only checkpoint, or optimizer state
            that does not map onto its parameter groups.
    """
    output = locate(output_path, storage_options)
    _export(
        locate(checkpoint_dir, storage_options),
        output,
        optimizer=optimizer,
        dtype=dtype,
        overwrite=overwrite,
        verify_checksums=verify_checksums,
        trust_checkpoint=trust_checkpoint,
        who="export_lightning_checkpoint",
    )
    return output.returned()


def load_lightning_module(
    module_class: type[ModuleT],
    checkpoint: str | os.PathLike[str],
    *,
    tmp_dir: str | os.PathLike[str] | None = None,
    verify_checksums: bool = True,
    trust_checkpoint: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> ModuleT:
    """``module_class.load_from_checkpoint`` for a single file or one of our directories.

    A file is passed to Lightning unchanged (on an object store, as the object's stream).
    A checkpoint directory (local or a URL) is first exported with
    :func:`export_lightning_checkpoint` (weights only) to a temporary local file, which is
    deleted once loaded: that costs disk space for the weights, in ``tmp_dir``. To load
    the same checkpoint repeatedly, export it once and load the file instead.

    Args:
        module_class: The LightningModule class (the one that was trained).
        checkpoint: A ``.ckpt`` file or a checkpoint directory written by
            ``MegatronFSDPStrategy``, or the URL of either.
        tmp_dir: Where the temporary file goes; the system default if ``None``.
        verify_checksums: For a directory: check every file's checksum first.
        trust_checkpoint: For a directory: unpickle its pickles in full (see
            :func:`export_lightning_checkpoint`).
        storage_options: Options of a URL's fsspec filesystem.
        **kwargs: Passed to ``load_from_checkpoint`` (``map_location``, ``strict``,
            ``weights_only``, ``hparams_file``, hyper-parameter overrides).

    Returns:
        The loaded module, on the device Lightning chose (CPU for our exports).

    Raises:
        FileNotFoundError: If ``checkpoint`` does not exist.
        ImportError: If a URL's filesystem is not installed (naming what to install).
        NotACheckpointError | CheckpointCorruptedError: If a directory is not a complete,
            intact checkpoint of ours (see :func:`export_lightning_checkpoint`).
    """
    location = locate(checkpoint, storage_options)
    if not location.exists():
        raise FileNotFoundError(
            f"load_lightning_module: {location} does not exist; expected a .ckpt file or a "
            "checkpoint directory written by MegatronFSDPStrategy."
        )
    if location.is_file():
        with location.open() as stream:
            return module_class.load_from_checkpoint(stream, **kwargs)
    with tempfile.TemporaryDirectory(prefix="lmf-export-", dir=tmp_dir) as scratch:
        exported = Path(scratch) / "model.ckpt"
        _export(
            location,
            locate(exported),
            verify_checksums=verify_checksums,
            trust_checkpoint=trust_checkpoint,
            who="load_lightning_module",
        )
        return module_class.load_from_checkpoint(exported, **kwargs)


# ---------------------------------------------------------------------------------------


def _export(
    named: Location,
    output: Location,
    *,
    verify_checksums: bool,
    trust_checkpoint: bool,
    who: str,
    optimizer: bool = False,
    dtype: torch.dtype | str | None = None,
    overwrite: bool = False,
) -> None:
    out_dtype = parse_dtype(dtype, who)
    if output.suffix.lower() == _SAFETENSORS_SUFFIX:
        raise ValueError(
            f"{who}: output {output} is .safetensors, which holds tensors only, not the "
            "hyper-parameters a Lightning checkpoint needs. Write a .ckpt file, or use "
            "consolidate_checkpoint (lightning-megatron-fsdp consolidate) for bare weights."
        )
    if named.is_file():
        raise NotACheckpointError(
            f"{who}: {named} is a file, expected a checkpoint directory written by "
            "MegatronFSDPStrategy. A single-file Lightning checkpoint needs no export: load "
            "it with Model.load_from_checkpoint(path)."
        )
    output.check_output(named, overwrite=overwrite, who=who)
    checkpoint, _ = named.loaded_version()
    checked = check_directory(checkpoint, checksums=verify_checksums, trust=trust_checkpoint)
    refuse_problems(checked, checkpoint, who)
    entries = select_entries(
        checked, out_dtype, include_optimizer=optimizer, path=checkpoint, who=who
    )
    assert checked.metadata is not None and checked.manifest is not None  # checked above
    reader = checkpoint.checked_reader(checked.metadata, trust_checkpoint=trust_checkpoint)
    tree, places = _lightning_tree(
        _read_meta_in_full(checkpoint, who, checked.manifest, trust_checkpoint, verify_checksums),
        entries,
        checked.metadata.planner_data or {},
        reader,
        checked.manifest,
        who,
    )
    write_export(output, TorchFile(tree, places), reader, overwrite=overwrite, who=who)


def _read_meta_in_full(
    checkpoint: Location, who: str, manifest: Manifest, trust: bool, digest: bool
) -> dict[str, Any]:
    """Every entry of ``meta.pt`` (weights-only unless ``trust``), read only after its size
    and checksum match the manifest.

    Raises:
        CheckpointCorruptedError: If it differs from the manifest or does not unpickle to a
            dict.
    """
    file = f"{checkpoint}/{META_FILE}"
    try:
        data = read_checked(checkpoint, META_FILE, manifest, digest=digest)
    except (CheckpointCorruptedError, OSError) as err:
        raise CheckpointCorruptedError(f"{who}: {err}") from err
    try:
        meta = load_weights_only(data, source=file, trust=trust)
    except CheckpointCorruptedError as err:
        raise CheckpointCorruptedError(
            f"{who}: {META_FILE} does not unpickle ({err}). It holds the hyper-parameters "
            "and training position."
        ) from err
    if not isinstance(meta, dict):
        raise CheckpointCorruptedError(
            f"{who}: {file} holds a {type(meta).__name__}, expected the dict that "
            "MegatronFSDPCheckpointIO writes; use another checkpoint."
        )
    return meta


def _put(root: Any, place: TreePlace, value: Any) -> None:
    """Set ``root[place[0]][place[1]]... = value``, creating dicts (str keys) and lists
    (int keys) on the way, as DCP's flattening paths describe nested state."""
    node = root
    for key, following in itertools.pairwise(place):
        child = _get(node, key)
        if child is None:
            child = [] if isinstance(following, int) else {}
            _assign(node, key, child)
        node = child
    _assign(node, place[-1], value)


def _get(node: Any, key: Any) -> Any:
    if isinstance(node, list):
        return node[key] if key < len(node) else None
    return node.get(key)


def _assign(node: Any, key: Any, value: Any) -> None:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
    node[key] = value


def _lightning_tree(
    meta: dict[str, Any],
    entries: list[ExportEntry],
    paths: Mapping[str, Any],
    reader: VerifyingFileSystemReader,
    manifest: Manifest,
    who: str,
) -> tuple[dict[str, Any], list[tuple[ExportEntry, TreePlace]]]:
    """Lightning's checkpoint dict, with a place for each tensor the writer fills in.

    ``paths`` is DCP's ``planner_data``: each flat key's path in the saved dict.
    """
    tree: dict[str, Any] = dict(meta)
    lightning = manifest.versions.get("lightning")
    if _LIGHTNING_VERSION_KEY not in tree and lightning not in (None, "unknown"):
        tree[_LIGHTNING_VERSION_KEY] = lightning
    tree[EXPORT_INFO_KEY] = {
        "world_size": manifest.world_size,
        "versions": dict(manifest.versions),
        "format_version": manifest.format_version,
    }
    tree["state_dict"] = {}
    places: list[tuple[ExportEntry, TreePlace]] = []
    optimizer_state: dict[int, list[tuple[str, TreePlace, ExportEntry, Any]]] = {}
    optimizer_groups: dict[int, dict[int, Any]] = {}
    for entry in entries:
        path = tuple(paths.get(entry.key, ()))
        value = None if entry.dtype is not None else load_object(reader, entry)
        if entry.key.startswith(MODEL_PREFIX):
            place = (
                path if len(path) >= 2 and path[0] == "state_dict" else ("state_dict", entry.name)
            )
            _put(tree, place, value)
            if entry.dtype is not None:
                places.append((entry, place))
            continue
        if (
            len(path) < 5
            or path[0] != "optimizer_states"
            or not isinstance(path[1], int)
            or path[2] not in ("state", "param_groups")
        ):
            raise ValueError(
                f"{who}: {DCP_METADATA_FILE} records optimizer entry {entry.key!r} at "
                f"{path or 'no path'}, expected ('optimizer_states', <i>, 'state' | "
                "'param_groups', ...); export without optimizer state."
            )
        index = path[1]
        if path[2] == "state":
            optimizer_state.setdefault(index, []).append((str(path[3]), path[4:], entry, value))
        else:
            _put(optimizer_groups.setdefault(index, {}), path[3:], value)
    indices = sorted(set(optimizer_state) | set(optimizer_groups))
    if indices:
        if indices != list(range(len(indices))) or set(optimizer_groups) != set(indices):
            raise ValueError(
                f"{who}: the checkpoint holds state of optimizers {indices} with parameter "
                f"groups for {sorted(optimizer_groups)}; expected both for 0..n-1 (a "
                f"damaged or hand-made checkpoint). Export without optimizer state."
            )
        tree["optimizer_states"] = [
            _positional_optimizer(
                index, optimizer_groups[index], optimizer_state.get(index, []), places, who
            )
            for index in indices
        ]
    return tree, places


def _positional_optimizer(
    index: int,
    groups_by_number: dict[int, Any],
    state: list[tuple[str, TreePlace, ExportEntry, Any]],
    places: list[tuple[ExportEntry, TreePlace]],
    who: str,
) -> dict[str, Any]:
    """Optimizer ``index``'s FQN-keyed state as torch's positional ``state_dict``; appends
    the places of its tensors to ``places``."""
    if sorted(groups_by_number) != list(range(len(groups_by_number))):
        raise ValueError(
            f"{who}: optimizer {index} has parameter groups {sorted(groups_by_number)}, "
            "expected 0..n-1; export without optimizer state."
        )
    groups = [groups_by_number[g] for g in range(len(groups_by_number))]
    position: dict[str, int] = {}
    for g, group in enumerate(groups):
        fqns = group.get("params") if isinstance(group, dict) else None
        if not isinstance(fqns, list) or not all(isinstance(f, str) for f in fqns):
            raise ValueError(
                f"{who}: optimizer {index} param_groups[{g}]['params'] is {fqns!r}, expected "
                "the list of parameter FQNs torch's distributed optimizer state dict saves; "
                "export without optimizer state."
            )
        numbers = list(range(len(position), len(position) + len(fqns)))
        position.update(zip(fqns, numbers, strict=True))
        group["params"] = numbers
    by_number: dict[int, Any] = {}
    for fqn, rest, entry, value in state:
        if fqn not in position:
            raise ValueError(
                f"{who}: optimizer {index} holds state {entry.key!r} for parameter {fqn!r}, "
                "which none of its param_groups lists; the checkpoint is inconsistent. "
                "Export without optimizer state."
            )
        _put(by_number, (position[fqn], *rest), value)
        if entry.dtype is not None:
            places.append((entry, ("optimizer_states", index, "state", position[fqn], *rest)))
    return {
        "state": {number: by_number[number] for number in sorted(by_number)},
        "param_groups": groups,
    }
