"""A store that stops answering (``SIGSTOP``) during a save and during a load: one clear error
on every rank within the process group's timeout, and the previous checkpoint kept.

SIGSTOP leaves the server's sockets open: connections are accepted by the kernel and never
answered, as with a hung or partitioned server. Without a deadline tied to the group's
timeout every rank waits on s3fs's and botocore's retries (read timeouts, each retried by
both layers) for many minutes, far past the collectives' timeout. Two ranks join a gloo group
with a short :data:`GROUP_TIMEOUT` (what ``MegatronFSDPStrategy(timeout=...)`` gives its
group), save ``last.ckpt``, then save and load it while the server is stopped: both fail on
every rank within the timeout, naming the object and the deadline; once the server is
resumed (``SIGCONT``) ``last.ckpt`` still loads the first save bit for bit. The same
through a proxy (``tests/s3_fault_proxy.py``) that never answers one rank's shard upload,
then the first ranged reads of the shards: the requests a stopped server leaves hanging
mid-save and mid-load. And reads through a file (``fs.open``: a streamed digest, as a
load of a format-1 checkpoint or ``inspect --verify`` takes one, and a stream opened
before the stop): each fails within its deadline, naming the object; so does
``fit(ckpt_path="last")``'s lookup of the newest complete checkpoint, made before any
process group exists. Last, a manifest PUT
that times out and reaches the server later: the failed save's checkpoint, complete, loads
bit for bit, and the next save retires it.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_megatron_fsdp import MegatronFSDPStrategy, load_full_weights
from lightning_megatron_fsdp.errors import CheckpointError
from lightning_megatron_fsdp.storage import locate
from tests.harness import run_distributed
from tests.models import PackedBlock
from tests.object_store import SeaweedServer
from tests.s3_fault_proxy import Fault, FaultProxy
from tests.scripts.fault_injection import (
    checkpoint_dict,
    live_state,
    saved_on_store,
    step,
    target_state,
)
from tests.shard_facts import assert_same_facts, facts
from tests.test_trainer_checkpointing import CheckpointedLM, make_trainer, token_loader

GROUP_TIMEOUT = timedelta(seconds=20)
MARGIN = 5.0
"""Seconds past :data:`GROUP_TIMEOUT` an error may take to reach every rank."""
DEADLINE = "10 s"
"""Each request's deadline, as the errors say it: half of :data:`GROUP_TIMEOUT`."""


def _timed(action: Any) -> tuple[str | None, float]:
    """The error ``action`` raised (``None``: none) and the seconds it took."""
    start = time.monotonic()
    error = None
    try:
        action()
    except (CheckpointError, TimeoutError) as err:
        error = f"{type(err).__name__}: {err}"
    return error, time.monotonic() - start


def _paused(rank: int, server: int | None, action: Any) -> tuple[str | None, float]:
    """Stop the server (rank 0, once every rank is here), run ``action`` on every rank, and
    resume it once every rank is done; returns what :func:`_timed` does. ``server=None``:
    only ``action``, timed (the proxy's faults stop the requests)."""
    dist.barrier()
    if rank == 0 and server is not None:
        os.killpg(server, signal.SIGSTOP)
    dist.barrier()
    outcome = _timed(action)
    dist.barrier()
    if rank == 0 and server is not None:
        os.killpg(server, signal.SIGCONT)
    dist.barrier()
    return outcome


def _saves_and_loads_while_paused(
    rank: int, world_size: int, env: dict[str, str], url: str, server: int | None
) -> dict[str, Any]:
    """Save ``last.ckpt``; save and load it again while ``server`` is stopped (or the proxy
    hangs); then load it into zeroed targets. Returns the two errors with their times and
    the loaded facts vs the first save's."""
    model, adam, plugin, path = saved_on_store(rank, world_size, env, url, 1, timeout=GROUP_TIMEOUT)
    saved = facts(live_state(model, adam))
    step(model, adam, 11)

    report: dict[str, Any] = {}
    checkpoint = checkpoint_dict(model, adam, 2)
    report["save"] = _paused(rank, server, lambda: plugin.save_checkpoint(checkpoint, path))
    _, _, state = target_state(world_size)
    report["load"] = _paused(rank, server, lambda: plugin.load_checkpoint(path, state=state))

    _, _, state = target_state(world_size)
    loaded = plugin.load_checkpoint(path, state=state)
    report["step"] = loaded["global_step"]
    report["facts"], report["want_facts"] = facts(state), saved
    dist.destroy_process_group()
    return report


