"""Integrity checksums of checkpoint files: CRC32C, and sha256 for format-1 checkpoints.

A checkpoint must be checkable for bit rot, truncation and files swapped in from another
run without extra passes over its bytes: CRC32C is computed as records are written, and
:func:`crc32c_combine` derives a file's CRC from its records' without reading it back.
Checksums guard against accidents, not forgery (docs/DESIGN.md, "On-disk format": why
CRC32C and the ``crc32c`` package, and the alternatives).
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

import crc32c as _crc32c

from lightning_megatron_fsdp.storage.confined_files import open_regular

__all__ = [
    "ALGORITHMS",
    "bytes_digest",
    "crc32c",
    "crc32c_combine",
    "crc32c_hex",
    "file_digest",
    "stream_digest",
]

ALGORITHMS = ("crc32c", "sha256")
"""Digest algorithms a manifest may name: ``crc32c`` (format 2) and ``sha256`` (format 1)."""

_BLOCK = 8 << 20
_POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected


def crc32c(data: Any, value: int = 0) -> int:
    """CRC32C of ``data`` (any contiguous buffer), continuing from ``value``.

    ``crc32c(b + c) == crc32c(c, crc32c(b))``; ``crc32c(b"") == 0``.
    """
    return _crc32c.crc32c(data, value)


def crc32c_hex(value: int) -> str:
    """The manifest's form of a CRC32C: 8 lowercase hex digits."""
    return f"{value:08x}"


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC polynomial, both bit-reflected (zlib's ``multmodp``)."""
    m = 1 << 31
    product = 0
    while True:
        if a & m:
            product ^= b
            if a & (m - 1) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


@functools.cache
def _power(k: int) -> int:
    """``x ** (2 ** k)`` modulo the polynomial (reflected)."""
    return 1 << 30 if k == 0 else _multiply(_power(k - 1), _power(k - 1))


@functools.cache
def _byte_tables(k: int) -> tuple[tuple[int, ...], ...]:
    """Four 256-entry tables of ``v -> v * x ** (8 * 2 ** k)``, one per byte of ``v``.

    Multiplying by a constant is linear over GF(2), so the product of a 32-bit value is
    the XOR of its four bytes' products: four lookups instead of a 32-step loop. Built
    from 32 single-bit products, once per ``k`` per process.
    """
    constant = _power(k + 3)  # 8 * 2**k bits = 2**k bytes
    tables = []
    for byte in range(4):
        bits = [_multiply(constant, 1 << (8 * byte + bit)) for bit in range(8)]
        table = [0] * 256
        for value in range(1, 256):
            low = value & -value
            table[value] = table[value ^ low] ^ bits[low.bit_length() - 1]
        tables.append(tuple(table))
    return tuple(tables)


def crc32c_combine(first: int, second: int, second_length: int) -> int:
    """CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``.

    Shifts ``first`` past ``second_length`` zero bytes (one table step per set bit of the
    length, a few dozen integer operations) and adds ``second``. Lets a writer
    hash each record once and still record the whole file's CRC.
    """
    if second_length < 0:
        raise ValueError(f"crc32c_combine: length must be >= 0, got {second_length}.")
    value, k = first, 0
    while second_length:
        if second_length & 1:
            t0, t1, t2, t3 = _byte_tables(k)
            value = (
                t0[value & 0xFF]
                ^ t1[(value >> 8) & 0xFF]
                ^ t2[(value >> 16) & 0xFF]
                ^ t3[value >> 24]
            )
        second_length >>= 1
        k += 1
    return value ^ second


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}.")


def bytes_digest(data: Any, algorithm: str) -> str:
    """Hex digest of an in-memory buffer (a small file read whole), as :func:`file_digest`.

    Raises:
        ValueError: For an algorithm not in :data:`ALGORITHMS`.
    """
    _check_algorithm(algorithm)
    if algorithm == "crc32c":
        return crc32c_hex(crc32c(data))
    return hashlib.sha256(data).hexdigest()


def file_digest(path: str | os.PathLike[str], algorithm: str) -> str:
    """Hex digest of a whole file, read once in 8 MiB blocks.

    Args:
        path: The file.
        algorithm: ``"crc32c"`` (8 hex digits) or ``"sha256"`` (64).

    Raises:
        ValueError: For another algorithm.
        OSError: If the file cannot be read.
    """
    path = os.fspath(path)
    fd = open_regular(os.path.dirname(path) or ".", os.path.basename(path))
    with open(fd, "rb", buffering=0) as file:
        return stream_digest(file, algorithm)


def stream_digest(file: Any, algorithm: str) -> str:
    """Hex digest of what remains of a binary file object (one with ``readinto``: a local
    file, an fsspec file), read once in 8 MiB blocks.

    Raises:
        ValueError: For another algorithm than ``"crc32c"`` or ``"sha256"``.
    """
    _check_algorithm(algorithm)
    buffer = bytearray(_BLOCK)
    view = memoryview(buffer)
    value = 0
    digest = hashlib.sha256() if algorithm == "sha256" else None
    while n := file.readinto(buffer):
        if digest is None:
            value = crc32c(view[:n], value)
        else:
            digest.update(view[:n])
    return crc32c_hex(value) if digest is None else digest.hexdigest()
