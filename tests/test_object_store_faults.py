"""Saves through a throttling, failing server: every byte stored, or a clear failure and
the previous checkpoint kept.

A fault-injecting proxy (``tests/s3_fault_proxy.py``) sits between s3fs and SeaweedFS and
answers chosen uploads with ``503 SlowDown`` after reading their body, as a throttled S3
does. Two retry layers resend the body: botocore within one call (``max_attempts`` per
call; ``AWS_MAX_ATTEMPTS`` or its ``config``), then s3fs, which calls again after botocore
gave up on ``SlowDown`` (``S3FileSystem.retries`` calls). A body not rewound for s3fs's
call went out empty and the server stored a 0-byte object with a 200; the save then
recorded that size and committed. The bursts here straddle both boundaries, for a single
PUT and for a part of a multipart upload. The ranks are configured as a user would be,
through the AWS variables, with ``AWS_MAX_ATTEMPTS=2`` so that s3fs's boundary
(``2 * retries`` requests) comes after seconds of backoff, not a minute. A load whose
ranged GETs are cut off midway reads the missing bytes again and loads bit-exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import os
import posixpath
import urllib.parse
from collections import Counter
from typing import Any

import pytest
import s3fs
import torch
import torch.distributed as dist

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.storage.fsspec_storage import _PartBudget, _S3Upload
from lightning_megatron_fsdp.storage.records import _tensor_view
from tests.harness import run_distributed
from tests.object_store import ACCESS_KEY, SECRET_KEY, SeaweedServer
from tests.s3_fault_proxy import Fault, FaultProxy
from tests.scripts.fault_injection import (
    checkpoint_dict,
    init_group,
    live_state,
    step,
    target_state,
    trained,
)
from tests.shard_facts import assert_same_facts, facts

TIMEOUT = 240.0
ATTEMPTS = 2
"""botocore's attempts per call in these tests (``AWS_MAX_ATTEMPTS``)."""
CALLS = s3fs.S3FileSystem.retries
"""s3fs's calls of a throttled operation before it gives up."""
GIVE_UP = ATTEMPTS * CALLS
"""The burst of 503s that exhausts both layers."""
PART = 5 << 20
EXTRA = 3_000_000
"""Floats of a replicated tensor added to the ``parts`` saves: one rank writes its 12 MB,
three upload parts."""


def _client(proxy: FaultProxy, attempts: int | None) -> Any:
    config = {} if attempts is None else {"retries": {"total_max_attempts": attempts}}
    return s3fs.S3FileSystem(
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        endpoint_url=proxy.endpoint,
        skip_instance_cache=True,
        config_kwargs=config,
    )


@pytest.mark.parametrize(
    ("attempts", "burst", "size"),
    [(None, 5, 10_000), (ATTEMPTS, ATTEMPTS, 10_000), (ATTEMPTS, ATTEMPTS, 2 * PART + 7)],
    ids=["default-config-5", "put-botocore-boundary", "multipart-botocore-boundary"],
)
def test_an_upload_sends_its_whole_body_after_botocore_gives_up(
    seaweed: SeaweedServer, attempts: int | None, burst: int, size: int
) -> None:
    """The issue's repro: botocore gives up after its attempts, s3fs calls again; the
    object must hold every byte (it held 0 bytes, and ``close`` returned normally)."""
    bucket = seaweed.new_bucket()
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    pattern = r"partNumber=2" if size > PART else r"/obj$"
    with FaultProxy(seaweed.ports["s3.port"], [Fault("503", burst, path=pattern)]) as proxy:
        upload = _S3Upload(_client(proxy, attempts), f"{bucket}/obj", _PartBudget(PART, 1))
        upload.write(data)
        upload.close()
        assert proxy.answered("503") == burst
    assert seaweed.filesystem().cat(f"{bucket}/obj") == data