def _check(reports: list[dict[str, Any]], url: str, objects: tuple[str, str]) -> None:
    """Every rank's save and load failed within the timeout, clearly, naming ``objects``
    (the save's, the load's: a regular expression after ``url``); ``last.ckpt`` is the
    first save, bit for bit."""
    limit = GROUP_TIMEOUT.total_seconds() + MARGIN
    for rank, report in enumerate(reports):
        kinds = ("CheckpointSaveError", "CheckpointError")
        for what, kind, name in zip(("save", "load"), kinds, objects, strict=True):
            error, took = report[what]
            where = f"rank {rank}, {what} ({took:.1f} s): {error}"
            assert error is not None, where
            assert took < limit, where
            assert error.startswith(f"{kind}: "), where
            assert re.search(
                rf"{re.escape(url)}/last\.ckpt{name}: the object store did not "
                rf"answer \w+ within {DEADLINE}",
                error,
            ), where
            assert "timeout" in error and "check the store" in error, where
        assert report["step"] == 1, f"rank {rank}: last.ckpt is no longer the first save"
        assert_same_facts(report["facts"], report["want_facts"], f"rank {rank}")


def _run_paused(seaweed: SeaweedServer, function: Any, url: str) -> list[Any]:
    """``function(rank, world_size, env, url, server_pid)`` on 2 ranks (it stops the
    server, see :func:`_paused`); the server runs again afterwards, whatever happened."""
    assert seaweed.process is not None
    try:
        return run_distributed(
            function,
            2,
            seaweed.env,
            url,
            seaweed.process.pid,
            init_process_group=False,
            timeout=180.0,
        )
    finally:
        seaweed.resume()


def test_a_stopped_store_fails_save_and_load_within_the_timeout(seaweed: SeaweedServer) -> None:
    """SIGSTOP: the save's first request and the load's (rank 0 lists the checkpoint's
    versions, or a version's objects) go unanswered."""
    url = f"s3://{seaweed.new_bucket()}/run"
    reports = _run_paused(seaweed, _saves_and_loads_while_paused, url)
    _check(reports, url, (r"(/v\d+-\w+)?", r"(/v\d+-\w+)?"))


def test_hung_uploads_and_ranged_reads_fail_within_the_timeout(seaweed: SeaweedServer) -> None:
    """The proxy never answers rank 1's shard upload of the second save, nor the first two
    ranged reads of the shards (one per rank) of the load after it."""
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/run"
    faults = [
        Fault("hang", 1, method="PUT", path=r"/v\d+-\w+/__1_0\.distcp$", after=1),
        Fault("hang", 2, method="GET", path=r"/__\d_0\.distcp$"),
    ]
    with FaultProxy(seaweed.ports["s3.port"], faults) as proxy:
        reports = run_distributed(
            _saves_and_loads_while_paused,
            2,
            proxy.env(seaweed.env),
            url,
            None,
            init_process_group=False,
            timeout=180.0,
        )
        assert proxy.answered("hang") == 3, proxy.log
    _check(reports, url, (r"/v\d+-\w+/__1_0\.distcp", r"/v\d+-\w+/__\d_0\.distcp"))


