"""Byte-exact ``torch.save`` records of one tensor, without a ``torch.save`` per tensor.

DCP stores every tensor of a rank as one record, a complete ``torch.save`` zip, and each
``torch.save`` pays a fixed Python cost that, over hundreds of records, dominates a save
and holds the GIL an async save's training thread needs. A record depends on the tensor's
bytes only through the zip's CRC-32, so the first record of each kind of tensor is
``torch.save``'s own output, kept as a template, and later ones are that template with the
payload and its CRC-32 patched in; anything unusual still goes to ``torch.save``
(docs/DESIGN.md, "Tensor records": the mechanism, why it is safe, the alternatives).
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import re
import struct
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from lightning_megatron_fsdp import _torch

try:  # ISA-L's CRC-32 (carry-less multiply): faster than zlib's, same values, GIL released
    from isal.isal_zlib import crc32 as _payload_crc32
except ImportError:  # pragma: no cover - a platform without isal wheels
    from zlib import crc32 as _payload_crc32

__all__ = ["TensorRecords", "shared_records"]

_BLOCK = 1 << 20
"""Bytes per step of the payload loop: CRC-32, then the stream's CRC32C and write, while
the block is still in cache."""

_MAX_PAYLOAD = 1 << 31
"""Payloads from here on may need zip64 fields; they are written by ``torch.save``."""

_SMALL = 4096
"""Writes up to this size are copied by the capture even if they are the payload (the
pickle and every zip header are far smaller than a payload above it)."""

_MAX_TEMPLATES = 4096
_MASK64 = (1 << 64) - 1
_STORAGE_NAME = re.compile(r"(?:^|/)data/\d+$")
_ID_NAME = re.compile(r"(?:^|/)\.data/serialization_id$")
_LOCAL = b"PK\x03\x04"
_CENTRAL = b"PK\x01\x02"
_DESCRIPTOR = b"PK\x07\x08"
_END = b"PK\x05\x06"


def _hash_combine(seed: int, value: int) -> int:
    """``c10::hash_combine`` on 64-bit ``size_t``: how torch folds the entries' CRC-32s
    into the serialization id."""
    return seed ^ ((value + 0x9E3779B9 + ((seed << 6) & _MASK64) + (seed >> 2)) & _MASK64)


@dataclasses.dataclass(frozen=True)
class _Template:
    """One kind of tensor's ``torch.save`` record around its payload."""

    prefix: bytes
    suffix: bytes
    header: int
    """Record offset of the payload's zip local header."""
    descriptor: int
    """Suffix offset of the payload's data-descriptor CRC field."""
    central: tuple[int, int]
    """Suffix offsets of the central-directory CRC fields of the payload and the id."""
    id_digits: int
    """Suffix offset of the id's last 20 digits (the combined CRCs)."""
    id_descriptor: int
    """Suffix offset of the id's data-descriptor CRC field."""
    crcs: tuple[int, ...]
    """CRC-32 of every entry before the id, in archive order."""
    payload_index: int
    """Which of :attr:`crcs` is the payload's."""

    @property
    def payload(self) -> int:
        """Record offset of the payload."""
        return len(self.prefix)

    def render(self, crc: int) -> bytes:
        """The bytes after a payload whose CRC-32 is ``crc``."""
        combined = 0
        for index, value in enumerate(self.crcs):
            combined = _hash_combine(combined, crc if index == self.payload_index else value)
        suffix = bytearray(self.suffix)
        suffix[self.id_digits : self.id_digits + 20] = b"%020d" % combined
        id_crc = zlib.crc32(suffix[self.id_digits - 20 : self.id_digits + 20])
        struct.pack_into("<I", suffix, self.descriptor, crc)
        struct.pack_into("<I", suffix, self.central[0], crc)
        struct.pack_into("<I", suffix, self.id_descriptor, id_crc)
        struct.pack_into("<I", suffix, self.central[1], id_crc)
        return bytes(suffix)


