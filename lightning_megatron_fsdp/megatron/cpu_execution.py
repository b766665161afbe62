"""Run megatron-fsdp's experimental path on CPU, for tests and laptop debugging:
:func:`enable_cpu_execution` points the upstream modules' ``torch`` at a proxy whose CUDA
stream calls become no-op streams for non-CUDA devices, so megatron-fsdp's own code runs
unmodified on gloo while CUDA modules keep their real streams.
``tests/test_cpu_execution.py`` and ``tests/test_megatron_compat.py`` name the upstream
calls it stands in for.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["SyncEvent", "SyncStream", "cpu_execution_enabled", "enable_cpu_execution"]

_LOCK = threading.Lock()


def _is_cuda(device: Any) -> bool:
    """Return whether ``device`` (a device, string, index or ``None``) names CUDA.

    ``None`` and bare indices mean "the current CUDA device" in ``torch.cuda`` calls.
    """
    if device is None or isinstance(device, int):
        return True
    return torch.device(device).type == "cuda"


class SyncEvent:
    """Stand-in for ``torch.cuda.Event`` on a synchronous device: always complete."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record: work before this point has already run."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: the event is complete when created."""

    def synchronize(self) -> None:
        """Return at once; the event is complete."""

    def query(self) -> bool:
        """Return ``True``; the event is complete."""
        return True


class SyncStream:
    """Stand-in for ``torch.cuda.Stream`` on a device whose kernels run synchronously.

    Args:
        device: The (non-CUDA) device this stream orders work on.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def wait_stream(self, stream: Any) -> None:
        """No-op: earlier work on any stream has already completed."""

    def wait_event(self, event: Any) -> None:
        """No-op: every event is complete when recorded."""

    def record_event(self, event: Any = None) -> SyncEvent:
        """Return a completed event."""
        return event if event is not None else SyncEvent()

    def synchronize(self) -> None:
        """Return at once; nothing is pending."""

    def query(self) -> bool:
        """Return ``True``; nothing is pending."""
        return True

    def __eq__(self, other: object) -> bool:
        # One synchronous stream per device: megatron-fsdp 0.7 asserts that a buffer's
        # allocation stream *is equal to* the current stream before reusing it.
        return isinstance(other, SyncStream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(("SyncStream", self.device))

    def __repr__(self) -> str:
        return f"SyncStream(device={self.device})"


class _CudaProxy(types.ModuleType):
    """``torch.cuda`` as seen by megatron-fsdp's module code: CPU-aware, else forwarding."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self._device_stack = threading.local()
        nvtx_real = torch.cuda.nvtx if torch.version.cuda is not None else None
        self.nvtx = nvtx_real if nvtx_real is not None else _NoOpNvtx()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    def _stack(self) -> list[Any]:
        stack = getattr(self._device_stack, "stack", None)
        if stack is None:
            stack = self._device_stack.stack = []
        return stack

    @contextlib.contextmanager
    def device(self, device: Any) -> Iterator[None]:
        """``torch.cuda.device`` for CUDA; remembers a non-CUDA device for ``Stream()``."""
        self._stack().append(device)
        try:
            if _is_cuda(device):
                with torch.cuda.device(device):
                    yield
            else:
                yield
        finally:
            self._stack().pop()

    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - mirrors torch.cuda
        """A real CUDA stream, or a :class:`SyncStream` inside ``device(<non-CUDA>)``."""
        stack = self._stack()
        device = kwargs.get("device", args[0] if args else (stack[-1] if stack else None))
        if not _is_cuda(device):
            return SyncStream(device)
        return torch.cuda.Stream(*args, **kwargs)

    def current_stream(self, device: Any = None) -> Any:
        """The current CUDA stream, or a :class:`SyncStream` for a non-CUDA device."""
        if not _is_cuda(device):
            return SyncStream(device)
        return torch.cuda.current_stream(device)

    def stream(self, stream: Any) -> Any:
        """``torch.cuda.stream`` for a CUDA stream; nothing to switch for a SyncStream."""
        if isinstance(stream, SyncStream):
            return contextlib.nullcontext()
        return torch.cuda.stream(stream)


class _NoOpNvtx:
    """NVTX ranges for a torch build without CUDA, where the real ones raise."""

    @staticmethod
    def range_push(message: str) -> int:
        return 0

    @staticmethod
    def range_pop() -> int:
        return 0

    @staticmethod
    @contextlib.contextmanager
    def range(message: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        yield


class _TorchProxy(types.ModuleType):
    """The ``torch`` module with ``cuda`` replaced by :class:`_CudaProxy`."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaProxy()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _patched_modules() -> list[types.ModuleType]:
    """The upstream modules whose ``torch`` name the proxy replaces (see module docstring)."""
    from megatron_fsdp.experimental import module, parameter_group

    return [module, parameter_group]


def cpu_execution_enabled() -> bool:
    """Return whether :func:`enable_cpu_execution` has been applied in this process."""
    from megatron_fsdp.experimental import module

    return isinstance(module.torch, _TorchProxy)


def _record_sync_allocation_stream(init: Any) -> Any:
    """Wrap 0.7's ``DBuffer.__init__``: a non-CUDA buffer records its :class:`SyncStream`."""

    def init_recording_stream(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.allocation_stream is None and not self.local_buffer.is_cuda:
            self.allocation_stream = SyncStream(self.local_buffer.device)

    init_recording_stream._lmf_original = init  # type: ignore[attr-defined]
    return init_recording_stream


def enable_cpu_execution() -> None:
    """Let megatron-fsdp's experimental ``fully_shard`` path run forward, backward and
    optimizer steps on CPU tensors with a gloo process group.

    Idempotent and thread-safe; call it any time before sharding.
    Modules whose parameters live on CUDA are unaffected: every CUDA call still reaches
    the real ``torch.cuda`` (see the module docstring for the exact forwarding rules).
    ``MegatronFSDPStrategy`` and :func:`~lightning_megatron_fsdp.shard_module` call this
    for you when the device is not CUDA.

    Raises:
        RuntimeError: If another patch already replaced ``torch`` in megatron-fsdp.
    """
    from megatron_fsdp.experimental.dbuffer import DBuffer

    with _LOCK:
        modules = _patched_modules()
        if all(isinstance(m.torch, _TorchProxy) for m in modules):
            return
        for upstream in modules:
            if upstream.torch is not torch and not isinstance(upstream.torch, _TorchProxy):
                raise RuntimeError(
                    f"enable_cpu_execution: {upstream.__name__}.torch was replaced by "
                    f"{upstream.torch!r}, not by this adapter; refusing to stack another proxy "
                    "on it. Remove the other patch, or call enable_cpu_execution() first."
                )
        proxy = _TorchProxy()
        for upstream in modules:
            upstream.torch = proxy
        # 0.7 only: 0.6.1's DBuffer has no allocation stream.
        if "allocation_stream" in getattr(DBuffer, "__annotations__", {}) and not hasattr(
            DBuffer.__init__, "_lmf_original"
        ):
            DBuffer.__init__ = _record_sync_allocation_stream(DBuffer.__init__)
