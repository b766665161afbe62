"""The load's concurrent ranged reads against a real S3-compatible server (SeaweedFS,
``tests/object_store.py``): ``read_ranges`` hands back each range's bytes exactly and in
the order asked, never has more than its window of GETs taken, hands back a range past an
object's end short (and the load's stream then fills short, which ``_read_batch`` refuses
naming the object), and a stopped server fails it within the deadline with one
:class:`TimeoutError` naming the object, after which nothing more is sent.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from typing import Any

import pytest

from lightning_megatron_fsdp.storage.fsspec_storage import _cut, _RangeStream
from lightning_megatron_fsdp.storage.object_store import DeadlineFileSystem, read_ranges
from tests.object_store import SeaweedServer


def _objects(seaweed: SeaweedServer, sizes: list[int]) -> tuple[Any, dict[str, bytes]]:
    """A fresh s3fs filesystem and objects of random bytes of ``sizes`` in a new bucket."""
    fs = seaweed.filesystem()
    bucket = seaweed.new_bucket()
    objects = {f"{bucket}/shards/__{i}_0.distcp": os.urandom(size) for i, size in enumerate(sizes)}
    for path, data in objects.items():
        fs.pipe_file(path, data)
    return fs, objects


def _ranges(objects: dict[str, bytes], seed: int) -> list[tuple[str, int, int]]:
    """Every object cut at random places, the objects' ranges interleaved."""
    rng = random.Random(seed)
    per_object = []
    for path, data in objects.items():
        cuts = sorted({0, 1, len(data), *(rng.randrange(len(data)) for _ in range(12))})
        per_object.append([(path, a, b) for a, b in itertools.pairwise(cuts)])
    ranges = []
    while any(per_object):
        for pieces in per_object:
            if pieces:
                ranges.append(pieces.pop(0))
    return ranges


@pytest.mark.parametrize("window", [1, 3, 8])
def test_ranged_reads_return_each_range_in_order_within_the_window(
    seaweed: SeaweedServer, window: int
) -> None:
    fs, objects = _objects(seaweed, [3_000_001, 5 << 20, 1_000])
    ranges = _ranges(objects, seed=window)
    taken = 0

    def counted() -> Any:
        nonlocal taken
        for byte_range in ranges:
            taken += 1
            yield byte_range

    got = []
    for index, data in enumerate(read_ranges(fs, counted(), window=window)):
        # the range handed back, the one after it being read, and at most window - 1 more
        assert taken <= index + 1 + window, (taken, index, window)
        got.append(data)
    assert len(got) == len(ranges)
    for (path, start, end), data in zip(ranges, got, strict=True):
        assert data == objects[path][start:end], (path, start, end)


def test_a_range_past_the_end_comes_back_short_and_the_stream_fills_short(
    seaweed: SeaweedServer,
) -> None:
    fs, objects = _objects(seaweed, [1 << 20])
    ((path, data),) = objects.items()
    half = len(data) // 2
    ranges = [(path, 0, half), (path, half, half + len(data))]  # the second: past the end
    stream = _RangeStream(ranges, read_ranges(fs, ranges, window=2))
    first, second = bytearray(100), bytearray(len(data) + half - 100)
    assert stream.read_at(path, [first, second], 0) == len(data)
    assert bytes(first + second[: len(data) - 100]) == data


def test_a_span_is_cut_into_ranges_that_tile_it_and_an_empty_one_into_none() -> None:
    """An empty span sends no GET: S3 answers an empty ``Range`` with the whole object."""
    assert _cut("b/o", 7, 7) == []
    for start, end in [(0, 1), (3, (4 << 20) + 3), (0, 10 << 20), (5, (13 << 20) + 1)]:
        pieces = _cut("b/o", start, end)
        assert pieces[0][1] == start and pieces[-1][2] == end
        assert all(a[2] == b[1] for a, b in itertools.pairwise(pieces))
        assert all(0 < stop - begin <= 6 << 20 for _, begin, stop in pieces)


def test_ranged_reads_of_a_stopped_server_fail_within_the_deadline(
    seaweed: SeaweedServer,
) -> None:
    fs, objects = _objects(seaweed, [8 << 20])
    ((path, data),) = objects.items()
    ranges = [(path, at, at + (1 << 20)) for at in range(0, len(data), 1 << 20)]
    deadline = DeadlineFileSystem(fs, 3.0, lambda p: f"s3://{p}")
    assert b"".join(read_ranges(deadline, ranges, window=4)) == data  # connections made
    outcome: dict[str, Any] = {}

    def read() -> None:
        start = time.monotonic()
        try:
            b"".join(read_ranges(deadline, ranges, window=4))
        except Exception as err:
            outcome["error"] = err
        outcome["seconds"] = time.monotonic() - start

    seaweed.pause()
    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(30)
        finished = not reader.is_alive()
    finally:
        seaweed.resume()
    assert finished, "read_ranges still waiting 30 s after the server stopped (3 s deadline)"
    error = outcome.get("error")
    assert isinstance(error, TimeoutError), outcome
    assert f"s3://{path}: the object store did not answer cat_file within 3 s" in str(error)
    assert outcome["seconds"] < 3.0 + 5.0, outcome
    with pytest.raises(TimeoutError, match="not sent, the object store did not answer"):
        next(read_ranges(deadline, ranges, window=4))