def _parse(prefix: bytes, nbytes: int, suffix: bytes) -> _Template | None:
    """The template of the record ``prefix + <nbytes of payload> + suffix``, or ``None``
    if it does not have exactly the layout :class:`_Template` patches."""
    end = len(prefix) + nbytes  # record offset where the suffix starts
    if len(suffix) < 22 or suffix[-22:-18] != _END:
        return None
    count, size, start, comment = struct.unpack_from("<HIIH", suffix, len(suffix) - 12)
    # Between the central directory and the end record: miniz's zip64 end record and
    # locator (constant for a kind, so part of the template).
    if comment or start < end or start - end + size > len(suffix) - 22:
        return None
    at = start - end
    entries = []
    for _ in range(count):
        if suffix[at : at + 4] != _CENTRAL:
            return None
        crc, compressed, uncompressed, name_length, extra_length, comment_length = (
            struct.unpack_from("<IIIHHH", suffix, at + 16)
        )
        (local,) = struct.unpack_from("<I", suffix, at + 42)
        name = suffix[at + 46 : at + 46 + name_length].decode("utf-8", "replace")
        if compressed != uncompressed or extra_length or comment_length:
            return None
        entries.append((name, crc, uncompressed, local, at + 16))
        at += 46 + name_length
    storages = [i for i, e in enumerate(entries) if _STORAGE_NAME.search(e[0])]
    if len(storages) != 1 or not entries or not _ID_NAME.search(entries[-1][0]):
        return None
    index = storages[0]
    _, crc, size, header, central = entries[index]
    if size != nbytes or header + 30 > len(prefix) or prefix[header : header + 4] != _LOCAL:
        return None
    flags, method = struct.unpack_from("<HH", prefix, header + 6)
    name_length, extra_length = struct.unpack_from("<HH", prefix, header + 26)
    if method or not flags & 0x08 or header + 30 + name_length + extra_length != len(prefix):
        return None
    if suffix[:4] != _DESCRIPTOR or struct.unpack_from("<III", suffix, 4) != (crc, size, size):
        return None
    _, id_crc, id_size, id_header, id_central = entries[-1]
    at = id_header - end
    if at < 0 or suffix[at : at + 4] != _LOCAL or id_size != 40:
        return None
    name_length, extra_length = struct.unpack_from("<HH", suffix, at + 26)
    digits = at + 30 + name_length + extra_length
    descriptor = digits + 40
    if suffix[descriptor : descriptor + 4] != _DESCRIPTOR:
        return None
    if not suffix[digits:descriptor].isdigit() or zlib.crc32(suffix[digits:descriptor]) != id_crc:
        return None
    template = _Template(
        prefix=prefix,
        suffix=suffix,
        header=header,
        descriptor=4,
        central=(central, id_central),
        id_digits=digits + 20,
        id_descriptor=descriptor + 4,
        crcs=tuple(e[1] for e in entries[:-1]),
        payload_index=index,
    )
    return template if template.render(crc) == suffix else None


class _Forward(io.RawIOBase):
    """A stream that hands every write to ``write``."""

    def __init__(self, write: Callable[[Any], Any]) -> None:
        super().__init__()
        self._write = write

    @override
    def writable(self) -> bool:
        return True

    @override
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._write(view)
        return view.nbytes


class _Capture(_Forward):
    """The stream ``torch.save`` writes a learning record to: forwards every write and
    keeps a copy of each but the payload (the one write of exactly ``nbytes`` bytes, above
    :data:`_SMALL`)."""

    def __init__(self, write: Callable[[Any], Any], nbytes: int) -> None:
        super().__init__(write)
        self._nbytes = nbytes
        self.before = bytearray()
        self.after = bytearray()
        self.skipped = False

    @override
    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._write(view)
        if not self.skipped and view.nbytes == self._nbytes and self._nbytes > _SMALL:
            self.skipped = True
        else:
            (self.after if self.skipped else self.before).extend(view)
        return view.nbytes


