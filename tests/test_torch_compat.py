"""Every private torch name our torch adapter relies on, one test each.

``lightning_megatron_fsdp/_torch.py`` is the only module that touches torch internals. When a
torch release renames or reshapes one, the library would fail somewhere deep inside a save
or load; these tests fail first, each naming the shim that needs updating and the torch name
it relies on. Behaviour that needs a process group runs once on one real gloo rank
(:func:`_probe`); the rest runs in the test process, with real DCP files.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from lightning_megatron_fsdp import _torch
from tests.harness import run_distributed
from tests.test_lightning_compat import private_attributes

VERSION = torch.__version__
TIMEOUT = 120.0


def _broken(shim: str, what: str) -> str:
    """The failure message: which shim breaks, on which torch, because of what."""
    return (
        f"torch {VERSION}: {what}. `_torch.{shim}` relies on it: update that shim (and this "
        "test) for this torch version, choosing the path by feature detection."
    )


# ---------------------------------------------------------------------------------------
# Behaviour on one gloo rank: DTensor internals, process-group internals
# ---------------------------------------------------------------------------------------


def _probe(rank: int, world_size: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    full = torch.arange(12.0).reshape(4, 3)
    dtensor = DTensor.from_local(full, mesh, [Shard(0)])
    local = _torch.local_tensor(dtensor)
    copy = torch.zeros_like(local)
    rebuilt = _torch.dtensor_with_local(dtensor, copy)
    group = dist.new_group(backend="gloo", timeout=__import__("datetime").timedelta(seconds=77))
    return {
        "local_is_the_shard": local.data_ptr() == dtensor.to_local().data_ptr(),
        "rebuilt_is_dtensor": isinstance(rebuilt, DTensor),
        "rebuilt_shares_copy": _torch.local_tensor(rebuilt).data_ptr() == copy.data_ptr(),
        "rebuilt_spec_equal": rebuilt.placements == dtensor.placements
        and rebuilt.shape == dtensor.shape,
        "group_timeout": _torch.group_timeout(group).total_seconds(),
    }


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    (result,) = run_distributed(_probe, 1, timeout=TIMEOUT)
    return result


def test_local_tensor(facts: dict[str, Any]) -> None:
    assert facts["local_is_the_shard"], _broken(
        "local_tensor", "DTensor._local_tensor is not the rank's shard"
    )


def test_dtensor_with_local(facts: dict[str, Any]) -> None:
    shim = "dtensor_with_local"
    assert facts["rebuilt_is_dtensor"], _broken(shim, "DTensor(local, spec) builds no DTensor")
    assert facts["rebuilt_shares_copy"], _broken(shim, "DTensor(local, spec) copied the local")
    assert facts["rebuilt_spec_equal"], _broken(shim, "DTensor._spec does not carry placements")


def test_group_timeout(facts: dict[str, Any]) -> None:
    assert facts["group_timeout"] == 77, _broken(
        "group_timeout",
        "ProcessGroup._get_backend(device).options._timeout does not report the group's timeout",
    )


# ---------------------------------------------------------------------------------------
# In-process: modules, state dicts, serialization, DCP storage
# ---------------------------------------------------------------------------------------


def test_own_parameters_and_buffers() -> None:
    module = nn.BatchNorm1d(3)
    child = nn.Sequential(module)
    assert set(_torch.own_parameters(module)) == {"weight", "bias"}, _broken(
        "own_parameters", "nn.Module._parameters is not the module's own parameter dict"
    )
    assert not _torch.own_parameters(child), _broken("own_parameters", "it holds children's")
    _torch.own_buffers(module)["running_mean"] = torch.ones(3)
    assert torch.equal(module.running_mean, torch.ones(3)), _broken(
        "own_buffers", "assigning into nn.Module._buffers does not replace the buffer"
    )


def test_random_sampler_num_samples() -> None:
    sampler_module = pytest.importorskip("torchdata.stateful_dataloader.sampler")
    sampler = sampler_module.RandomSampler(range(10))
    assert _torch.random_sampler_num_samples(sampler) is None, _broken(
        "random_sampler_num_samples", "RandomSampler._num_samples is not None by default"
    )
    sampler = sampler_module.RandomSampler(range(10), num_samples=4)
    assert _torch.random_sampler_num_samples(sampler) == 4, _broken(
        "random_sampler_num_samples", "RandomSampler._num_samples is not the argument"
    )


def test_fqns_of() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    compiled = torch.compile(model, backend="eager")
    assert _torch.fqns_of(compiled, "_orig_mod.0.weight") == {"0.weight"}, _broken(
        "fqns_of", "torch.distributed.checkpoint.state_dict._get_fqns keeps wrapper prefixes"
    )


def test_narrow_tensor_by_index() -> None:
    tensor = torch.arange(12).reshape(3, 4)
    part = _torch.narrow_tensor_by_index(tensor, [1, 2], [2, 2])
    assert torch.equal(part, tensor[1:3, 2:4]), _broken(
        "narrow_tensor_by_index", "torch.distributed._shard._utils.narrow_tensor_by_index moved"
    )


def test_local_chunks() -> None:
    tensor = torch.zeros(3, 4)
    (chunk,) = _torch.local_chunks(tensor)
    assert (tuple(chunk.offsets), tuple(chunk.sizes)) == ((0, 0), (3, 4)), _broken(
        "local_chunks", "torch.distributed.checkpoint.planner_helpers._create_chunk_list changed"
    )


def test_obj_state_and_backward_hooks() -> None:
    plain = torch.zeros(2)
    assert not _torch.obj_state(plain), _broken("obj_state", "torch._utils._get_obj_state")
    plain.extra = 1  # type: ignore[attr-defined]
    assert _torch.obj_state(plain), _broken("obj_state", "a tensor attribute is not state")
    hooked = torch.zeros(2, requires_grad=True)
    assert not _torch.has_backward_hooks(hooked)
    hooked.register_hook(lambda grad: grad)
    assert _torch.has_backward_hooks(hooked), _broken(
        "has_backward_hooks", "Tensor._backward_hooks does not hold registered hooks"
    )


def test_serialization_internals() -> None:
    assert _torch.serialization_skips_data() is False
    with torch.serialization.skip_data():
        assert _torch.serialization_skips_data() is True, _broken(
            "serialization_skips_data", "torch.serialization._serialization_tls.skip_data"
        )
    buffer = io.BytesIO()
    torch.save(torch.zeros(3), buffer)
    alignment = _torch.storage_alignment()
    assert isinstance(alignment, int) and alignment >= 1, _broken(
        "storage_alignment", "torch.serialization._get_storage_alignment"
    )


def test_fake_tensor_mode() -> None:
    with _torch.fake_tensor_mode():
        fake = torch.empty(1000, 1000)
    assert fake.shape == (1000, 1000) and type(fake) is not torch.Tensor, _broken(
        "fake_tensor_mode", "torch._subclasses.fake_tensor.FakeTensorMode"
    )


def _plain_save(path: Path) -> None:
    dcp.save({"a": torch.arange(6.0)}, storage_writer=FileSystemWriter(path), no_dist=True)


def test_caching_save_planner() -> None:
    """DCP's plan caching keys its class-level caches by ``_cached_plans_key``."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    shim = "caching_save_planner"
    planner = _torch.caching_save_planner("our key")
    assert isinstance(planner, DefaultSavePlanner)
    assert planner._enable_plan_caching is True, _broken(shim, "enable_plan_caching is gone")
    source = inspect.getsource(DefaultSavePlanner)
    assert source.count("self._cached_plans_key") >= 3 and planner._cached_plans_key == "our key", (
        _broken(shim, "DefaultSavePlanner no longer keys its plan caches by _cached_plans_key")
    )
    # The coordinator's step is the method both of DCP's paths (cached or not) call.
    calls = [
        inspect.getsource(getattr(DefaultSavePlanner, name))
        for name in ("create_global_plan", "_create_global_plan_with_caching")
    ]
    assert "self._create_global_plan(" in calls[1] and "_create_global_plan" in calls[0], _broken(
        shim, "DefaultSavePlanner no longer plans globally in _create_global_plan"
    )
    seen = []
    ours = _torch.caching_save_planner("hooked", lambda plans, **kw: seen.append(kw) or ([], 0))
    assert ours.create_global_plan([]) == ([], 0)
    assert seen == [{"merge_planner_data": True, "to_lowest_rank": False}]