def test_a_part_of_kept_views_and_copies_is_sent_whole_after_botocore_gives_up(
    seaweed: SeaweedServer,
) -> None:
    """Tensor payloads are kept by reference (``write_kept``), the bytes around them
    copied: parts mixing both, cut across a view, are sent byte for byte, also when
    resent after botocore gave up, and the views stay valid after their tensor's name is
    gone."""
    bucket = seaweed.new_bucket()
    tensor = torch.arange(1_600_000, dtype=torch.float32)  # 6.4 MB: crosses part 1's end
    expected = b"h" * 1000 + tensor.numpy().tobytes() + b"t" * 10 + b"k" * 3_000_000
    faults = [Fault("503", ATTEMPTS, path=r"partNumber=2")]
    with FaultProxy(seaweed.ports["s3.port"], faults) as proxy:
        upload = _S3Upload(_client(proxy, ATTEMPTS), f"{bucket}/obj", _PartBudget(PART, 1))
        upload.write(b"h" * 1000)
        upload.write_kept(_tensor_view(tensor))
        del tensor
        upload.write(bytearray(b"t" * 10))
        upload.write_kept(b"k" * 3_000_000)
        upload.close()
        assert proxy.answered("503") == ATTEMPTS
    assert seaweed.filesystem().cat(f"{bucket}/obj") == expected


def test_aiohttp_sends_a_part_as_its_views_from_where_botocore_left_it() -> None:
    """A part reaches aiohttp wrapped by aiobotocore; aiohttp would take it for a file and
    read it in small pieces, each a copy and each a hop to a worker thread. It is sent as
    the views it holds instead, from its position (botocore rewinds it for each attempt),
    up to the length asked, a large view in pieces."""
    from aiobotocore._endpoint_helpers import _IOBaseWrapper
    from aiohttp import payload

    _S3Upload(s3fs.S3FileSystem(skip_instance_cache=True), "bucket/obj", _PartBudget(PART, 1))
    part = _PartBudget(PART, 1).take()
    kept = _tensor_view(torch.arange(10, dtype=torch.uint8))
    part.copy(memoryview(b"head"))
    part.keep(kept)
    part.copy(memoryview(b"tail"))
    big = _tensor_view(torch.full((600_000,), 7, dtype=torch.uint8))
    part.keep(big)
    body = part.body()
    body.seek(2)
    sent = payload.get_payload(_IOBaseWrapper(body))
    assert not isinstance(sent, payload.IOBasePayload), type(sent).__mro__
    assert sent.size == 16 + 600_000

    class Transport:
        """What aiohttp's stream writer is handed, collected."""

        def __init__(self) -> None:
            self.chunks: list[Any] = []

        async def write(self, chunk: Any) -> None:
            self.chunks.append(chunk)

    whole, cut = Transport(), Transport()
    asyncio.run(sent.write_with_length(whole, None))
    assert b"".join(whole.chunks) == b"ad" + bytes(range(10)) + b"tail" + b"\x07" * 600_000
    assert any(chunk.obj is kept.obj for chunk in whole.chunks), "the tensor's bytes were copied"
    # The event loop's transport may copy what the socket does not take (before Python
    # 3.12 it does): a large view goes in pieces, so at most one is held twice.
    assert max(len(chunk) for chunk in whole.chunks) <= 256 << 10
    again = Transport()
    asyncio.run(sent.write_with_length(again, None))  # a redirect: aiohttp sends it again
    assert b"".join(again.chunks) == b"".join(whole.chunks)
    body.seek(0)
    asyncio.run(payload.get_payload(_IOBaseWrapper(body)).write_with_length(cut, 7))
    assert b"".join(cut.chunks) == b"head" + bytes(range(3))