def test_reads_through_a_file_of_a_stopped_store_fail_within_the_deadline(
    seaweed: SeaweedServer, monkeypatch: Any
) -> None:
    """A digest of ``meta.pt`` (streamed through ``fs.open``) and a read of a stream opened
    before the stop each give up after the deadline (plus :data:`MARGIN`), with one error
    naming the object; s3fs's own file reads past any deadline, for many minutes."""
    for name, value in seaweed.env.items():
        monkeypatch.setenv(name, value)
    url = f"s3://{seaweed.new_bucket()}/run/ckpt"
    deadline = 3.0
    data = os.urandom(3 << 20)
    locate(url).store.write_bytes(f"{locate(url).path}/meta.pt", data)
    stream = locate(f"{url}/meta.pt", deadline=deadline).open(block_size=1 << 20)
    assert stream.read(10) == data[:10]

    def read_on() -> bytes:
        stream.seek(2 << 20)  # past the block read so far
        return bytes(stream.read(10))

    reads = {
        "digest": lambda: locate(url, deadline=deadline).digest("meta.pt", "crc32c"),
        "stream": read_on,
    }
    outcomes = {}
    seaweed.pause()
    try:
        for what, read in reads.items():
            start = time.monotonic()
            try:
                read()
            except TimeoutError as err:
                outcomes[what] = (str(err), time.monotonic() - start)
            else:
                outcomes[what] = (None, time.monotonic() - start)
    finally:
        seaweed.resume()
    for what, (error, took) in outcomes.items():
        where = f"{what} ({took:.1f} s): {error}"
        assert error is not None and took < deadline + MARGIN, where
        assert re.search(
            rf"{re.escape(url)}/meta\.pt: the object store did not answer \w+ within 3 s", error
        ), where


def _assert_gave_up(outcomes: list[tuple[str | None, float]], named: str, case: str = "") -> None:
    """Every rank failed within the group's timeout, its error naming what matches
    ``named`` (a regular expression) and the deadline of the request that went unanswered."""
    for rank, (error, took) in enumerate(outcomes):
        where = f"{case}rank {rank} ({took:.1f} s): {error}"
        assert error is not None and took < GROUP_TIMEOUT.total_seconds() + MARGIN, where
        assert re.search(
            rf"{named}\S*: the object store did not answer \w+ within {DEADLINE}", error
        ), where


def _weights_while_paused(
    rank: int, world_size: int, env: dict[str, str], url: str, server: int
) -> tuple[str | None, float]:
    """Save ``last.ckpt``, then fill the model from it as full weights
    (``load_full_weights``, as ``init_weights_from`` does) while ``server`` is stopped."""
    model, _, _, path = saved_on_store(rank, world_size, env, url, 1, timeout=GROUP_TIMEOUT)
    outcome = _paused(rank, server, lambda: load_full_weights(model, path))
    dist.destroy_process_group()
    return outcome


def test_full_weights_from_a_stopped_store_fail_within_the_timeout(
    seaweed: SeaweedServer,
) -> None:
    """SIGSTOP during ``load_full_weights`` from the bucket: every rank raises one clear
    error within the group's timeout, naming the checkpoint and the deadline (without one,
    each rank waits on s3fs's and botocore's retries for many minutes)."""
    url = f"s3://{seaweed.new_bucket()}/run"
    outcomes = _run_paused(seaweed, _weights_while_paused, url)
    _assert_gave_up(outcomes, rf"{re.escape(url)}/last\.ckpt")


def _fit(
    rank: int, world_size: int, env: dict[str, str], url: str, ckpt_path: str | None
) -> tuple[str | None, float]:
    """2 steps of the Trainer with ``ModelCheckpoint(dirpath=url, save_last=True)`` and a
    strategy whose group times out after :data:`GROUP_TIMEOUT`, from ``ckpt_path``;
    returns what :func:`_timed` does."""
    os.environ.update(env)
    checkpoints = ModelCheckpoint(dirpath=url, save_last=True, every_n_train_steps=1)
    trainer = make_trainer(
        world_size,
        strategy=MegatronFSDPStrategy(auto_wrap_policy={PackedBlock}, timeout=GROUP_TIMEOUT),
        max_steps=2,
        callbacks=[checkpoints],
    )
    return _timed(
        lambda: trainer.fit(CheckpointedLM(), token_loader(world_size), ckpt_path=ckpt_path)
    )