def test_storage_info_and_metadata_path(tmp_path: Path) -> None:
    _plain_save(tmp_path)
    reader = FileSystemReader(tmp_path)
    assert Path(_torch.metadata_path(reader)) == tmp_path / ".metadata", _broken(
        "metadata_path", "FileSystemReader._get_metadata_path"
    )
    stored = next(iter(reader.read_metadata().storage_data.values()))
    made = _torch.storage_info(stored.relative_path, stored.offset, stored.length)
    assert type(made) is type(stored) and made == stored, _broken(
        "storage_info", "filesystem._StorageInfo(relative_path, offset, length)"
    )


def test_create_file_view(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"0123456789")
    with open(tmp_path / "f", "rb") as file:
        file.seek(3)
        view = _torch.create_file_view(file, 3, 4)
        assert view.read() == b"3456", _broken(
            "create_file_view", "torch.distributed.checkpoint.utils._create_file_view"
        )


def test_transformed_stream() -> None:
    import zstandard
    from torch.distributed.checkpoint._extension import ZStandard

    stored = io.BytesIO(zstandard.ZstdCompressor().compress(b"record " * 100))
    stream = _torch.transformed_stream([ZStandard().get_descriptor()], stored)
    assert stream.read(7) == b"record " and stream.read() == b"record " * 99, _broken(
        "transformed_stream", "filesystem._StorageReaderTransforms.transform_load_stream"
    )
    with pytest.raises(ValueError, match="Unknown extension"):
        _torch.transformed_stream(["stream.unknown/1"], io.BytesIO())