def test_a_burst_past_every_retry_says_it_was_throttled(seaweed: SeaweedServer) -> None:
    bucket = seaweed.new_bucket()
    faults = [Fault("503", GIVE_UP, path=r"/obj$")]
    with FaultProxy(seaweed.ports["s3.port"], faults) as proxy:
        upload = _S3Upload(_client(proxy, ATTEMPTS), f"{bucket}/obj", _PartBudget(PART, 1))
        upload.write(b"A" * 10_000)
        with pytest.raises(
            OSError,
            match=rf"throttled the upload of s3://{bucket}/obj: it answered 503 SlowDown .*"
            rf"put_object \({CALLS} calls by s3fs, {ATTEMPTS} attempts each",
        ):
            upload.close()
        # A failed close is not tried again when the upload is collected (it would send
        # an empty body, past the burst, and the object would appear).
        del upload
        gc.collect()
    assert seaweed.objects(f"{bucket}/obj") == {}


# ---------------------------------------------------------------------- 2 ranks


def _bursts(url: str) -> list[Fault]:
    """Per scenario: the first save passes, the second gets ``GIVE_UP - ATTEMPTS`` 503s in a
    row (botocore gives up four times; s3fs's last call must send the whole body), the third
    ``GIVE_UP`` (fails). The small scenario hits rank 1's shard
    (one PUT), the parts one the second part of rank 1's shard (a multipart upload)."""
    bucket = url.removeprefix("s3://").split("/")[0]
    faults = []
    for name, target in (
        ("small", r"__1_0\.distcp$"),
        ("parts", r"__\d_0\.distcp\?.*partNumber=2"),
    ):
        pattern = rf"/{bucket}/.*/{name}/last\.ckpt/v\d+-\w+/{target}"
        faults += [
            Fault("503", GIVE_UP - ATTEMPTS, path=pattern, after=1),
            Fault("503", GIVE_UP, path=pattern, after=GIVE_UP - ATTEMPTS + 2),
        ]
    return faults


def _throttled_saves(rank: int, world_size: int, env: dict[str, str], url: str) -> Any:
    """Per scenario, three saves of ``last.ckpt`` (see :func:`_bursts`); after each, load
    ``last.ckpt`` into zeroed targets. Returns per save its error and the loaded facts vs
    the facts of the save expected there."""
    os.environ.update(env)
    init_group(rank, world_size)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    report: dict[str, Any] = {}
    for name in ("small", "parts"):
        path = f"{url}/{name}/last.ckpt"
        kept = None
        for save in range(3):
            step(model, adam, 10 + save)
            ckpt = checkpoint_dict(model, adam, save)
            if name == "parts":
                ckpt["state_dict"]["extra"] = torch.arange(EXTRA, dtype=torch.float32) + save
            error = None
            try:
                plugin.save_checkpoint(ckpt, path)
                kept = (save, facts(live_state(model, adam)))
            except CheckpointError as err:
                error = f"{type(err).__name__}: {err}"
            _, _, state = target_state(world_size)
            if name == "parts":
                state["state_dict"]["extra"] = torch.zeros(EXTRA)
            loaded = plugin.load_checkpoint(path, state=state)
            extra = state["state_dict"].pop("extra", None)
            assert kept is not None, error
            if extra is not None:
                want = torch.arange(EXTRA, dtype=torch.float32) + kept[0]
                assert torch.equal(extra, want), f"{name}{save}: extra differs"
            report[f"{name}{save}"] = {
                "error": error,
                "step": loaded["global_step"],
                "want": kept[0],
                "facts": facts(state),
                "want_facts": kept[1],
            }
    return report