def test_resuming_from_last_on_a_stopped_store_fails_within_the_timeout(
    seaweed: SeaweedServer,
) -> None:
    """``fit(ckpt_path="last")`` looks for the newest complete ``last`` checkpoint in the
    bucket before any process group exists. With the server stopped, and with a store
    that answers the listing of the folder and then nothing about ``last.ckpt`` (the
    proxy), every rank raises one clear error within the strategy's timeout, naming the
    checkpoint and the deadline: not a checkpoint taken as missing (Lightning would then
    look again, without a deadline, or start from scratch)."""
    url = f"s3://{seaweed.new_bucket()}/run"
    saved = run_distributed(_fit, 2, seaweed.env, url, None, init_process_group=False)
    assert [error for error, _ in saved] == [None, None], saved
    hang = Fault("hang", 1000, method=None, path=r"last\.ckpt")
    with FaultProxy(seaweed.ports["s3.port"], [hang]) as proxy:
        hung = run_distributed(
            _fit, 2, proxy.env(seaweed.env), url, "last", init_process_group=False, timeout=180
        )
    seaweed.pause()
    try:
        stopped = run_distributed(
            _fit, 2, seaweed.env, url, "last", init_process_group=False, timeout=180.0
        )
    finally:
        seaweed.resume()
    _assert_gave_up(stopped, rf"^TimeoutError: {re.escape(url)}", "stopped, ")
    _assert_gave_up(hung, rf"^TimeoutError: {re.escape(url)}/last\.ckpt", "hung, ")


def _a_late_manifest(rank: int, world_size: int, env: dict[str, str], url: str) -> dict[str, Any]:
    """Save ``last.ckpt``; save it again while the proxy holds the manifest PUT past the
    deadline; once the held PUT has reached the server, load (the second save), save a
    third time and list the versions left."""
    model, adam, plugin, path = saved_on_store(rank, world_size, env, url, 1, timeout=GROUP_TIMEOUT)
    step(model, adam, 11)
    report: dict[str, Any] = {"want_facts": facts(live_state(model, adam))}
    checkpoint = checkpoint_dict(model, adam, 2)
    report["save"] = _timed(lambda: plugin.save_checkpoint(checkpoint, path))
    if rank == 0:  # wait for the held manifest: the newest complete version changes
        first = locate(path).loaded_version()[0].name
        give_up = time.monotonic() + 3 * GROUP_TIMEOUT.total_seconds()
        while locate(path).loaded_version()[0].name == first and time.monotonic() < give_up:
            time.sleep(0.5)
    dist.barrier()
    _, _, state = target_state(world_size)
    report["step"] = plugin.load_checkpoint(path, state=state)["global_step"]
    report["facts"] = facts(state)
    plugin.save_checkpoint(checkpoint_dict(model, adam, 3), path)
    location = locate(path)
    report["versions"] = [v.name for v in location.store.versions(location.path)]
    dist.destroy_process_group()
    return report


def test_a_manifest_that_lands_after_its_save_failed(seaweed: SeaweedServer) -> None:
    """The proxy holds the second save's manifest PUT for the group's timeout (the client
    gave up after half of it) and then sends it: the save failed on every rank, saying the
    manifest may still land; once it has, a load takes that save's checkpoint bit for bit,
    and the next save retires both older versions."""
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/run"
    late = Fault(
        "late",
        1,
        path=r"/last\.ckpt/v\d+-\w+/manifest\.json$",
        after=1,
        delay=GROUP_TIMEOUT.total_seconds(),
    )
    with FaultProxy(seaweed.ports["s3.port"], [late]) as proxy:
        reports = run_distributed(
            _a_late_manifest,
            2,
            proxy.env(seaweed.env),
            url,
            init_process_group=False,
            timeout=180.0,
        )
        assert proxy.answered("landed") == 1, proxy.log
    limit = GROUP_TIMEOUT.total_seconds() + MARGIN
    for rank, report in enumerate(reports):
        error, took = report["save"]
        where = f"rank {rank} ({took:.1f} s): {error}"
        assert error is not None and error.startswith("CheckpointSaveError: "), where
        assert took < limit, where
        assert re.search(
            rf"manifest\.json: the object store did not answer \w+ within {DEADLINE}", error
        ), where
        assert "may still reach the store later" in error, where
        assert report["step"] == 2, f"rank {rank}: the late manifest's checkpoint was not loaded"
        assert_same_facts(report["facts"], report["want_facts"], f"rank {rank}")
        (version,) = report["versions"]  # the third save's; both older ones retired
        assert version.startswith("v00000003-"), report["versions"]