# ---------------------------------------------------------------------------------------
# The copied write loop
# ---------------------------------------------------------------------------------------


def test_write_loop_hook_and_helpers() -> None:
    """``OwnWriteLoopWriter`` overrides ``FileSystemWriter._write_data(planner, file_queue)``
    and uses torch's loaders and item sizes."""
    shim = "OwnWriteLoopWriter"
    parameters = list(inspect.signature(FileSystemWriter._write_data).parameters)
    assert parameters == ["self", "planner", "file_queue"], _broken(
        shim, f"FileSystemWriter._write_data takes {parameters}"
    )
    for name in ("_item_size", "_OverlappingCpuLoader", "_SerialCpuLoader"):
        assert hasattr(dcp_filesystem, name), _broken(shim, f"filesystem.{name} is gone")
    assert isinstance(torch._C._get_privateuse1_backend_name(), str), _broken(
        shim, "torch._C._get_privateuse1_backend_name"
    )


class _Unsynced(io.BytesIO):
    """An in-memory write stream (no file descriptor) that lands in its file on close."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def close(self) -> None:
        if not self.closed:
            self.path.write_bytes(self.getvalue())
        super().close()


class _NoDescriptorFileSystem(FileSystem):
    """torch's local FileSystem whose write streams have no file descriptor, as a network
    or object-store stream has none."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:  # type: ignore[override]
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        stream = _Unsynced(Path(path))
        try:
            yield stream
        finally:
            stream.close()


class _OwnLoop(_torch.OwnWriteLoopWriter):
    def write_record(self, stream: Any, storage_key: str, item: Any, data: Any) -> WriteResult:
        offset = stream.tell()
        if item.type == WriteItemType.BYTE_IO:
            stream.write(data.getbuffer())
        else:
            torch.save(data, stream)
        length = stream.tell() - offset
        return WriteResult(
            index=item.index,
            size_in_bytes=length,
            storage_data=_torch.storage_info(storage_key, offset, length),
        )


def _warnings_of_a_save(writer: FileSystemWriter) -> list[str]:
    writer.fs = _NoDescriptorFileSystem()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save({"a": torch.arange(6.0)}, storage_writer=writer, no_dist=True)
    # torch's own: "fsync not supported for this stream, ..."; ours names the descriptor.
    return [
        str(w.message)
        for w in caught
        if "fsync" in str(w.message).lower() or "descriptor" in str(w.message).lower()
    ]


def test_write_loop_syncs_like_the_running_torch(tmp_path: Path) -> None:
    """Without a file descriptor, our copy of the loop does what torch's own does: call
    ``os.sync()`` (torch < 2.14) or warn (torch >= 2.14), by the feature detected."""
    torch_warns = bool(_warnings_of_a_save(FileSystemWriter(tmp_path / "torch")))
    ours_warns = bool(_warnings_of_a_save(_OwnLoop(tmp_path / "ours")))
    shim = "SYNC_WITHOUT_FD_CALLS_OS_SYNC"
    assert ours_warns == torch_warns, _broken(
        shim,
        f"torch's write loop {'warns' if torch_warns else 'calls os.sync()'} without a "
        f"file descriptor, ours {'warns' if ours_warns else 'does not warn'}",
    )
    assert _torch.SYNC_WITHOUT_FD_CALLS_OS_SYNC is not torch_warns, _broken(
        shim, "the flag does not match the loop's behaviour"
    )
    loaded = {"a": torch.zeros(6)}
    dcp.load(loaded, storage_reader=FileSystemReader(tmp_path / "ours"), no_dist=True)
    assert torch.equal(loaded["a"], torch.arange(6.0))


