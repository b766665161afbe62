"""Every private torch name the package relies on, each path chosen by feature detection.

torch's private names change between releases without notice. Keeping them here means a
release that drops or reshapes one breaks this module alone, and ``tests/test_torch_compat.py``
fails first, naming the shim to update. No other module imports a private torch name or
reads a private torch attribute (``tests/test_structure.py`` checks it).
"""

from __future__ import annotations

import inspect
import io
import os
import queue
import threading
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as _filesystem
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future
from typing_extensions import override

__all__ = [
    "CHECKPOINTABLE_TENSOR_PROTOCOL",
    "SYNC_WITHOUT_FD_CALLS_OS_SYNC",
    "GlobalSavePlanning",
    "OwnWriteLoopWriter",
    "caching_save_planner",
    "checkpoint_offset",
    "create_file_view",
    "dcp_metadata_private_types",
    "dtensor_with_local",
    "fake_tensor_mode",
    "fqns_of",
    "group_timeout",
    "has_backward_hooks",
    "local_tensor",
    "metadata_path",
    "narrow_tensor_by_index",
    "obj_state",
    "own_buffers",
    "own_parameters",
    "random_sampler_num_samples",
    "serialization_skips_data",
    "storage_alignment",
    "storage_info",
    "transformed_stream",
]


# ------------------------------------------------------------------------------- DTensor


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """The rank's shard of ``dtensor`` itself (not a view through autograd)."""
    return dtensor._local_tensor


def dtensor_with_local(like: DTensor, local: torch.Tensor) -> DTensor:
    """A DTensor with ``like``'s spec around ``local``, where it lies (``from_local``
    would move it to the mesh's device)."""
    return DTensor(local, like._spec, requires_grad=False)


# ------------------------------------------------------------------------ process groups


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The collective timeout of ``group``'s backend, or torch's default."""
    for device in getattr(group, "_device_types", []):
        try:
            timeout = group._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
        if isinstance(timeout, timedelta):
            return timeout
    return dist.default_pg_timeout


# ------------------------------------------------------------------------------ modules


def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameter slots (not its children's), the live dict: assigning
    into it replaces a parameter without ``register_parameter``'s checks."""
    return cast(dict[str, Any], module._parameters)


