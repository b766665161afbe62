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
mid-save and mid-load.
"""

from __future__ import annotations

import os
import re
import signal
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_megatron_fsdp.checkpoint.io import MegatronFSDPCheckpointIO
from lightning_megatron_fsdp.errors import CheckpointError
from tests.harness import run_distributed
from tests.object_store import SeaweedServer
from tests.s3_fault_proxy import Fault, FaultProxy
from tests.scripts.fault_injection import (
    checkpoint_dict,
    live_state,
    step,
    target_state,
    trained,
)
from tests.shard_facts import assert_same_facts, facts

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
    except CheckpointError as err:
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
    os.environ.update(env)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT)
    model, adam = trained(world_size)
    plugin = MegatronFSDPCheckpointIO()
    path = f"{url}/last.ckpt"
    plugin.save_checkpoint(checkpoint_dict(model, adam, 1), path)
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


def test_a_stopped_store_fails_save_and_load_within_the_timeout(seaweed: SeaweedServer) -> None:
    """SIGSTOP: the save's first request and the load's (rank 0 lists the checkpoint's
    versions, or a version's objects) go unanswered."""
    bucket = seaweed.new_bucket()
    url = f"s3://{bucket}/run"
    assert seaweed.process is not None
    try:
        reports = run_distributed(
            _saves_and_loads_while_paused,
            2,
            seaweed.env,
            url,
            seaweed.process.pid,
            init_process_group=False,
            timeout=180.0,
        )
    finally:
        seaweed.resume()
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