def test_dcp_metadata_private_types(tmp_path: Path) -> None:
    """The private names a real ``.metadata`` pickle references are the ones the allow-list
    resolves, by the same module and name, to the same objects."""
    import pickle

    dcp.save({"w": torch.ones(2, 3)}, storage_writer=FileSystemWriter(tmp_path))
    referenced: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):  # our own fresh file: safe to unpickle in full
        def find_class(self, module: str, name: str) -> Any:
            referenced.add((module, name))
            return super().find_class(module, name)

    Recording(io.BytesIO((tmp_path / ".metadata").read_bytes())).load()
    private = {key for key in referenced if key[1].startswith("_")}
    types = _torch.dcp_metadata_private_types()
    assert private <= set(types), _broken(
        "dcp_metadata_private_types", f"torch {VERSION} pickles {sorted(private - set(types))}"
    )
    for (module, name), value in types.items():
        assert getattr(__import__(module, fromlist=[name]), name) is value, (module, name)
    assert types[("torch.serialization", "_get_layout")]("torch.strided") is torch.strided
    encoding = types[("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")]
    assert encoding.TORCH_CONTIGUOUS_FORMAT in encoding


def test_checkpointable_tensor_protocol_flag(tmp_path: Path) -> None:
    """The flag says whether DCP really saves a plain tensor carrying the protocol's fields
    as a shard of its global tensor: one row saved as row 1 of a 2-row tensor."""
    shard = torch.full((1, 3), 7.0)
    shard.global_shape = (2, 3)
    shard.global_offsets = ((1, 0),)
    shard.local_offsets = ((0, 0),)
    shard.local_sizes = ((1, 3),)
    dcp.save({"w": shard}, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    saved = FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"]
    honoured = tuple(saved.size) == (2, 3) and [tuple(c.offsets) for c in saved.chunks] == [(1, 0)]
    assert honoured or tuple(saved.size) == (1, 3), saved  # else: a plain tensor
    assert honoured == _torch.CHECKPOINTABLE_TENSOR_PROTOCOL, _broken(
        "CHECKPOINTABLE_TENSOR_PROTOCOL",
        f"DCP {'honours' if honoured else 'ignores'} the CheckpointableTensor fields, the "
        "flag says otherwise (planner_helpers._create_write_items changed)",
    )
    assert hasattr(dcp, "CheckpointableTensor") == _torch.CHECKPOINTABLE_TENSOR_PROTOCOL


def test_this_module_covers_every_private_name_of_the_adapter() -> None:
    """Every private torch name ``_torch.py`` uses has a test above."""
    tree = ast.parse(inspect.getsource(_torch))
    used = private_attributes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            used |= {a.name for a in node.names if a.name.startswith("_")}
            if any(p.startswith("_") for p in (node.module or "").split(".")):
                used.add(node.module or "")
    used -= {"__name__", "__future__"}
    covered = {
        "_local_tensor",
        "_spec",
        "_device_types",
        "_get_backend",
        "_timeout",
        "_parameters",
        "_buffers",
        "_num_samples",
        "_get_fqns",
        "_create_chunk_list",
        "torch.distributed._shard._utils",
        "_utils",
        "_get_obj_state",
        "_serialization_tls",
        "_get_storage_alignment",
        "_backward_hooks",
        "torch._subclasses.fake_tensor",
        "_StorageInfo",
        "_get_metadata_path",
        "_create_file_view",
        "_StorageReaderTransforms",
        "_write_files_from_queue",
        "_write_data",
        "_C",
        "_get_privateuse1_backend_name",
        "_OverlappingCpuLoader",
        "_SerialCpuLoader",
        "_item_size",
        "_filesystem",
        "_write_files",
        "_loader",
        "_sync_without_fd_calls_os_sync",
        "_cached_plans_key",
        "_create_global_plan",
        "_MEM_FORMAT_ENCODING",
        "_get_layout",
        "_create_write_items",
        "_dcp_plans_checkpointable_tensors",
    }
    assert used <= covered, f"add tests for {sorted(used - covered)} to {__name__}"
