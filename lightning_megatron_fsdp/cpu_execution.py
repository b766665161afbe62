"""Run Megatron-FSDP's experimental path on CPU, for tests and laptop debugging.

Problem: ``megatron_fsdp.experimental.module.FsdpContext`` creates two
``torch.cuda.Stream`` objects, and ``FsdpModule`` brackets every unshard, reshard
and gradient reduction in ``torch.cuda.stream(...)``, stream waits, events and NVTX
ranges. On a CPU-only build each of those raises, so forward never starts, although
everything underneath (``DBuffer``, gloo collectives, DCP) works on CPU.

Fix: :func:`enable_cpu_execution` points the ``torch`` name inside
``megatron_fsdp.experimental.module`` at a thin proxy. Every attribute forwards to the
real ``torch`` except ``torch.cuda``, which forwards to the real ``torch.cuda`` too,
unless the call concerns a non-CUDA device or one of our stand-in streams:

* ``cuda.device(d)`` / ``cuda.Stream()``: for a non-CUDA ``d`` the stream is a
  :class:`SyncStream`, whose waits and events are no-ops because CPU kernels run
  synchronously, in program order, on the calling thread.
* ``cuda.current_stream(d)`` / ``cuda.stream(s)``: a :class:`SyncStream` for a CPU
  device, a ``nullcontext`` for a :class:`SyncStream`.
* ``cuda.nvtx``: the real ranges when torch was built with CUDA, no-ops otherwise.

So CUDA modules keep real streams and ordering bit for bit (the proxy only forwards),
and CPU modules run megatron-fsdp's own code, unmodified, in program order.

Alternatives rejected:
    * Patching ``torch.cuda.Stream`` and friends globally: would change every other
      library in the process, CUDA users included.
    * Re-implementing ``FsdpModule``'s forward/backward hooks without streams: a
      second copy of the scheduling logic, which would drift from the real one and
      test our copy instead of megatron-fsdp.
    * A ``FsdpContext`` subclass: ``FsdpModule._lazy_init_context`` constructs the
      class by name inside the module, and the hook bodies still call
      ``torch.cuda.stream`` and ``torch.cuda.nvtx`` directly.
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


def cpu_execution_enabled() -> bool:
    """Return whether :func:`enable_cpu_execution` has been applied in this process."""
    from megatron_fsdp.experimental import module

    return isinstance(module.torch, _TorchProxy)


def enable_cpu_execution() -> None:
    """Let megatron-fsdp's experimental ``fully_shard`` path run forward, backward and
    optimizer steps on CPU tensors with a gloo process group.

    Idempotent and thread-safe; call it any time before the first forward. Modules
    whose parameters live on CUDA are unaffected: every CUDA call still reaches the
    real ``torch.cuda`` (see the module docstring for the exact forwarding rules).
    ``MegatronFSDPStrategy`` calls this for you when the accelerator is CPU.
    """
    from megatron_fsdp.experimental import module

    with _LOCK:
        if isinstance(module.torch, _TorchProxy):
            return
        if module.torch is not torch:
            raise RuntimeError(
                "enable_cpu_execution: megatron_fsdp.experimental.module.torch was replaced "
                f"by {module.torch!r}, not by this adapter; refusing to stack another proxy "
                "on it. Remove the other patch, or call enable_cpu_execution() first."
            )
        module.torch = _TorchProxy()