def _kind(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What a tensor's record depends on besides its bytes, or ``None`` if it must be
    written by ``torch.save`` (see the module docstring)."""
    if (
        type(tensor) is not torch.Tensor
        or tensor.layout != torch.strided
        or tensor.device.type != "cpu"
        or tensor.is_quantized
        or tensor.is_conj()
        or tensor.is_neg()
        or _torch.has_backward_hooks(tensor)
        or tensor.storage_offset() != 0
        or not tensor.is_contiguous()
    ):
        return None
    nbytes = tensor.numel() * tensor.element_size()
    if not 0 < nbytes < _MAX_PAYLOAD or tensor.untyped_storage().nbytes() != nbytes:
        return None
    if _torch.obj_state(tensor):
        return None
    if _torch.serialization_skips_data() or not torch.serialization.get_crc32_options():
        return None
    return (
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
        tensor.requires_grad,
        _torch.storage_alignment(),
        sys.byteorder,
    )


def _tensor_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor of at least one element; the view (and each
    slice of it) keeps the tensor alive."""
    nbytes = tensor.numel() * tensor.element_size()
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array.tensor = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")


class TensorRecords:
    """Writes tensor records byte-identical to ``torch.save(tensor, stream)``.

    One instance serves a process (:func:`shared_records`): templates learnt in one save
    serve the next. Thread-safe.
    """

    def __init__(self) -> None:
        self._templates: dict[tuple[Any, ...], _Template | None] = {}
        self._lock = threading.Lock()
        self._calibrated: bool | None = None

    def write(
        self,
        tensor: torch.Tensor,
        write: Callable[[Any], Any],
        *,
        raw: Callable[[Any], Any] | None = None,
        storage: Callable[[int, int], None] | None = None,
    ) -> bool:
        """Write ``tensor``'s ``torch.save`` record.

        Args:
            tensor: The tensor (DCP's writer hands CPU tensors).
            write: Called with each piece ``torch.save`` writes, when it writes the record.
            raw: Called instead of ``write`` with the pieces of a record a template
                writes (``write`` if ``None``): the prefix, the payload in blocks of
                :data:`_BLOCK`, the rendered suffix.
            storage: Called with the record offsets of the payload's zip local header and
                of the payload when a template wrote the record.

        Returns:
            Whether a template wrote the record (else ``torch.save`` did).
        """
        kind = _kind(tensor)
        template = self._template(kind) if kind is not None else None
        if template is None:
            self._save(tensor, write, kind)
            return False
        raw = write if raw is None else raw
        raw(template.prefix)
        crc = 0
        view = _tensor_view(tensor)
        for start in range(0, view.nbytes, _BLOCK):
            block = view[start : start + _BLOCK]
            crc = _payload_crc32(block, crc)
            raw(block)
        raw(template.render(crc))
        if storage is not None:
            storage(template.header, template.payload)
        return True

    def _template(self, kind: tuple[Any, ...]) -> _Template | None:
        if self._calibrated is None:
            self._calibrated = _calibrate()
        return self._templates.get(kind) if self._calibrated else None

    def _save(
        self, tensor: torch.Tensor, write: Callable[[Any], Any], kind: tuple[Any, ...] | None
    ) -> None:
        """``torch.save`` the record; learn its template if it is of a new kind."""
        learn = (
            kind is not None
            and self._calibrated
            and kind not in self._templates
            and len(self._templates) < _MAX_TEMPLATES
        )
        if not learn:
            torch.save(tensor, _Forward(write))
            return
        nbytes = tensor.numel() * tensor.element_size()
        capture = _Capture(write, nbytes)
        torch.save(tensor, capture)
        template = _learn(capture, tensor, nbytes)
        with self._lock:
            self._templates.setdefault(kind, template)  # type: ignore[arg-type]


def _learn(capture: _Capture, tensor: torch.Tensor, nbytes: int) -> _Template | None:
    """The template of the record ``capture`` saw, kept only if rendering it with the CRC-32
    of the tensor's own bytes gives back exactly what ``torch.save`` wrote."""
    view = _tensor_view(tensor)
    crc = _payload_crc32(view)
    if capture.skipped:
        candidates = [(bytes(capture.before), bytes(capture.after))]
    else:  # a small payload was copied with the rest: it starts at a 64-byte boundary
        record = bytes(capture.before)
        candidates = [
            (record[:offset], record[offset + nbytes :])
            for offset in range(0, len(record) - nbytes + 1, 64)
            if record[offset : offset + nbytes] == view
        ]
    for prefix, suffix in candidates:
        template = _parse(prefix, nbytes, suffix)
        if template is not None and template.render(crc) == suffix:
            return template
    return None


def _calibrate() -> bool:
    """Whether templates reproduce ``torch.save`` in this process: the record of one
    tensor rendered from another's template (same kind, other values, a payload above
    :data:`_SMALL`) must equal ``torch.save``'s own, byte for byte."""
    first = torch.arange(1100, dtype=torch.float32)
    second = first.flip(0) * 3
    saved = []
    for tensor in (first, second):
        buffer = io.BytesIO()
        torch.save(tensor, buffer)
        saved.append(buffer.getvalue())
    capture = _Capture(lambda piece: None, first.numel() * 4)
    torch.save(first, capture)
    template = _learn(capture, first, first.numel() * 4)
    if template is None:
        return False
    payload = _tensor_view(second)
    rendered = template.prefix + bytes(payload) + template.render(zlib.crc32(payload))
    return rendered == saved[1] and saved[0] != saved[1]


_SHARED = TensorRecords()


def shared_records() -> TensorRecords:
    """The process's :class:`TensorRecords` (its templates serve every save)."""
    return _SHARED