def own_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffer slots (not its children's), the live dict."""
    return cast(dict[str, Any], module._buffers)


def random_sampler_num_samples(sampler: Any) -> int | None:
    """The ``num_samples`` a torchdata ``RandomSampler`` was built with (``None``: the
    whole dataset)."""
    return cast("int | None", sampler._num_samples)


# -------------------------------------------------------------------------- state dicts


def fqns_of(model: torch.nn.Module, name: str) -> set[str]:
    """Every FQN DCP's state-dict helpers give the parameter or buffer ``name``."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return cast(set[str], _get_fqns(model, name))


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """The part of ``tensor`` a DCP read item addresses."""
    from torch.distributed._shard._utils import narrow_tensor_by_index as narrow

    return narrow(tensor, offsets, sizes)


# ------------------------------------------------------------------------ serialization


def obj_state(tensor: torch.Tensor) -> Any:
    """Python state ``torch.save`` pickles along with a tensor (empty for a plain one)."""
    return torch._utils._get_obj_state(tensor)


def serialization_skips_data() -> bool:
    """Whether ``torch.save`` runs under ``skip_data`` (it then writes no payloads)."""
    return bool(torch.serialization._serialization_tls.skip_data)


def storage_alignment() -> int:
    """The payload alignment ``torch.save`` uses in its zip files."""
    return int(torch.serialization._get_storage_alignment())


def checkpoint_offset(tensor: torch.Tensor) -> int | None:
    """Where the bytes of the storage of a tensor that ``torch.load(map_location="meta")``
    returned start in its file (the tensor itself may start later in its storage);
    ``None`` where torch does not say."""
    offset = getattr(tensor.untyped_storage(), "_checkpoint_offset", None)
    return None if offset is None else int(offset)


def has_backward_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` has backward hooks (``torch.save`` pickles them)."""
    return bool(tensor._backward_hooks)


def fake_tensor_mode() -> Any:
    """torch's ``FakeTensorMode`` (tensors with shapes and no storage)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


# ------------------------------------------------------------------------ DCP planning


GlobalSavePlanning = Callable[..., "tuple[list[SavePlan], Any]"]
"""A coordinator's save planning: ``(all_plans, *, merge_planner_data, to_lowest_rank)`` to
the global plan and metadata, as DCP's default planner gives them."""


class _CachingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner whose coordinator step ``global_planning`` replaces."""

    global_planning: GlobalSavePlanning | None = None

    @override
    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Any]:
        if self.global_planning is None:
            return super()._create_global_plan(all_plans)
        return self.global_planning(
            all_plans,
            merge_planner_data=self.flatten_state_dict,
            to_lowest_rank=self.dedup_save_to_lowest_rank,
        )


def caching_save_planner(key: str, global_plan: GlobalSavePlanning | None = None) -> Any:
    """DCP's default save planner with its plan caching on, under ``key``: a save whose
    local plans equal the last successful save's under the same key sends empty plans, and
    the coordinator reuses its global plan and metadata instead of planning again. ``key``
    must name the layout (DCP's own key is the planner's class name, one for the process).

    ``global_plan`` replaces DCP's coordinator step (dedup, global plan, metadata,
    validation) where a save is planned afresh; it must return what that step would."""
    planner = _CachingSavePlanner(enable_plan_caching=True)
    planner._cached_plans_key = key
    planner.global_planning = global_plan
    return planner


def _dcp_plans_checkpointable_tensors() -> bool:
    """Whether DCP plans a plain tensor carrying ``CheckpointableTensor``'s four fields as a
    shard of its global tensor (torch >= 2.14): tried on a one-row shard of a 2-row tensor
    with DCP's own write planning, so a torch that exports the name without honouring it
    counts as without."""
    if not hasattr(torch.distributed.checkpoint, "CheckpointableTensor"):
        return False
    try:
        from torch.distributed.checkpoint.planner_helpers import _create_write_items

        shard = torch.zeros(1, 1)
        shard.global_shape = (2, 1)
        shard.global_offsets = ((1, 0),)
        shard.local_offsets = ((0, 0),)
        shard.local_sizes = ((1, 1),)
        (item,) = _create_write_items("probe", shard)
        data = item.tensor_data
        return bool(
            data is not None
            and tuple(data.size) == (2, 1)
            and tuple(data.chunk.offsets) == (1, 0)
            and tuple(data.chunk.sizes) == (1, 1)
        )
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


CHECKPOINTABLE_TENSOR_PROTOCOL = _dcp_plans_checkpointable_tensors()
"""Whether DCP honours torch's public ``CheckpointableTensor`` protocol (torch >= 2.14): a
plain local tensor that carries ``global_shape``, ``global_offsets``, ``local_offsets`` and
``local_sizes`` is saved and loaded as shards of that global tensor."""


# ------------------------------------------------------------------------- DCP storage


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """DCP's storage entry of one record (``.metadata``'s index)."""
    return _filesystem._StorageInfo(relative_path, offset, length)


def local_chunks(value: torch.Tensor) -> list[Any]:
    """The chunks of its global tensor that ``value`` (a tensor, DTensor or sharded tensor)
    holds on this rank, as DCP's load planner computes them to plan the reads."""
    from torch.distributed.checkpoint.planner_helpers import _create_chunk_list

    return _create_chunk_list(value)


def metadata_path(reader: FileSystemReader, rank: int | None = None) -> str:
    """Where ``reader`` reads ``.metadata`` (or DCP's per-rank metadata) from."""
    return cast(str, reader._get_metadata_path(rank))


def dcp_metadata_private_types() -> dict[tuple[str, str], Any]:
    """The private torch names a DCP ``.metadata`` pickle references, by (module, name).

    DCP pickles its storage index as ``filesystem._StorageInfo``, a tensor's memory format
    as ``metadata._MEM_FORMAT_ENCODING`` and its layout through
    ``serialization._get_layout``; each is data or a lookup by name, none runs user code.
    """
    from torch.distributed.checkpoint import metadata as dcp_metadata

    return {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _filesystem._StorageInfo,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): (
            dcp_metadata._MEM_FORMAT_ENCODING
        ),
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    }


def create_file_view(file: Any, offset: int, length: int) -> Any:
    """A file object over bytes ``[offset, offset + length)`` of the open ``file``."""
    from torch.distributed.checkpoint.utils import _create_file_view

    return _create_file_view(file, offset, length)


def transformed_stream(descriptors: Sequence[str], stored: IO[bytes]) -> IO[bytes]:
    """A record's ``stored`` bytes read back through the DCP stream extensions that
    ``descriptors`` name (torch's default registry: ZStandard), as torch's reader does.

    Raises:
        ValueError: If a descriptor names an extension the registry lacks.
    """
    transforms = _filesystem._StorageReaderTransforms()
    return transforms.transform_load_stream(cast(Any, None), descriptors, stored)