def test_throttled_saves_store_every_byte_or_fail_and_keep_last(seaweed: SeaweedServer) -> None:
    """2 ranks, ``MegatronFSDPCheckpointIO`` on the bucket, a small shard (one PUT) and a
    multipart one: ``GIVE_UP - ATTEMPTS`` 503s in a row commit a checkpoint that loads bit-exactly;
    ``GIVE_UP`` fail the save on every rank saying it was throttled, and ``last.ckpt``
    still loads the previous save bit-exactly."""
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/run"
    with FaultProxy(seaweed.ports["s3.port"], _bursts(url)) as proxy:
        env = {**proxy.env(seaweed.env), "AWS_MAX_ATTEMPTS": str(ATTEMPTS)}
        reports = run_distributed(
            _throttled_saves, 2, env, url, init_process_group=False, timeout=TIMEOUT
        )
        throttled = [path.split("/last.ckpt/")[1] for _, path, a in proxy.log if a == "503"]
        assert len(throttled) == 2 * (2 * GIVE_UP - ATTEMPTS), sorted(Counter(throttled).items())
    for rank, report in enumerate(reports):
        for key, result in report.items():
            what = f"rank {rank}, {key}"
            if key.endswith("2"):
                assert result["error"] is not None, what
                assert "throttled" in result["error"], result["error"]
                assert "503 SlowDown" in result["error"], result["error"]
                assert "__" in result["error"] and ".distcp" in result["error"], result["error"]
            else:
                assert result["error"] is None, f"{what}: {result['error']}"
            assert result["step"] == result["want"], what
            assert_same_facts(result["facts"], result["want_facts"], what)


