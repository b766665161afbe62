"""The load's concurrent ranged reads against a real S3-compatible server (SeaweedFS,
``tests/object_store.py``): ``read_ranges`` fills each range's buffers exactly and hands
the ranges back in the order asked, never has more than its window of GETs taken, fills a
range past an object's end short (which the load refuses naming the object), requests a
body cut off midway again from where it stopped (and fails naming the object once cut
off more often than the client retries), and a stopped server fails it within the
deadline with one :class:`TimeoutError` naming the object, after which nothing more is
sent.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from typing import Any

import pytest
import s3fs

from lightning_megatron_fsdp.storage.fsspec_storage import _cut
from lightning_megatron_fsdp.storage.object_store import DeadlineFileSystem, read_ranges
from tests.object_store import ACCESS_KEY, SECRET_KEY, SeaweedServer
from tests.s3_fault_proxy import Fault, FaultProxy


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


def _landings(ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, list[bytearray]]]:
    """Each range with empty buffers for its bytes: two where it has more than one byte."""
    landings = []
    for path, start, end in ranges:
        size = end - start
        cut = size // 3
        buffers = [bytearray(cut), bytearray(size - cut)] if cut else [bytearray(size)]
        landings.append((path, start, buffers))
    return landings


def _filled(landing: tuple[str, int, list[bytearray]]) -> bytes:
    return b"".join(landing[2])


@pytest.mark.parametrize("window", [1, 3, 8])
def test_ranged_reads_return_each_range_in_order_within_the_window(
    seaweed: SeaweedServer, window: int
) -> None:
    fs, objects = _objects(seaweed, [3_000_001, 5 << 20, 1_000])
    ranges = _ranges(objects, seed=window)
    taken = 0

    def counted() -> Any:
        nonlocal taken
        for landing in landings:
            taken += 1
            yield landing

    landings = _landings(ranges)
    got = []
    for index, filled in enumerate(read_ranges(fs, counted(), window=window)):
        # the range handed back, the one after it being read, and at most window - 1 more
        assert taken <= index + 1 + window, (taken, index, window)
        got.append(filled)
    assert got == [end - start for _, start, end in ranges]
    for (path, start, end), landing in zip(ranges, landings, strict=True):
        assert _filled(landing) == objects[path][start:end], (path, start, end)


def test_a_range_past_the_end_is_filled_short(seaweed: SeaweedServer) -> None:
    fs, objects = _objects(seaweed, [1 << 20])
    ((path, data),) = objects.items()
    half = len(data) // 2
    landings = _landings([(path, 0, half), (path, half, half + len(data))])  # past the end
    assert list(read_ranges(fs, landings, window=2)) == [half, len(data) - half]
    assert (_filled(landings[0]) + _filled(landings[1]))[: len(data)] == data


def _through(proxy: FaultProxy) -> Any:
    return s3fs.S3FileSystem(
        key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=proxy.endpoint, skip_instance_cache=True
    )


def test_a_body_cut_off_midway_is_read_again_from_where_it_stopped(
    seaweed: SeaweedServer,
) -> None:
    """Each of the first GETs answered with half its body, then a reset connection: the
    bytes still missing are requested again, and every range holds its bytes exactly."""
    _, objects = _objects(seaweed, [6 << 20, 3 << 20])
    ranges = [
        (p, a, a + (1 << 20)) for p, data in objects.items() for a in range(0, len(data), 1 << 20)
    ]
    cuts = s3fs.S3FileSystem.retries - 1  # one range cut that often, then read whole
    with FaultProxy(seaweed.ports["s3.port"], [Fault("cut", cuts, method="GET")]) as proxy:
        landings = _landings(ranges)
        assert list(read_ranges(_through(proxy), landings, window=3)) == [1 << 20] * len(ranges)
        assert proxy.answered("cut") == cuts, proxy.log
    for (path, start, end), landing in zip(ranges, landings, strict=True):
        assert _filled(landing) == objects[path][start:end], (path, start, end)


def test_a_body_cut_off_more_often_than_retried_fails_naming_the_object(
    seaweed: SeaweedServer,
) -> None:
    _, objects = _objects(seaweed, [2 << 20])
    ((path, data),) = objects.items()
    retries = s3fs.S3FileSystem.retries
    with FaultProxy(seaweed.ports["s3.port"], [Fault("cut", retries, method="GET")]) as proxy:
        landings = _landings([(path, 0, len(data))])
        with pytest.raises(
            OSError,
            match=rf"s3://{path}: bytes \[0, {len(data)}\): reading failed {retries} times",
        ):
            list(read_ranges(_through(proxy), landings, window=1))
        assert proxy.answered("cut") == retries, proxy.log


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
    landings = _landings(ranges)
    assert list(read_ranges(deadline, landings, window=4)) == [1 << 20] * 8  # connections made
    assert b"".join(_filled(landing) for landing in landings) == data
    outcome: dict[str, Any] = {}

    def read() -> None:
        start = time.monotonic()
        try:
            list(read_ranges(deadline, _landings(ranges), window=4))
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
        next(read_ranges(deadline, _landings(ranges), window=4))


def test_an_answer_that_is_not_the_range_asked_for_is_refused_naming_it(
    seaweed: SeaweedServer,
) -> None:
    """A store (or proxy) that ignores ``Range`` answers ``200`` without ``Content-Range``:
    its bytes may be any part of the object, so none is written anywhere and the read
    fails naming the object and the bytes asked for."""
    _, objects = _objects(seaweed, [2 << 20])
    ((path, data),) = objects.items()
    with FaultProxy(seaweed.ports["s3.port"], [Fault("bare", 1, method="GET")]) as proxy:
        landings = _landings([(path, 1 << 20, len(data))])
        with pytest.raises(
            OSError,
            match=rf"s3://{path}: bytes \[{1 << 20}, {len(data)}\): asked for bytes "
            rf"{1 << 20}-{len(data) - 1}, the store answered without a Content-Range",
        ):
            list(read_ranges(_through(proxy), landings, window=1))
        assert proxy.answered("bare") == 1, proxy.log
    assert _filled(landings[0]) == bytes(len(data) - (1 << 20)), "bytes were written"