def _sync_without_fd_calls_os_sync() -> bool:
    """torch 2.13's write loop calls ``os.sync()`` when a stream has no file descriptor;
    2.14 warns instead. Read from the loop's source; ``True`` where it cannot be read."""
    try:
        return "os.sync()" in inspect.getsource(_filesystem._write_files_from_queue)
    except (OSError, TypeError, AttributeError):
        return True


SYNC_WITHOUT_FD_CALLS_OS_SYNC = _sync_without_fd_calls_os_sync()
"""Whether torch's write loop calls ``os.sync()`` for a stream without a file descriptor
(torch < 2.14) rather than warning; our copy of the loop does what the running torch does."""

WriteRecord = Callable[[Any, str, WriteItem, Any], WriteResult]


class OwnWriteLoopWriter(FileSystemWriter):
    """torch's ``FileSystemWriter`` whose per-record write is the subclass's
    :meth:`write_record`; the loop around it (files, threads, order, flush and sync) is a
    copy of torch's private one, following the torch it runs on. With stream extensions
    or another serialization format, torch's own loop runs."""

    def write_record(
        self, stream: Any, storage_key: str, item: WriteItem, data: Any
    ) -> WriteResult:
        """Write one item as one record of ``stream``."""
        raise NotImplementedError

    @override
    def _write_data(
        self, planner: SavePlanner, file_queue: queue.Queue[Any]
    ) -> Future[list[WriteResult]]:
        if (
            self.transforms.extensions
            or self.serialization_format != SerializationFormat.TORCH_SAVE
        ):
            return cast(Future[list[WriteResult]], super()._write_data(planner, file_queue))
        results: queue.Queue[list[WriteResult]] = queue.Queue()
        failures: list[BaseException] = []

        def work() -> None:
            try:
                self._write_files(planner, file_queue, results)
            except BaseException as err:  # re-raised on the calling thread
                failures.append(err)

        threads = [threading.Thread(target=work) for _ in range(1, self.thread_count)]
        for thread in threads:
            thread.start()
        work()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        written: list[WriteResult] = []
        while not results.empty():
            written += results.get_nowait()
        future: Future[list[WriteResult]] = Future()
        future.set_result(written)
        return future

    def _loader(self, planner: SavePlanner) -> Any:
        """The tensor loader torch's writer would use (copies ahead from an accelerator)."""
        backend = getattr(torch, torch._C._get_privateuse1_backend_name(), None)
        accelerator = torch.cuda.is_available() or bool(backend and backend.is_available())
        if self.thread_count == 1 and accelerator and self.per_thread_copy_ahead > 0:
            return _filesystem._OverlappingCpuLoader(
                planner.resolve_data, inflight_threshhold=self.per_thread_copy_ahead
            )
        return _filesystem._SerialCpuLoader(planner.resolve_data)

    def _write_files(
        self, planner: SavePlanner, file_queue: queue.Queue[Any], results: queue.Queue[Any]
    ) -> None:
        """Write files from ``file_queue`` until it is empty: in each, the byte items, then
        the tensors, in plan order; then flush and sync (torch's order and guarantees)."""
        while True:
            try:
                path, storage_key, items = file_queue.get_nowait()
            except queue.Empty:
                return
            loader = self._loader(planner)
            for item in items:
                if item.type != WriteItemType.BYTE_IO:
                    loader.add(_filesystem._item_size(item), item)
            loader.start_loading()
            written = []
            with self.fs.create_stream(path, "wb") as stream:
                for item in items:
                    if item.type == WriteItemType.BYTE_IO:
                        data = planner.resolve_data(item)
                        written.append(self.write_record(stream, storage_key, item, data))
                for tensor, item in loader.values():
                    written.append(self.write_record(stream, storage_key, item, tensor))
                if self.sync_files:
                    _sync(stream)
            results.put(written)


def _sync(stream: Any) -> None:
    """Flush ``stream``'s buffer, then fsync its file; without a file descriptor, what the
    running torch does (``os.sync()``, or a warning)."""
    stream.flush()  # the buffer's tail, before the sync that commits it
    try:
        os.fsync(stream.fileno())
    except (AttributeError, io.UnsupportedOperation):
        if SYNC_WITHOUT_FD_CALLS_OS_SYNC:
            os.sync()
        else:
            warnings.warn(
                "A checkpoint file stream has no file descriptor to fsync; its data may not "
                "be durable until the OS writes it back.",
                stacklevel=2,
            )