def test_random_503_500_and_resets_are_retried_and_store_every_byte(
    seaweed: SeaweedServer,
) -> None:
    """30% of the requests of a multipart upload answered 503, 500 or a reset
    connection (seed 26: all three within 8 requests, never more than 2 in a row):
    retried, and the object holds every byte."""
    bucket = seaweed.new_bucket()
    data = bytes(range(256)) * ((2 * PART + 7) // 256)
    kinds = ("503", "500", "reset")
    with FaultProxy(seaweed.ports["s3.port"], share=0.3, kinds=kinds, seed=26) as proxy:
        upload = _S3Upload(_client(proxy, None), f"{bucket}/obj", _PartBudget(PART, 1))
        upload.write(data)
        upload.close()
        assert all(proxy.answered(kind) for kind in kinds), proxy.log
    assert seaweed.filesystem().cat(f"{bucket}/obj") == data


def _save_then_load(
    rank: int, world_size: int, env: dict[str, str], url: str, replace: bool = False
) -> Any:
    """Save (``replace``: step 2, then step 3 over it, marked in the proxy's log), then
    load into zeroed targets; returns the last save's error, if any (a ``CheckpointError``),
    the loaded facts and the saved ones.

    With ``LOAD_ENDPOINT`` in ``env`` the load goes there (a fresh s3fs client): through
    the proxy after saves straight to the server, or the other way round. Without it both
    go to ``AWS_ENDPOINT_URL``, in the same processes (each rank's s3fs still holding the
    listings its save took), and rank 0 reads a marker object between the two, so the
    proxy's log tells the load's requests apart."""
    os.environ.update(env)
    init_group(rank, world_size)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    if replace:
        plugin.save_checkpoint(checkpoint_dict(model, adam, 2), url)
        _mark(rank, url, _SAVE_BEGINS)
    error = None
    try:
        plugin.save_checkpoint(checkpoint_dict(model, adam, 3), url)
    except CheckpointError as err:
        error = f"{type(err).__name__}: {err}"
    if "LOAD_ENDPOINT" in env:
        os.environ["AWS_ENDPOINT_URL"] = env["LOAD_ENDPOINT"]
        s3fs.S3FileSystem.clear_instance_cache()
    else:
        _mark(rank, url, _LOAD_BEGINS)
    _, _, state = target_state(world_size)
    loaded = plugin.load_checkpoint(url, state=state)
    return {
        "error": error,
        "step": loaded["global_step"],
        "facts": facts(state),
        "want": facts(live_state(model, adam)),
    }


def _assert_saved_and_loaded(reports: list[Any]) -> None:
    """Every rank's :func:`_save_then_load`: its last save raised nothing, and the load
    gave back step 3 bit-exactly."""
    for rank, report in enumerate(reports):
        assert report["error"] is None, (rank, report["error"])
        assert report["step"] == 3, rank
        assert_same_facts(report["facts"], report["want"], f"rank {rank}")


def _mark(rank: int, url: str, marker: str) -> None:
    """Rank 0 asks for a marker object (absent), so the proxy's log shows where it is."""
    if rank == 0:
        with contextlib.suppress(FileNotFoundError):
            s3fs.S3FileSystem(skip_instance_cache=True).cat_file(f"{url}-{marker}")
    dist.barrier()


_LOAD_BEGINS, _SAVE_BEGINS = "load-begins", "save-begins"


def test_a_load_whose_gets_are_cut_off_midway_is_bit_exact(seaweed: SeaweedServer) -> None:
    """2 ranks: the first GETs of the shard objects are answered with half their body, then
    a reset; the load asks for the missing bytes again and every tensor is bit-exact."""
    url = f"s3://{seaweed.new_bucket()}/run/last.ckpt"
    cuts = [Fault("cut", CALLS - 1, method="GET", path=r"__\d_0\.distcp$")]
    with FaultProxy(seaweed.ports["s3.port"], cuts) as proxy:
        env = {**seaweed.env, "LOAD_ENDPOINT": proxy.endpoint}
        reports = run_distributed(
            _save_then_load, 2, env, url, init_process_group=False, timeout=TIMEOUT
        )
        assert proxy.answered("cut") == CALLS - 1, proxy.log
    _assert_saved_and_loaded(reports)


def _request(method: str, path: str) -> str:
    """``"LIST <last part of the prefix>"`` for a listing, ``"LIST uploads"`` for one of
    the pending multipart uploads, ``"DELETE (batch)"`` for a multi-object delete, else
    ``"<method> <name>"``."""
    parts = urllib.parse.urlsplit(path)
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    if method == "GET" and "list-type" in query:
        return f"LIST {posixpath.basename(query['prefix'][0].rstrip('/'))}"
    if method == "GET" and "uploads" in query:
        return "LIST uploads"
    if method == "POST" and "delete" in query:
        return "DELETE (batch)"
    return f"{method} {posixpath.basename(parts.path.rstrip('/'))}"


def test_a_load_asks_the_store_once_for_each_thing_it_needs(seaweed: SeaweedServer) -> None:
    """2 ranks, through the proxy with no fault, the requests of a load right after a save
    in the same processes: rank 0 lists the checkpoint's versions and the newest one once
    and reads the manifest, then ``.metadata.keys`` and ``meta.pt`` once (the other ranks
    take them from it: a complete version never changes); no byte of a shard object is
    asked for twice (each rank reads its own objects: a replicated record, Adam's ``step``,
    and a byte record, a learning rate, by the rank that wrote it, which sends it to the
    other); nothing asks an object's size (HEAD), and no rank trips over what its own save
    listed. Counts are exact: nothing is retried on a healthy loopback server."""
    url = f"s3://{seaweed.new_bucket()}/run/last.ckpt"
    with FaultProxy(seaweed.ports["s3.port"]) as proxy:
        env = proxy.env(seaweed.env)
        reports = run_distributed(
            _save_then_load, 2, env, url, init_process_group=False, timeout=TIMEOUT
        )
        log, ranges = list(proxy.log), list(proxy.ranges)
    _assert_saved_and_loaded(reports)
    begins = max(i for i, (_, path, _) in enumerate(log) if _LOAD_BEGINS in path)
    asked = Counter(_request(method, path) for method, path, _ in log[begins + 1 :])
    read: dict[str, list[tuple[int, int]]] = {}
    for path, span in (r[1:] for r in ranges if r[0] > begins):
        first, last = map(int, span.removeprefix("bytes=").split("-"))
        read.setdefault(posixpath.basename(urllib.parse.urlsplit(path).path), []).append(
            (first, last)
        )
    assert any(name.startswith("__") for name in read), read  # the shard GETs ask ranges
    for name, spans in read.items():
        spans.sort()
        assert all(a[1] < b[0] for a, b in itertools.pairwise(spans)), (name, spans)
    assert sum(n for key, n in asked.items() if key.startswith("GET __")) >= 2, log
    version = next(key.split()[1] for key in asked if key.startswith("LIST v"))
    assert {k: n for k, n in asked.items() if not k.startswith("GET __")} == {
        "LIST last.ckpt": 1,
        f"LIST {version}": 1,
        "GET manifest.json": 1,
        "GET .metadata.keys": 1,
        "GET meta.pt": 1,
    }, log[begins + 1 :]


def test_a_save_asks_the_store_once_for_each_thing_it_does(seaweed: SeaweedServer) -> None:
    """2 ranks, through the proxy with no fault, the requests of a save that replaces
    another: rank 0 lists the checkpoint once to pick the new version; DCP writes
    ``.metadata`` under its own name (no existence checks, no temporary name renamed,
    which on an object store is a copy and a delete); each rank lists the new version once
    (its objects' sizes against what its writer wrote); rank 0 writes ``meta.pt`` and
    ``.metadata.keys``, then the manifest after every other object of the version; then,
    committed, it lists the checkpoint once more and retires the old version: its manifest
    first, then one listing and one batch delete of its objects, its directory marker, and
    one look for pending multipart uploads. Counts are exact: nothing is retried on a
    healthy loopback server. The load after it is bit-exact."""
    url = f"s3://{seaweed.new_bucket()}/run/last.ckpt"
    with FaultProxy(seaweed.ports["s3.port"]) as proxy:
        env = proxy.env(seaweed.env)
        reports = run_distributed(
            _save_then_load, 2, env, url, True, init_process_group=False, timeout=TIMEOUT
        )
        log = list(proxy.log)
    _assert_saved_and_loaded(reports)
    begins = max(i for i, (_, path, _) in enumerate(log) if _SAVE_BEGINS in path)
    ends = min(i for i, (_, path, _) in enumerate(log) if _LOAD_BEGINS in path)
    asked = [_request(method, path) for method, path, _ in log[begins + 1 : ends]]
    shards = [n for n in asked if n.split()[1].startswith("__")]
    assert shards and all(n.startswith("PUT __") for n in shards), asked
    new = next(posixpath.basename(posixpath.dirname(p)) for _, p, _ in log[begins:] if "__0_" in p)
    old = next(n.split()[1] for n in asked if n.startswith("LIST v") and new not in n)
    assert Counter(n for n in asked if n not in shards) == {
        "LIST last.ckpt": 2,
        "PUT .metadata": 1,
        f"LIST {new}": 2,
        "PUT meta.pt": 1,
        "PUT .metadata.keys": 1,
        "PUT manifest.json": 1,
        "DELETE manifest.json": 1,
        f"LIST {old}": 1,
        "DELETE (batch)": 1,
        f"DELETE {old}": 1,
        "LIST uploads": 1,
    }, asked
    commit = asked.index("PUT manifest.json")
    assert all(not n.startswith("PUT") for n in asked[commit + 1 :]), asked
    assert asked.index("DELETE manifest.json") > commit, asked


def test_a_store_failing_after_the_commit_keeps_the_committed_save(
    seaweed: SeaweedServer,
) -> None:
    """2 ranks; every listing of the checkpoint after the second save's manifest is
    answered 500 (the server failing right after the commit record landed): retiring the
    old version is left to the next save, the save succeeds on every rank, and its
    checkpoint, not the one before, is what loads, bit-exact."""
    url = f"s3://{seaweed.new_bucket()}/run/last.ckpt"
    # Listings of the checkpoint: the first save's version pick and retirement, then the
    # second save's version pick; every later one fails past both retry layers.
    fail = Fault("500", 1000, method="GET", path=r"prefix=run%2Flast\.ckpt%2F&", after=3)
    with FaultProxy(seaweed.ports["s3.port"], [fail]) as proxy:
        env = {**proxy.env(seaweed.env), "LOAD_ENDPOINT": seaweed.endpoint}
        reports = run_distributed(
            _save_then_load, 2, env, url, True, init_process_group=False, timeout=TIMEOUT
        )
        assert proxy.answered("500") > 0, proxy.log
    _assert_saved_and_loaded(reports)
